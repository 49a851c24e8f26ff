"""What the retrieval tasks (passkey, needle) share: examples at depths × trials, scored two
ways, with Wilson intervals per depth.

Each example is a prompt of exactly L tokens including its answer (``eval.tasks.prompts``). It
is scored

- by **greedy generation** of the answer's token count + ``greedy_extra_tokens`` (default 2)
  tokens after the prompt (with the KV cache, as a user would decode), checked as the task
  says: the first integer in the output equals the key as an integer (YaRN's passkey scoring)
  or the key appears in it (RULER's);
- by **candidate log-likelihood**: the answer against ``candidates − 1`` seeded distractor keys
  with as many digits, each scored as the sum of its tokens' log-probabilities after the prompt;
  correct when the answer scores strictly highest (chance = 1 / candidates). It still separates
  strategies when generation fails everywhere.

Candidates share the prompt's KV cache (one prompt forward per example; each candidate's tokens
are taken back off the cache afterwards, so memory holds one cache, not one per candidate).
Dynamic strategies,
whose frequencies depend on the length of each forward, score them with full forwards instead,
so both scores are what a full forward over prompt + candidate gives.

Accuracy is reported per depth and overall, each with a 95% Wilson score interval
(Wilson 1927; Brown, Cai & DasGupta 2001).
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator, model_validator

from ropescale.attention import reusable_prefix
from ropescale.compat import cache_kwarg, output_cache
from ropescale.runs.memory import PY_LIST_SLOT, Need, forward_bytes, kv_cache_bytes, model_dims
from ropescale.runs.uncertainty import wilson

from .base import Metric, Task, TaskOptions, progress
from .prompts import Prompt, continuation, distractor_keys

__all__ = ["Example", "PrefixCache", "RetrievalOptions", "RetrievalTask", "contains_match", "first_integer_match",
           "wilson"]

MAX_CANDIDATES = 1000  # keys compared per example: each costs a forward per example and cell


def first_integer_match(output: str, answer: str) -> bool:
    """YaRN's passkey check: the first integer in ``output`` equals ``answer`` as an integer
    (YaRN compares ``int``s, so ``"060494"`` answers key 60494)."""
    m = re.search(r"\d+", output)
    return m is not None and int(m.group()) == int(answer)


def contains_match(output: str, answer: str) -> bool:
    """RULER's check: ``answer`` appears in ``output``."""
    return answer in output


class RetrievalOptions(TaskOptions):
    """What every retrieval task shares: depths, trials, the key's digits, candidates scored by likelihood, greedy
    decoding's extra tokens, seed."""

    depths: list[float] = Field(default=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0], min_length=1,
                                description="needle depths, fractions of the haystack (0 = start)")
    trials: int = Field(10, ge=1, description="examples per (length, depth), each with its own seeded key")
    digits: int = Field(5, ge=1, le=12, description="digits of the key")
    candidates: int = Field(10, ge=2, description="keys compared by log-likelihood, the answer among them")
    greedy_extra_tokens: int = Field(2, ge=0, description="greedy decoding runs for the answer's token count plus "
                                                          "this many tokens (room for a leading space or "
                                                          "punctuation before the check)")
    seed: int = 0

    def key(self) -> dict[str, Any]:
        # the default budget hashes as it did before it was an option: earlier folders still resume
        out = self.model_dump()
        if out["greedy_extra_tokens"] == 2:
            del out["greedy_extra_tokens"]
        return out

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        bad = [d for d in v if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"depths must lie in [0, 1]; got {bad}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _enough_keys(self) -> RetrievalOptions:
        keys = 9 * 10 ** (self.digits - 1)
        if self.candidates > keys:
            raise ValueError(f"candidates={self.candidates} is more than there are {self.digits}-digit keys")
        if self.candidates > MAX_CANDIDATES:
            examples = len(self.depths) * min(self.trials, keys)
            raise ValueError(f"candidates={self.candidates}: at most {MAX_CANDIDATES} (each candidate is one more "
                             f"forward per example in every cell: {self.candidates} × {examples} examples = "
                             f"{self.candidates * examples} forwards per cell; chance is already "
                             f"{1 / MAX_CANDIDATES:g} at {MAX_CANDIDATES})")
        if self.trials > keys:
            raise ValueError(f"trials={self.trials} is more than there are {self.digits}-digit keys ({keys}): "
                             "trials beyond that repeat keys, so they are not independent and the confidence "
                             f"interval would be too narrow; use at most {keys} trials (or more digits)")
        return self


@dataclass(frozen=True)
class Example:
    """One retrieval example: its prompt, the candidates' tokens (the answer first) and its depth's index."""

    prompt: Prompt
    candidates: list[list[int]]  # answer's tokens first, then the distractors'
    depth_index: int


class RetrievalTask(Task):
    """Base of the retrieval tasks; subclasses implement ``make_prompt``."""

    Options = RetrievalOptions
    engine_asks = frozenset({"generate", "logprobs"})
    match: ClassVar = staticmethod(first_integer_match)
    metrics = (Metric(key="accuracy", label="greedy exact-match accuracy", higher_is_better=True),
               Metric(key="candidate_accuracy", label="candidate log-likelihood accuracy", higher_is_better=True))

    objective_term = True  # a search can minimise the NLL of each example's key (candidate 0)

    @classmethod
    def objective_options(cls, examples: int) -> dict[str, Any]:
        """``examples`` depths spread evenly over [0, 1], one key each, two candidates (only the key is scored)."""
        n = examples
        return {"depths": [i / (n - 1) for i in range(n)] if n > 1 else [0.5], "trials": 1, "candidates": 2}

    def gold_answers(self, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
        """Each example's prompt ids and its key's tokens (the first candidate: the right one)."""
        return [(list(ex.prompt.ids), list(ex.candidates[0])) for ex in examples]

    def make_prompt(self, length: int, depth: float, rng: random.Random) -> Prompt:
        """One prompt of ``length`` tokens with the answer at ``depth`` (each task's own).

        Args:
            length: the prompt's length with its answer [tokens].
            depth: where the answer sits, 0 (start) to 1 (end).
            rng: the random source.

        Returns:
            The ``Prompt`` (ids and answer ids).
        """
        raise NotImplementedError

    def memory(self, length: int, model) -> Need:
        """Device: the prompt's KV cache (two when the cache cannot be rolled back and is copied
        per candidate: sliding-window layers) and one forward's activations over ``length``
        tokens; host: every example's prompt and candidates as token lists."""
        o = self.options
        dims = model_dims(model)
        itemsize = model.dtype.itemsize
        n = len(o.depths) * o.trials
        answer = o.digits + 2  # tokens of a key as it continues the question (at most one per digit, and room)
        kv = kv_cache_bytes(dims, length + answer + o.greedy_extra_tokens, itemsize)
        return Need(what=f"{self.name} at {length} tokens ({n} prompts, {o.candidates} candidates each)",
                    device={"KV cache": kv * (2 if dims.sliding_layers else 1),
                            "activations": forward_bytes(dims, length + answer, itemsize) + 8 * length},
                    host={"prompts": n * length * PY_LIST_SLOT,
                          "candidates": n * o.candidates * (answer * PY_LIST_SLOT + 64)})

    def examples(self, length: int) -> list[Example]:
        o = self.options
        out = []
        total = len(o.depths) * o.trials
        # thousands of prompts take minutes to build: a bar (on a terminal) says the run is not stuck
        bar = progress(total, f"{self.name} prompts @ {length}" if total >= 1000 else None, unit="ex")
        for di, depth in enumerate(o.depths):
            for trial in range(o.trials):
                rng = random.Random(f"{self.name}:{o.seed}:{length}:{depth}:{trial}")
                prompt = self.make_prompt(length, depth, rng)
                keys = [prompt.answer, *distractor_keys(rng, prompt.answer, o.candidates - 1)]
                cands = [prompt.answer_ids] + [continuation(self.tokenizer, prompt.question, k)[1] for k in keys[1:]]
                out.append(Example(prompt, cands, di))
                bar.update(1)
        bar.close()
        return out

    @torch.no_grad()
    def measure(self, model, examples, indices, *, length, strategy, device, desc) -> list:
        """Per example ``(index, exact, candidate)``. Examples whose prompts share a prefix share its KV
        cache (``PrefixCache``): each prompt's forward runs over what it does not share with the prompt
        before it — the haystack before a needle for passkey, the whole haystack for ``passkey_multi``'s
        questions. Dynamic strategies, whose frequencies follow each forward's length, and caches that
        cannot be rolled back (sliding-window layers) run every prompt whole."""
        rows = []
        bar = progress(len(indices), desc, unit="ex")
        prompts = PrefixCache(model, device, share=not strategy.dynamic)
        for i in prompts.order([examples[i].prompt.ids for i in indices], indices):
            ex = examples[i]
            last, cache = prompts.run(ex.prompt.ids)  # [V] log-probabilities after the prompt, its cache
            if strategy.dynamic:
                scores = candidate_scores_full(model, ex.prompt.ids, ex.candidates, device)
            else:
                scores = _candidate_scores_cached(model, last, cache, ex.candidates, device)
            generated = _greedy(model, last, cache, len(ex.prompt.answer_ids) + self.options.greedy_extra_tokens)
            prompts.generated()
            exact = type(self).match(self.tokenizer.decode(generated), ex.prompt.answer)
            rows.append((i, exact, bool(scores[0] > scores[1:].max())))
            bar.update(1)
        bar.close()
        return rows

    def engine_requests(self, examples) -> tuple[list[dict[str, Any]], int]:
        """Per example: its prompt with greedy generation of the answer's tokens and
        ``greedy_extra_tokens``, then the prompt followed by each candidate key, whose
        log-probabilities are asked; the first example's prompt with its answer is the checked one."""
        extra = self.options.greedy_extra_tokens
        reqs = []
        for ex in examples:
            reqs.append({"ids": ex.prompt.ids, "max_tokens": len(ex.prompt.answer_ids) + extra,
                         "prompt_logprobs": False})
            reqs += [{"ids": ex.prompt.ids + c, "max_tokens": 1, "prompt_logprobs": True} for c in ex.candidates]
        return reqs, 1

    def engine_parts(self, examples, results, length: int) -> list:
        """``(index, exact, candidate)`` per example, as ``measure`` gives them: the generated text
        checked by the task's match, and whether the true key's summed log-probability beats every
        distractor's."""
        rows, k = [], 0
        for i, ex in enumerate(examples):
            exact = type(self).match(self.tokenizer.decode(results[k]["tokens"]), ex.prompt.answer)
            scores = [sum(results[k + 1 + j]["logprobs"][-len(c):]) for j, c in enumerate(ex.candidates)]
            rows.append((i, exact, bool(scores[0] > max(scores[1:]))))
            k += 1 + len(ex.candidates)
        return rows

    @classmethod
    def engine_length(cls, options, length: int) -> int:
        return length + options.greedy_extra_tokens + 1

    def combine(self, parts, examples, *, length, strategy) -> dict[str, Any]:
        rows = sorted(x for part in parts for x in part)
        if [i for i, _, _ in rows] != list(range(len(examples))):
            raise RuntimeError("retrieval: the processes' parts do not cover every example exactly once")
        return summarise(examples, [e for _, e, _ in rows], [c for _, _, c in rows], self.options)

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        from ..plots import plot_depth_heatmaps, plot_metric

        paths = {"plot": output / "accuracy_vs_length.png", "heatmap": output / "depth_heatmap.png"}
        plot_metric(records, "accuracy", "greedy exact-match accuracy", paths["plot"], ci="accuracy_ci",
                    second=("candidate_accuracy", "candidate log-likelihood accuracy", "candidate_accuracy_ci"),
                    chance="chance")
        plot_depth_heatmaps(records, "accuracy", paths["heatmap"])
        return paths


class PrefixCache:
    """Prompts run through one KV cache, each forward over the tokens it does not share with the prompt
    before it: the cache is cropped back to the longest common prefix (exact: the cached keys and values
    of a prefix are what a forward over the whole prompt computes there, up to float rounding), then the
    rest of the prompt runs on it. ``order`` puts prompts that share long prefixes next to each other.
    With ``share`` False, or a cache that cannot be rolled back, every prompt runs whole. Under a rule whose
    map grows with the tokens seen (GALI's chunked prefill) the cache is cropped to its last piece cut before
    the common prefix ends (``ropescale.attention.reusable_prefix``), where a longer prompt's pieces agree.

    Memory: one cache of the longest prompt (plus what is generated after it), never one per prompt."""

    def __init__(self, model, device, *, share: bool):
        self.model, self.device, self.share = model, device, share
        self.cache, self.held = None, torch.empty(0, dtype=torch.long)
        self.name = cache_kwarg(model)

    def order(self, prompts: list[list[int]], indices: list[int]) -> list[int]:
        """``indices`` reordered so that each prompt follows the one it shares the longest prefix with
        (greedy, starting from the prompt that shares most with any other); unchanged without sharing."""
        if not self.share or len(prompts) < 3:
            return list(indices)
        width = max(map(len, prompts))
        ids = -1 - torch.arange(len(prompts))[:, None].expand(-1, width).clone()  # [m, n]: pads no two rows share
        for k, p in enumerate(prompts):
            ids[k, : len(p)] = torch.tensor(p)
        shared = lambda row: (ids == ids[row]).long().cumprod(1).sum(1)  # [m]: common prefix with each prompt
        best = [int(shared(k).topk(2).values[1]) for k in range(len(prompts))]
        current = max(range(len(prompts)), key=best.__getitem__)
        left, out = set(range(len(prompts))) - {current}, [current]
        while left:
            common = shared(current)
            current = max(left, key=lambda k: (int(common[k]), -k))
            left.discard(current)
            out.append(current)
        return [indices[k] for k in out]

    def run(self, prompt: list[int]) -> tuple[torch.Tensor, object]:
        """The log-probabilities ``[V]`` (float32) after ``prompt`` and the cache holding it."""
        ids = torch.tensor(prompt)
        start = 0
        if self.share and self.cache is not None and _rewindable(self.cache):
            n = min(len(ids), len(self.held))
            same = (ids[:n] == self.held[:n]).long().cumprod(0).sum()
            # what a longer prompt computes alike (GALI's chunked prefill: up to its last cut); at least one token
            # runs: its logits are the answer's
            start = min(reusable_prefix(self.model, int(same)), len(ids) - 1)
            _crop_to(self.cache, start)
        else:
            self.cache = None
        kw = {self.name: self.cache} if start else {}
        out = self.model(input_ids=ids[start:][None].to(self.device), use_cache=True, logits_to_keep=1, **kw)
        self.cache, self.held = output_cache(out), ids
        return out.logits[0, -1].float().log_softmax(-1), self.cache

    def generated(self) -> None:
        """Take what was generated after the prompt back off the cache (it is the next prompt's prefix only
        up to the prompt)."""
        if self.share and self.cache is not None and _rewindable(self.cache):
            _crop_to(self.cache, len(self.held))


def _crop_to(cache, length: int) -> None:
    """Keep the first ``length`` tokens of ``cache`` (``crop`` with a negative count: tokens to remove, the
    one meaning every supported transformers gives it)."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


def _rewindable(cache) -> bool:
    """Whether ``cache.crop`` can take tokens back exactly: every layer a plain ``DynamicLayer``
    (sliding-window layers cannot roll back past their window)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def _candidate_scores_cached(model, last: torch.Tensor, cache, candidates: list[list[int]], device) -> torch.Tensor:
    """Summed log-probabilities ``[K]`` of each candidate after the prompt, one candidate at a
    time on the prompt's cache: taken back with ``crop`` after each when the cache allows it,
    else on a copy — so memory holds at most two caches, never K (at 8B and 128k tokens one
    cache is 16 GiB)."""
    first = torch.tensor([c[0] for c in candidates], device=last.device)
    scores = last[first].double()  # [K]: the first token is predicted by the prompt's last logits
    if max(map(len, candidates)) == 1:
        return scores.cpu()
    rewind = _rewindable(cache)
    name = cache_kwarg(model)
    rest = []
    for c in candidates:
        if len(c) == 1:
            rest.append(scores.new_zeros(()))
            continue
        ids = torch.tensor([c], device=device)  # [1, D]
        own = cache if rewind else copy.deepcopy(cache)
        logp = model(input_ids=ids[:, :-1], **{name: own}, use_cache=True).logits.float().log_softmax(-1)
        rest.append(logp[0].gather(-1, ids[0, 1:, None]).double().sum())  # log p(c_j | prompt, c_<j), j ≥ 1
        if rewind:
            cache.crop(-(len(c) - 1))
    return (scores + torch.stack(rest)).cpu()


def candidate_scores_full(model, prompt: list[int], candidates: list[list[int]], device) -> torch.Tensor:
    """As ``_candidate_scores_cached``, with one full forward over prompt + candidate per
    candidate (one at a time: activations of one sequence, not K)."""
    n, out = len(prompt), []
    for c in candidates:
        ids = torch.tensor([prompt + c], device=device)  # [1, n+D]
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(c) + 1).logits  # [1, D+1, V]: positions n-1 …
        logp = logits[0, :-1].float().log_softmax(-1)  # [D, V]
        out.append(logp.gather(-1, ids[0, n:, None]).double().sum())
    return torch.stack(out).cpu()


def _greedy(model, last: torch.Tensor, cache, n: int) -> list[int]:
    """``n`` greedy tokens continuing the prompt whose last log-probs are ``last`` (cache updated in place)."""
    tok = last.argmax()
    out = [tok]
    name = cache_kwarg(model)
    for _ in range(n - 1):  # tokens stay on the device: one transfer at the end, no sync per step
        logits = model(input_ids=tok.view(1, 1), **{name: cache}, use_cache=True).logits
        tok = logits[0, -1].argmax()
        out.append(tok)
    return torch.stack(out).tolist()


def summarise(examples: list[Example], exact: list[bool], cand: list[bool], options: RetrievalOptions) -> dict:
    """The cell's metrics: overall and per-depth accuracies with Wilson intervals."""

    def stats(idx: list[int]) -> dict:
        n, e, c = len(idx), sum(exact[i] for i in idx), sum(cand[i] for i in idx)
        return {"trials": n, "accuracy": e / n, "accuracy_ci": list(wilson(e, n)),
                "candidate_accuracy": c / n, "candidate_accuracy_ci": list(wilson(c, n))}

    by_depth = []
    for di, depth in enumerate(options.depths):
        idx = [i for i, ex in enumerate(examples) if ex.depth_index == di]
        if idx:
            pos = sum(examples[i].prompt.needle_start for i in idx) / len(idx)
            by_depth.append({"depth": depth, "needle_token": round(pos, 1), **stats(idx)})
    return {**stats(list(range(len(examples)))), "chance": 1 / options.candidates,
            "prompt_tokens": sum(len(ex.prompt.ids) for ex in examples) // len(examples), "by_depth": by_depth}

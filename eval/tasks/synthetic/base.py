"""What the synthetic generation tasks share (``json_kv``, ``graphwalks``): built as the RULER tasks are
(``eval.tasks.ruler.base``) — samples generated offline from a seed and sized to fill L tokens of the model's
tokenizer, cached, read by the model with its tokenizer's special tokens, answered by batched greedy decoding with the
KV cache, scored per sample by the task's metric.

- **Lengths**: a sample's prompt — the tokens the model reads, special tokens included — plus the generation budget
  is at most L, never cut (``json_kv``'s ``pairs`` option cuts HELMET's way instead, and says so). The size (pairs,
  nodes) is searched as RULER's generators search theirs: a binary search (``eval.tasks.ruler.spec.binary_search``)
  over the probe sample's sizes (sample 0), then each sample drawn at that size and shrunk one step at a time while it
  is too long. A length whose smallest sample does not fit is refused in one line, naming the token count.
- **Seeds**: each sample draws from its own ``random.Random`` seeded with the task's name, ``seed``, the length and
  the sample's index, so the first k samples of a run of n are the samples of a run of k (what the cache relies on)
  and any sample can be redrawn alone.
- **Cache**: RULER's (``eval.tasks.ruler.cache``, ``$ROPESCALE_CACHE/ruler``): one entry per (task, generator
  version, options, length, tokenizer), under a file lock; refusals are cached too.
- **Decoding**: greedy, ``tokens_to_generate`` new tokens at most, stopping at the end-of-sequence token(s),
  ``batch_size`` prompts a forward (left-padded, positions counted from each prompt's start); attention-rule
  strategies decode one prompt at a time (their kernels take no padding mask) — ``ruler.base.greedy_batch``.
- **Engines**: a scoring engine outside this process answers one generation request per sample and the first
  sample's prompt log-probabilities (the engine's exactness check against this process), so any engine that answers
  generations and log-probabilities scores these tasks (``eval.engines.scoring``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import Field

from ropescale.runs.memory import PY_LIST_SLOT, Need, forward_bytes, kv_cache_bytes, model_dims

from ..base import Task, TaskOptions, progress
from ..prompts import PromptError
from ..ruler.base import greedy_batch
from ..ruler.cache import CacheStats, cached_samples, tokenizer_fingerprint
from ..ruler.spec import RulerSample, binary_search

__all__ = ["MAX_SIZE", "GeneratedExample", "GeneratedOptions", "GeneratedTask", "eos_ids", "fill", "fit",
           "sample_rng"]

MAX_SIZE = 1 << 24  # pairs or nodes: past this a size search is refused (RoPE's float32 positions end near 2^24)
Draft = TypeVar("Draft")


class GeneratedOptions(TaskOptions):
    """What every synthetic generation task has: samples, seed, generation budget, batch and the sample cache."""

    num_samples: int = Field(100, ge=1, description="samples per length")
    seed: int = Field(42, description="seed of the samples (each draws from its own: the task, this, the length and "
                                      "its index)")
    tokens_to_generate: int = Field(100, ge=1, description="greedy generation budget [tokens]; it counts in L")
    batch_size: int = Field(8, ge=1, description="prompts decoded together")
    cache: bool = Field(True, description="reuse generated samples across runs ($ROPESCALE_CACHE/ruler)")

    def key(self) -> dict[str, Any]:
        return self.model_dump(exclude={"batch_size", "cache"})


@dataclass(frozen=True)
class GeneratedExample:
    """A sample and the token ids the model reads (``[n]``, special tokens included)."""

    sample: RulerSample
    ids: list[int]


def sample_rng(task: str, seed: int, length: int, index: int) -> random.Random:
    """The random stream of one sample: ``random.Random`` seeded with ``"{task}:{seed}:{length}:{index}"`` (a string
    seed is hashed with SHA-512: the same stream in every process and Python version 3.2+)."""
    return random.Random(f"{task}:{seed}:{length}:{index}")


def fit(total: Callable[[int], int], limit: int, lower: int, *, what: str, smallest: str) -> int:
    """The largest size n ≥ ``lower`` with ``total(n) ≤ limit``, found as RULER's generators find theirs.

    Args:
        total: tokens of the probe sample at size n, with the generation budget (nondecreasing in n).
        limit: the length L [tokens].
        lower: the smallest size a sample has.
        what: the task and length, as messages name them (``json_kv at 512 tokens``).
        smallest: what the smallest sample holds, for the refusal (``one pair, 2 demos and the question``).

    Returns:
        The size: the upper end is estimated from two probes, doubled while it still fits, then
        ``ruler.spec.binary_search`` (one probe per size, as RULER's) finds the largest that fits.

    Raises:
        PromptError: the smallest sample is longer than ``limit``, or no size up to ``MAX_SIZE`` stops fitting.
    """
    first = total(lower)
    if first > limit:
        raise PromptError(f"{what}: no example fits: {smallest} take {first} tokens with the generation budget, "
                          f"more than {limit}")
    step = 8
    per = max((total(lower + step) - first) / step, 1e-3)  # tokens per unit of size
    upper = lower + int((limit - first) / per * 1.5) + 1
    while total(upper) <= limit:
        if upper >= MAX_SIZE:
            raise PromptError(f"{what}: the size search passed {MAX_SIZE} without a sample longer than {limit} "
                              "tokens: the tokenizer does not count this task's text")
        lower, upper = upper, min(2 * upper, MAX_SIZE)
    return binary_search(total, lower, upper, limit)


def fill(draw: Callable[[int, int], Draft], total: Callable[[Draft], int], *, num_samples: int, limit: int,
         lower: int, what: str, smallest: str) -> list[tuple[Draft, int]]:
    """``num_samples`` samples of at most ``limit`` tokens each, sized as RULER sizes its samples.

    Args:
        draw: ``(index, size) → draft``: sample ``index`` drawn at a size (from its own seed: redrawing gives the
            same draft).
        total: a draft's tokens as the model reads them, with the generation budget.
        num_samples: how many.
        limit: the length L [tokens].
        lower: the smallest size.
        what: the task and length, as messages name them.
        smallest: what the smallest sample holds (``fit``).

    Returns:
        ``(draft, tokens)`` per sample: sample 0's size is searched (``fit``), every sample is drawn at it and, while
        longer than ``limit``, redrawn one size smaller.

    Raises:
        PromptError: the smallest sample does not fit.
    """
    size = fit(lambda n: total(draw(0, n)), limit, lower, what=what, smallest=smallest)
    out = []
    for i in range(num_samples):
        n = size
        draft = draw(i, n)
        tokens = total(draft)
        while tokens > limit:
            n -= 1
            if n < lower:
                raise PromptError(f"{what}: no example fits: sample {i} at its smallest ({smallest}) takes {tokens} "
                                  f"tokens with the generation budget, more than {limit}")
            draft = draw(i, n)
            tokens = total(draft)
        out.append((draft, tokens))
    return out


def eos_ids(tokenizer, model) -> list[int]:
    """The token ids that end a generation: the model's generation config's and the tokenizer's EOS, sorted."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


class GeneratedTask(Task):
    """Base of the synthetic generation tasks: subclasses set ``name``, ``Options``, ``metrics`` (the first is the
    headline, also each sample's ``sample_scores``), ``generator`` and implement ``generate`` and ``score``."""

    Options = GeneratedOptions
    engine_asks = frozenset({"generate", "logprobs"})
    generator: ClassVar[str]  # the generator's version, in the cache key: a change of format gets new entries

    @property
    def budget(self) -> int:
        """Tokens generated per answer."""
        return self.options.tokens_to_generate

    def input_ids(self, prompt: str) -> list[int]:
        """The tokens the model reads: the tokenizer's special tokens, but no second BOS where the prompt already
        starts with it (as ``RulerTask.input_ids``)."""
        bos = self.tokenizer.bos_token
        return self.tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]

    def total(self, prompt: str) -> int:
        """A prompt's tokens as the model reads them, plus the generation budget: what must fit L."""
        return len(self.input_ids(prompt)) + self.budget

    def generate(self, length: int, num_samples: int) -> list[RulerSample]:
        """The task's samples at a length (its generator's).

        Args:
            length: the samples' length [tokens].
            num_samples: how many.

        Returns:
            The samples (``input`` + ``answer_prefix`` is what the model reads; ``outputs`` the gold answers).
        """
        raise NotImplementedError

    def score(self, sample: RulerSample, prediction: str) -> dict[str, float]:
        """One sample's scores in [0, 1], by metric key (every key of ``metrics`` whose per-sample mean is reported).

        Args:
            sample: the sample.
            prediction: the decoded greedy generation.

        Returns:
            ``{metric key: score}``.
        """
        raise NotImplementedError

    def details(self, examples: list[GeneratedExample], predictions: list[str],
                scores: list[dict[str, float]]) -> dict[str, Any]:
        """What the task adds to a cell's record beside its metrics (default: nothing).

        Args:
            examples: the cell's examples.
            predictions: the decoded generations, in example order.
            scores: ``score``'s per sample.

        Returns:
            Extra record fields.
        """
        return {}

    def cache_key(self, length: int) -> dict[str, Any]:
        """What names the samples at a length in the cache: the task, its generator's version, its options (but the
        sample count, batch and cache), the length and the tokenizer's fingerprint.

        Args:
            length: the samples' length [tokens].

        Returns:
            The key (JSON values).
        """
        return {"task": self.name, "generator": self.generator, "length": length,
                "options": self.options.model_dump(exclude={"batch_size", "cache", "num_samples"}),
                "tokenizer": tokenizer_fingerprint(self.tokenizer)}

    @cached_property
    def generation(self) -> dict[int, CacheStats]:
        """How each length's samples were had (cache hit or generated, seconds)."""
        return {}

    def samples(self, length: int) -> list[RulerSample]:
        """The task's samples at a length, from the cache or generated (and cached).

        Args:
            length: the samples' length [tokens].

        Returns:
            ``num_samples`` samples.
        """
        o = self.options
        samples, stats = cached_samples(self.cache_key(length), o.num_samples,
                                        lambda: self.generate(length, o.num_samples), use=o.cache)
        self.generation[length] = stats
        logging.getLogger("ropescale").info("%s @ %d: %d samples %s in %.2fs", self.name, length, len(samples),
                                            "read from the cache" if stats.cached else "generated", stats.seconds)
        return samples

    def examples(self, length: int) -> list[GeneratedExample]:
        if length <= self.budget:
            raise PromptError(f"{self.name}: length {length} leaves no room for a prompt beside the generation budget "
                              f"of {self.budget} tokens (tokens_to_generate)")
        return [GeneratedExample(s, self.input_ids(s.prompt)) for s in self.samples(length)]

    def memory(self, length: int, model) -> Need:
        """Device: the KV cache of ``batch_size`` prompts and their answers, and one forward's activations over them;
        host: the samples' token ids."""
        o = self.options
        dims = model_dims(model)
        itemsize = model.dtype.itemsize
        return Need(what=f"{self.name} at {length} tokens ({o.num_samples} samples, batch {o.batch_size})",
                    device={"KV cache": kv_cache_bytes(dims, length + 8, itemsize, batch=o.batch_size),
                            "activations": forward_bytes(dims, length, itemsize, batch=o.batch_size)},
                    host={"prompts": o.num_samples * length * PY_LIST_SLOT})

    @torch.no_grad()
    def measure(self, model, examples, indices, *, length, strategy, device, desc) -> list:
        """``(index, decoded generation)`` per example: greedy, ``batch_size`` prompts at a time (one for
        attention-rule strategies), longest first."""
        batch = 1 if strategy.kind == "attention" else self.options.batch_size
        eos = eos_ids(self.tokenizer, model)
        order = sorted(indices, key=lambda i: -len(examples[i].ids))  # similar lengths together: less padding
        out = []
        bar = progress(len(order), desc, unit="ex")
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            gens = greedy_batch(model, [examples[i].ids for i in chunk], self.budget, eos, device,
                                pad_id=self.tokenizer.pad_token_id)
            out += [(i, self.tokenizer.decode(g, skip_special_tokens=True)) for i, g in zip(chunk, gens)]
            bar.update(len(chunk))
        bar.close()
        return out

    def engine_requests(self, examples) -> tuple[list[dict[str, Any]], int]:
        """One greedy generation of ``tokens_to_generate`` tokens per example, then the first example's prompt with
        its log-probabilities asked: the checked request (the last)."""
        reqs = [{"ids": ex.ids, "max_tokens": self.budget, "prompt_logprobs": False} for ex in examples]
        reqs.append({"ids": examples[0].ids, "max_tokens": 1, "prompt_logprobs": True})
        return reqs, len(examples)

    def engine_parts(self, examples, results, length: int) -> list:
        """``(index, decoded generation)`` per example, as ``measure`` gives them."""
        return [(i, self.tokenizer.decode(results[i]["tokens"], skip_special_tokens=True))
                for i in range(len(examples))]

    @classmethod
    def engine_length(cls, options, length: int) -> int:
        return length  # every prompt and its budget fit L

    def combine(self, parts, examples, *, length, strategy) -> dict[str, Any]:
        rows = sorted(x for part in parts for x in part)
        if [i for i, _ in rows] != list(range(len(examples))):
            raise RuntimeError(f"{self.name}: the processes' parts do not cover every example exactly once")
        preds = [p for _, p in rows]
        per = [self.score(ex.sample, p) for ex, p in zip(examples, preds)]
        means = {k: round(100 * sum(s[k] for s in per) / len(per), 2) for k in per[0]}
        tokens = [len(ex.ids) for ex in examples]
        stats = self.generation.get(length)
        return {**means, "samples": len(per), "tokens_to_generate": self.budget, "prompt_tokens": tokens,
                "prompt_tokens_max": max(tokens), "sample_scores": [s[self.metrics[0].key] for s in per],
                "predictions": preds[:3],
                "generation": {"cached": stats.cached, "seconds": round(stats.seconds, 3)} if stats else None,
                **self.details(examples, preds, per)}

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        from ...plots import plot_metric

        head = cls.metrics[0]
        path = output / f"{head.key}_vs_length.png"
        plot_metric(records, head.key, head.label, path)
        return {"plot": path}

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

import random
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import Field

from ..base import TaskOptions
from ..prompts import PromptError
from ..ruler.base import GreedyTask, RulerExample
from ..ruler.cache import tokenizer_fingerprint
from ..ruler.spec import RulerSample, binary_search

__all__ = ["MAX_SIZE", "GeneratedExample", "GeneratedOptions", "GeneratedTask", "fill", "fit", "sample_rng"]

GeneratedExample = RulerExample  # a sample and the token ids the model reads ([n], special tokens included)
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


class GeneratedTask(GreedyTask):
    """Base of the synthetic generation tasks: subclasses set ``name``, ``Options``, ``metrics`` (the first is the
    headline, also each sample's ``sample_scores``), ``generator`` and implement ``generate`` and ``score``; the
    samples, their cache, the tokens the model reads, the memory a cell needs and the greedy decoding are RULER's
    (``ruler.base.GreedyTask``)."""

    Options = GeneratedOptions
    engine_asks = frozenset({"generate", "logprobs"})
    generator: ClassVar[str]  # the generator's version, in the cache key: a change of format gets new entries

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # a search can minimise the NLL of each sample's gold answer where the task writes it (``gold_text``)
        cls.objective_term = cls.gold_text is not GeneratedTask.gold_text

    @classmethod
    def objective_options(cls, examples: int) -> dict[str, Any]:
        """``num_samples`` = ``examples``."""
        return {"num_samples": examples}

    def gold_text(self, sample: RulerSample) -> str:
        """The text a correct answer continues the sample's prompt with (the metric's reading of it scores 1)."""
        raise NotImplementedError

    def gold_answers(self, examples: list[RulerExample]) -> list[tuple[list[int], list[int]]]:
        """Each example's prompt ids and its ``gold_text``'s tokens as they continue the prompt: the prompt and the
        answer encoded together, cut at the prompt's tokens (lm-eval's split; a SentencePiece tokenizer would
        add a word-start marker to the answer encoded alone), else the answer alone where the two merge."""
        out = []
        for ex in examples:
            gold, ids = self.gold_text(ex.sample), list(ex.ids)
            whole = self.input_ids(ex.sample.prompt + gold)
            apart = whole[len(ids):] if whole[:len(ids)] == ids and len(whole) > len(ids) else None
            out.append((ids, apart or self.tokenizer(gold, add_special_tokens=False)["input_ids"]))
        return out

    @property
    def budget(self) -> int:
        """Tokens generated per answer."""
        return self.options.tokens_to_generate

    def total(self, prompt: str) -> int:
        """A prompt's tokens as the model reads them, plus the generation budget: what must fit L."""
        return len(self.input_ids(prompt)) + self.budget

    def score(self, sample: RulerSample, prediction: str) -> dict[str, float]:
        """One sample's scores in [0, 1], by metric key (every key of ``metrics`` whose per-sample mean is reported).

        Args:
            sample: the sample.
            prediction: the decoded greedy generation.

        Returns:
            ``{metric key: score}``.
        """
        raise NotImplementedError

    def details(self, examples: list[RulerExample], predictions: list[str],
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
        preds = self.predictions(parts, examples)
        per = [self.score(ex.sample, p) for ex, p in zip(examples, preds)]
        means = {k: round(100 * sum(s[k] for s in per) / len(per), 2) for k in per[0]}
        return {**means, "samples": len(per), "tokens_to_generate": self.budget, **self.prompt_record(examples, length),
                "sample_scores": [s[self.metrics[0].key] for s in per], "predictions": preds[:3],
                **self.details(examples, preds, per)}

"""Labelled passkeys: several pass keys, each under its own label, hidden at several depths of one haystack of
passkey filler; the model is asked for each in turn ("What is the pass key number 37? The pass key number 37
is"). A task of its own, not passkey: the other keys of the haystack stand in the context as distractors (as
in RULER's ``niah_multikey``, Hsieh et al. 2024, arXiv:2404.06654), so it asks more than passkey does —
find the key *with this label*.

It exists for cost. The questions about one haystack share it, so its KV cache is computed once and each
question runs a few dozen tokens on it (``eval.tasks.retrieval.PrefixCache``): ``len(depths)`` trials for
one forward over L tokens, where passkey pays one forward per trial — what makes 20 trials per cell affordable
at 32k tokens on a CPU. The trials of one haystack share it, so they are not independent: the Wilson
interval over all trials is the interval of independent trials, narrower than a cluster-aware one would be;
results state the haystacks beside the trials.

Format: passkey's filler sentences (``eval.tasks.passkey``) repeated to fill the length, a needle line "The
pass key number {label} is {key}. Remember it. {key} is the pass key number {label}." at each depth (labels
distinct numbers 10–99 in a seeded order, keys distinct seeded numbers of ``digits`` digits), then the
question. Length L counts the longest question's prompt and answer; the others are up to a few tokens
shorter (their labels' tokens). Scored as passkey: the first integer generated equals the key, and the key
against the haystack's other keys (then random ones) by log-likelihood.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field, field_validator, model_validator

from .passkey import PREAMBLE, filler_units
from .prompts import SEPARATOR, Prompt, PromptError, continuation, cycle_units, distractor_keys, encode
from .retrieval import Example, RetrievalOptions, RetrievalTask, first_integer_match

__all__ = ["INFO", "QUESTION", "PasskeyMulti", "PasskeyMultiOptions", "haystack_prompts"]

INFO = "The pass key number {label} is {key}. Remember it. {key} is the pass key number {label}."
QUESTION = "What is the pass key number {label}? The pass key number {label} is"
LABELS = range(10, 100)  # two-digit labels: one token count for every question in most tokenizers


class PasskeyMultiOptions(RetrievalOptions):
    """Labelled passkeys' options: a key at each depth of every haystack, ``trials`` haystacks per length."""

    depths: list[float] = Field(default=[0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95], min_length=2,
                                description="depths of the labelled keys, one key each, in every haystack")
    trials: int = Field(2, ge=1, description="haystacks per length, each asked for every one of its keys")
    preamble: bool = Field(False, description="start with the landmark-attention task line")

    @field_validator("depths", mode="before")
    @classmethod
    def _distinct(cls, v: Any) -> Any:
        # before RetrievalOptions' sorted(set(...)): a repeated depth would silently drop a key (and the two the
        # task needs at least)
        if isinstance(v, list | tuple):
            seen = [d for i, d in enumerate(v) if d in v[:i]]
            if seen:
                raise ValueError(f"depths must be distinct (one labelled key each); {seen[0]!r} is given twice")
        return v

    @model_validator(mode="after")
    def _labels(self) -> PasskeyMultiOptions:
        if len(self.depths) > len(LABELS):
            raise ValueError(f"at most {len(LABELS)} depths (one labelled key each); got {len(self.depths)}")
        return self


def haystack_prompts(tokenizer, units, *, length: int, depths: list[float], labels: list[int], keys: list[str],
                     preamble: bool = False) -> list[Prompt]:
    """One haystack with key ``keys[k]`` under label ``labels[k]`` at ``depths[k]``, and a prompt per key: the
    haystack followed by that key's question. The longest question's prompt with its answer is ``length``
    tokens. Raises ``PromptError`` when ``length`` cannot hold the needles, a question and its answer."""
    head = encode(tokenizer, PREAMBLE + SEPARATOR) if preamble else []
    needles = [encode(tokenizer, SEPARATOR + INFO.format(label=lab, key=key) + SEPARATOR)
               for lab, key in zip(labels, keys)]
    asked = [continuation(tokenizer, SEPARATOR + QUESTION.format(label=lab), key) for lab, key in zip(labels, keys)]
    fixed = len(head) + sum(map(len, needles)) + max(len(q) + len(a) for q, a in asked)
    budget = length - fixed
    if budget < 1:
        raise PromptError(f"length {length} is too short for {len(keys)} labelled keys: the needles, a question and "
                          f"its answer alone take {fixed} tokens")
    hay, bounds = [], [0]
    while len(hay) < budget:
        hay += next(units)
        bounds.append(min(len(hay), budget))
    hay = hay[:budget]
    cuts = [min(bounds, key=lambda b, d=d: (abs(b - d * budget), b)) for d in depths]
    ids, spans, at = list(head), [], 0
    for k in sorted(range(len(depths)), key=lambda k: (cuts[k], k)):  # needles in haystack order
        ids += hay[at:cuts[k]]
        spans.append((k, len(ids), len(ids) + len(needles[k])))
        ids += needles[k]
        at = cuts[k]
    ids += hay[at:]
    span = {k: (s, e) for k, s, e in spans}
    return [Prompt(ids + q, key, a, span[k][0], span[k][1], depths[k], SEPARATOR + QUESTION.format(label=labels[k]))
            for k, ((q, a), key) in enumerate(zip(asked, keys))]


class PasskeyMulti(RetrievalTask):
    """Labelled passkeys: a key under its own label at each depth of one haystack, each asked for in turn."""

    name = "passkey_multi"
    Options = PasskeyMultiOptions
    match = staticmethod(first_integer_match)

    def examples(self, length: int) -> list[Example]:
        """Per haystack (``trials`` of them), one example per depth: its key asked for after the haystack, the
        candidates the key, the haystack's other keys, then seeded random keys."""
        o = self.options
        out = []
        for trial in range(o.trials):
            rng = random.Random(f"{self.name}:{o.seed}:{length}:{trial}")
            labels = rng.sample(list(LABELS), len(o.depths))
            keys = distractor_keys(rng, "0" * o.digits, len(o.depths))  # distinct keys of o.digits digits
            prompts = haystack_prompts(self.tokenizer, cycle_units(filler_units(self.tokenizer)), length=length,
                                       depths=o.depths, labels=labels, keys=keys, preamble=o.preamble)
            for di, prompt in enumerate(prompts):
                others = [k for k in keys if k != prompt.answer][: o.candidates - 1]
                randoms = distractor_keys(rng, prompt.answer, o.candidates - 1 + len(others))
                pool = others + [k for k in randoms if k not in others][: o.candidates - 1 - len(others)]
                cands = [prompt.answer_ids] + [continuation(self.tokenizer, prompt.question, k)[1] for k in pool]
                out.append(Example(prompt, cands, di))
        return out

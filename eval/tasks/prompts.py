"""Retrieval prompts: a haystack with one needle line at a chosen depth, then a question.

Used by the passkey and needle tasks, and by the reference model's training mix (the same
templates over training text), so what the bundled model learns to retrieve is what is asked.

Everything is built in tokens of the model's tokenizer, so a prompt hits its target length
exactly: ``head`` (optional) + haystack units before the needle + needle line + the rest of the
haystack + question, and then the answer. The haystack is a stream of *units* (filler sentences,
or sentences of real text); the needle goes at the unit boundary nearest to
``depth × haystack tokens``, so it sits at the requested depth within one unit. The last unit is
cut to fill the budget exactly.

Lengths are in tokens; ``length`` counts the prompt *and* the answer, so a prompt of length T
keeps the whole retrieval inside a model's training window T.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ropescale.errors import RopescaleError

__all__ = [
    "Prompt",
    "PromptError",
    "build_prompt",
    "cycle_units",
    "distractor_keys",
    "encode",
    "random_key",
    "sentence_units",
]

SEPARATOR = "\n"


class PromptError(RopescaleError, ValueError):
    """The requested length cannot hold the prompt."""


@dataclass(frozen=True)
class Prompt:
    """One retrieval example.

    ids: prompt tokens, ending just before the answer. answer: the expected string (digits);
    answer_ids: its tokens as they continue the prompt. needle_start/needle_end: token span of
    the needle line in ``ids``; depth: the requested depth (0 = start of the haystack, 1 = end);
    question: the text the answer continues (``continuation`` splits other answers after it).
    """

    ids: list[int]
    answer: str
    answer_ids: list[int]
    needle_start: int
    needle_end: int
    depth: float
    question: str = ""

    @property
    def length(self) -> int:
        """The prompt's tokens with its answer [tokens]."""
        return len(self.ids) + len(self.answer_ids)


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, without special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def continuation(tokenizer, context: str, answer: str) -> tuple[list[int], list[int]]:
    """``(context tokens, answer tokens)`` where the answer follows the context after a space,
    split the way lm-eval splits a context and its continuation (encode the whole, cut at the
    context's tokens); falls back to encoding the answer alone when the tokenizer merges across
    the boundary."""
    ctx = encode(tokenizer, context)
    whole = encode(tokenizer, f"{context} {answer}")
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, encode(tokenizer, f" {answer}")


def build_prompt(tokenizer, units: Iterator[list[int]], *, length: int, depth: float, needle: str,
                 question: str, answer: str, head: str | None = None) -> Prompt:
    """A prompt of exactly ``length`` tokens (prompt + answer) with ``needle`` at ``depth``.

    ``units`` yields haystack units (token lists) and must not run out. Raises ``PromptError``
    when ``length`` leaves no room for a haystack, and ``ValueError`` for a depth outside [0, 1].
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be between 0 and 1")
    head_ids = encode(tokenizer, head + SEPARATOR) if head else []
    needle_ids = encode(tokenizer, SEPARATOR + needle + SEPARATOR)
    question = SEPARATOR + question
    question_ids, answer_ids = continuation(tokenizer, question, answer)
    fixed = len(head_ids) + len(needle_ids) + len(question_ids) + len(answer_ids)
    budget = length - fixed
    if budget < 1:
        raise PromptError(f"length {length} is too short for this prompt: the needle, question and "
                          f"answer alone take {fixed} tokens")
    hay: list[int] = []
    bounds = [0]
    while len(hay) < budget:
        hay += next(units)
        bounds.append(min(len(hay), budget))
    hay = hay[:budget]
    cut = min(bounds, key=lambda b: (abs(b - depth * budget), b))
    ids = head_ids + hay[:cut] + needle_ids + hay[cut:] + question_ids
    start = len(head_ids) + cut
    return Prompt(ids, answer, answer_ids, start, start + len(needle_ids), depth, question)


def random_key(rng: random.Random, digits: int) -> str:
    """A number with exactly ``digits`` digits (no leading zero)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def distractor_keys(rng: random.Random, answer: str, n: int) -> list[str]:
    """``n`` distinct keys with as many digits as ``answer``, none equal to it."""
    digits = len(answer)
    if n >= 9 * 10 ** (digits - 1):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit distractors")
    out: dict[str, None] = {}
    while len(out) < n:
        key = random_key(rng, digits)
        if key != answer:
            out[key] = None
    return list(out)


def cycle_units(units: list[list[int]], start: int = 0) -> Iterator[list[int]]:
    """The units from index ``start`` on, wrapping around forever."""
    return itertools.islice(itertools.cycle(units), start, None)


def sentence_units(tokenizer, docs: Iterable[list[int]], max_unit: int = 64) -> list[list[int]]:
    """Cut token streams into sentence-like units: a unit ends after a token whose text ends a
    sentence (``.``, ``!``, ``?``, ``;``, ``:``) or holds a newline, at a document's end, or after
    ``max_unit`` tokens."""
    docs = [list(d) for d in docs]
    vocab = {t for d in docs for t in d}
    ends = {t for t in vocab if (s := tokenizer.decode([t])) and ("\n" in s or s.rstrip()[-1:] in ".!?;:")}
    units: list[list[int]] = []
    for doc in docs:
        cur: list[int] = []
        for t in doc:
            cur.append(t)
            if t in ends or len(cur) >= max_unit:
                units.append(cur)
                cur = []
        if cur:
            units.append(cur)
    return units

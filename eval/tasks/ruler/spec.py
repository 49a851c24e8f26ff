"""RULER's fixed parts (NVIDIA/RULER at ``c3f5e3b4``): task templates, answer prefixes and generation
budgets (``scripts/data/synthetic/constants.py``), the model template joined as ``scripts/data/prepare.py``
joins it, the prediction clean-up and metrics (``scripts/eval/evaluate.py``,
``scripts/eval/synthetic/constants.py``), and the size search every generator runs.

Scores are RULER's: per example the share of reference strings found case-insensitively in the
cleaned prediction (``string_match_all``) or 1 if any is found (``string_match_part``), averaged
over examples, × 100, rounded to 2 decimals.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..prompts import PromptError

__all__ = ["FAMILIES", "REPORT_EVERY", "Family", "RulerSample", "TooLong", "binary_search", "join_template",
           "postprocess_pred", "shrink_until_fits", "string_match_all", "string_match_part"]


@dataclass(frozen=True)
class Family:
    """One generator's template, answer prefix, generation budget (tokens) and metric."""

    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: Literal["string_match_all", "string_match_part"]


FAMILIES: dict[str, Family] = {
    "niah": Family(
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
        "for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128,
        "string_match_all"),
    "variable_tracking": Family(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
        "the value {query}, they are: ", 30, "string_match_all"),
    "common_words_extraction": Family(
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:", 120, "string_match_all"),
    "freq_words_extraction": Family(
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:", 50,
        "string_match_all"),
    "qa": Family(
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:", 32, "string_match_part"),
}

REPORT_EVERY = 100_000  # draws at the smallest size between two "still drawing" log lines


@dataclass(frozen=True)
class RulerSample:
    """One example as RULER's generator writes it (``validation.jsonl``): ``input`` (the prompt up to
    the answer prefix), ``answer_prefix``, ``outputs`` (the reference strings) and ``length`` (the
    prompt's tokens + the generation budget, as RULER counts them: ``tokenizer.tokenize``, no
    special tokens); ``token_position_answer``: niah's token position of the first answer."""

    index: int
    input: str
    outputs: tuple[str, ...]
    length: int
    answer_prefix: str
    token_position_answer: int | None = None

    @property
    def prompt(self) -> str:
        """What the model reads (RULER's ``call_api.py``: input + answer_prefix)."""
        return self.input + self.answer_prefix

    def to_json(self) -> dict[str, Any]:
        """The sample as RULER's JSONL writes it.

        Returns:
            ``{"index", "input", "outputs", "length", "answer_prefix"[, "token_position_answer"]}``.
        """
        out = {"index": self.index, "input": self.input, "outputs": list(self.outputs), "length": self.length,
               "answer_prefix": self.answer_prefix}
        if self.token_position_answer is not None:
            out["token_position_answer"] = self.token_position_answer
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RulerSample:
        """A sample from RULER's JSONL record.

        Args:
            d: the record (``to_json``'s keys).

        Returns:
            The sample.
        """
        return cls(d["index"], d["input"], tuple(d["outputs"]), d["length"], d["answer_prefix"],
                   d.get("token_position_answer"))


def join_template(family: Family, model_template: str) -> str:
    """prepare.py: ``model_template.format(task_template=template) + answer_prefix``."""
    return model_template.format(task_template=family.template) + family.answer_prefix


def split_answer_prefix(family: Family, text: str) -> tuple[str, str]:
    """RULER: ``text.rfind(answer_prefix[:10])`` splits the prompt into (input, answer_prefix)."""
    i = text.rfind(family.answer_prefix[:10])
    return text[:i], text[i:]


def binary_search(total_tokens: Callable[[int], int], lower: int, upper: int, max_seq_length: int) -> int | None:
    """The largest size in [lower, upper] whose ``total_tokens`` fits ``max_seq_length``, searched as
    every RULER generator searches (one draw per probe: the probes consume the random streams)."""
    best = None
    while lower <= upper:
        mid = (lower + upper) // 2
        if total_tokens(mid) <= max_seq_length:
            best, lower = mid, mid + 1
        else:
            upper = mid - 1
    return best


class TooLong(Exception):
    """A drawn example of ``total`` tokens (with the generation budget) is longer than ``limit``."""

    def __init__(self, total: int = 0, limit: int = 0):
        super().__init__(total, limit)
        self.total, self.limit = total, limit

    def __str__(self) -> str:
        return f"{self.total} tokens with the generation budget, more than {self.limit}"


def fitting(input_output: Callable[[int], tuple[str, list[str]]], count: Callable[[str], int], budget: int,
            max_seq_length: int) -> Callable[[int], tuple[str, list[str], int]]:
    """The ``attempt`` of ``shrink_until_fits`` every generator uses: one draw ``input_output(size)`` →
    ``(text, answers, tokens)``, the tokens counted with the generation ``budget``; ``TooLong`` past
    ``max_seq_length``."""
    def attempt(size: int) -> tuple[str, list[str], int]:
        text, answer = input_output(size)
        length = count(text) + budget
        if length > max_seq_length:
            raise TooLong(length, max_seq_length)
        return text, answer, length
    return attempt


def shrink_until_fits(attempt: Callable[[int], Any], size: int, incremental: int, *, what: str,
                      floor: Callable[[int], int], max_draws: int | None = None) -> Any:
    """RULER's per-sample loop, draw for draw: ``attempt(size)``; on failure (too long, or a draw
    impossible at this size) retry ``incremental`` smaller, and at the smallest size retry with
    fresh draws until one fits — RULER's ``while True``, with no cap on the draws unless
    ``max_draws`` is given (a length RULER fills after 28,000 draws is filled here with the same
    sample).

    ``PromptError`` where no draw at the smallest size can fit, decided from the sizes:
    ``floor(size)`` — the fewest tokens, with the generation budget, any draw at that size has (its
    fixed text: every drawn key, value and word left out, each at least one token of a real draw;
    ``TooLong.limit`` is the length) — is over the length, or the draw itself is impossible at that
    size (``ValueError`` / ``IndexError``: more needles than haystack lines, a sample larger than
    its population — errors of the sizes, which every draw repeats). Also after ``max_draws``
    draws at the smallest size, where the caller departs from RULER so. A "still drawing" line is
    logged every ``REPORT_EVERY`` draws at the smallest size."""
    tries, least, shortest = 0, None, None
    while True:
        try:
            return attempt(size)
        except (TooLong, ValueError, IndexError) as e:
            if isinstance(e, PromptError):
                raise
            if size > incremental:
                size -= incremental
                continue
            if not isinstance(e, TooLong):
                raise PromptError(f"{what}: no example fits: at the smallest haystack (size {size}) no draw is "
                                  f"possible ({type(e).__name__}: {e})") from None
            if least is None:
                least = floor(size)
            if least > e.limit:
                raise PromptError(f"{what}: no example fits: every draw at the smallest haystack (size {size}) takes "
                                  f"at least {least} tokens with the generation budget (its fixed text), more "
                                  f"than {e.limit}") from None
            tries += 1
            shortest = e if shortest is None or e.total < shortest.total else shortest
            if max_draws is not None and tries >= max_draws:
                raise PromptError(f"{what}: no example fits in max_draws={max_draws} draws at the smallest haystack "
                                  f"(size {size}): the shortest {shortest} (a draw of {least} would fit; RULER keeps "
                                  "drawing)") from None
            if tries % REPORT_EVERY == 0:
                logging.getLogger("ropescale").warning(
                    "%s: still drawing: %d draws at the smallest haystack (size %d) were longer than %d tokens (the "
                    "shortest %d); a draw can fit (its fixed text takes %d), and RULER keeps drawing until one does "
                    "(max_draws bounds it)", what, tries, size, e.limit, shortest.total, least)


def postprocess_pred(pred: str) -> str:
    """evaluate.py: strip, every control character (\\x00–\\x1f) made a newline, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Mean over examples of the share of references found (case-insensitive) in the prediction, × 100, to 2 places."""
    score = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                for p, ref in zip(preds, refs)) / len(preds) * 100
    return round(score, 2)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """Share of examples where any reference is found (case-insensitive) in the prediction, × 100, to 2 places."""
    score = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs)) \
        / len(preds) * 100
    return round(score, 2)


def sample_score(metric: str, pred: str, ref: list[str]) -> float:
    """One example's term of ``metric`` (before averaging and × 100)."""
    hits = [1.0 if r.lower() in pred.lower() else 0.0 for r in ref]
    return sum(hits) / len(hits) if metric == "string_match_all" else max(hits)

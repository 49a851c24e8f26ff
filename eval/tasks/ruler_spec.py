"""RULER's fixed parts (NVIDIA/RULER at ``c3f5e3b4``): task templates, answer prefixes and generation
budgets (``scripts/data/synthetic/constants.py``), the model template joined as ``scripts/data/prepare.py``
joins it, the prediction clean-up and metrics (``scripts/eval/evaluate.py``,
``scripts/eval/synthetic/constants.py``), and the size search every generator runs.

Scores are RULER's: per example the share of reference strings found case-insensitively in the
cleaned prediction (``string_match_all``) or 1 if any is found (``string_match_part``), averaged
over examples, × 100, rounded to 2 decimals.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .prompts import PromptError

__all__ = ["FAMILIES", "HOPELESS_AFTER", "MAX_RETRIES", "Family", "RulerSample", "binary_search", "join_template",
           "postprocess_pred",
           "shrink_until_fits", "string_match_all", "string_match_part"]


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

MAX_RETRIES = 20000  # fresh draws at the smallest size before a length is refused (RULER retries forever; its
# niah_multiquery at 1024 tokens on the bundled tokenizer, seed 42, needs thousands)
HOPELESS_AFTER, HOPELESS_MARGIN = 100, 0.05  # …or this many, when even the shortest is > 5% over


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
        out = {"index": self.index, "input": self.input, "outputs": list(self.outputs), "length": self.length,
               "answer_prefix": self.answer_prefix}
        if self.token_position_answer is not None:
            out["token_position_answer"] = self.token_position_answer
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RulerSample:
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


def shrink_until_fits(attempt: Callable[[int], Any], size: int, incremental: int, *, what: str) -> Any:
    """RULER's per-sample loop: ``attempt(size)``; on failure (too long, or a draw impossible at
    this size) retry ``incremental`` smaller, and at the smallest size retry with fresh draws —
    where RULER loops until a draw fits, forever if none can. ``PromptError`` after
    ``MAX_RETRIES`` draws at the smallest size, or after ``HOPELESS_AFTER`` when even the shortest
    draw so far is over the limit by more than ``HOPELESS_MARGIN`` (draws differ only in their keys
    and values, a few tokens)."""
    tries, best = 0, None
    while True:
        try:
            return attempt(size)
        except (TooLong, ValueError, IndexError) as e:
            if isinstance(e, PromptError):
                raise
            if size > incremental:
                size -= incremental
                continue
            tries += 1
            if isinstance(e, TooLong):
                best = e if best is None or e.total < best.total else best
            hopeless = (best is not None and tries >= HOPELESS_AFTER
                        and best.total > best.limit * (1 + HOPELESS_MARGIN))
            if tries >= MAX_RETRIES or hopeless:
                raise PromptError(f"{what}: no example fits ({tries} draws at the smallest haystack, size {size}, "
                                  f"were all too long)" + (f": the shortest {best}" if best else "")) from None


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

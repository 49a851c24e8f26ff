"""``json_kv``: HELMET's JSON key-value retrieval (Yen et al. 2025, HELMET, arXiv:2410.02694; princeton-nlp/HELMET
``4526dfb``, MIT): a JSON object of UUID keys and values fills the context, and after two demo pairs the model is
asked the value of one key.

Prompt and generator: ``json_kv_gen`` (HELMET's template, lost-in-the-middle's JSON rendering, seeded UUID-4 pairs,
as many as fill L with the model's tokenizer). Defaults are HELMET's ``configs/recall.yaml``: 2 shots, 100 samples,
seed 42, 100 generated tokens, no chat template.

Metric: HELMET's ``substring_exact_match`` (``utils.py``; SQuAD's normalisation: lower case, punctuation — hyphens
too — and the articles a/an/the removed, whitespace squeezed; the gold a substring of the prediction), taken as
``load_json_kv``'s ``post_process`` takes it: the better of the raw output and the text after "corresponding value:"
(``utils.py::parse_output``: that line's rest, else the output's first line). Reported × 100 (``subem``).
"""

from __future__ import annotations

import re
import string
from typing import Any

from pydantic import Field

from ..base import Metric
from .base import GeneratedOptions, GeneratedTask
from .json_kv_gen import INSTRUCTION, generate_json_kv

__all__ = ["JsonKv", "JsonKvOptions", "json_kv_score", "normalize_answer", "parse_value", "substring_exact_match"]

_PUNCT = frozenset(string.punctuation)
_PAIR = re.compile(r'"[0-9a-f-]{36}": "[0-9a-f-]{36}"')  # a complete pair of the context


class JsonKvOptions(GeneratedOptions):
    """JSON KV's options, at HELMET's defaults (``configs/recall.yaml``)."""

    num_samples: int = Field(100, ge=1, description="samples per length (HELMET's recall: 100)")
    shots: int = Field(2, ge=0, le=64, description="demo key-value pairs before the question (HELMET: 2)")
    tokens_to_generate: int = Field(100, ge=1, description="greedy generation budget [tokens], counted in L (HELMET: "
                                                           "100)")
    pairs: int | None = Field(None, ge=1, description=(
        "context pairs per sample, fixed (HELMET's files: 50, 105, 220, 440, 900, 1800 at 4k … 128k), the context cut "
        "from its end where prompt and budget pass L, as HELMET cuts it; None: as many pairs as fill L"))


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation as HELMET's ``utils.py::normalize_answer`` applies it: lower case, every
    ``string.punctuation`` character removed, the words a/an/the made spaces, whitespace runs made one space."""
    text = "".join(c for c in text.lower() if c not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def substring_exact_match(prediction: str, gold: str) -> bool:
    """Whether the normalised ``gold`` is a substring of the normalised ``prediction`` (HELMET's
    ``substring_exact_match_score``)."""
    return normalize_answer(gold) in normalize_answer(prediction)


def parse_value(output: str, prefix: str = "corresponding value:") -> str:
    """The answer as HELMET's ``parse_output(output, prefix)`` reads it: the rest of the line after the first
    ``prefix`` (any case), else the output's first line; stripped, a repeated ``prefix`` at its start dropped,
    stripped again."""
    m = re.search(re.escape(prefix) + "(.*)", output, flags=re.IGNORECASE)
    line = (m.group(1) if m else output.split("\n", 1)[0]).strip()
    return re.sub("^" + re.escape(prefix), "", line, flags=re.IGNORECASE).strip()


def json_kv_score(output: str, golds: list[str]) -> bool:
    """One sample's score: a gold value matched (``substring_exact_match``) in the raw output or in its parsed value
    (``load_json_kv``'s ``post_process``: the better of the two)."""
    parsed = parse_value(output)
    return any(substring_exact_match(text, g) for text in (output, parsed) for g in golds)


class JsonKv(GeneratedTask):
    """HELMET's JSON KV: the value of one UUID key in a JSON object of UUID pairs filling L, after 2 demo pairs.

    Samples from ``json_kv_gen``; metric ``subem`` (HELMET's substring exact match, × 100); 100 tokens generated.
    """

    name = "json_kv"
    Options = JsonKvOptions
    generator = "json_kv/1"
    metrics = (Metric(key="subem", label="substring exact match (%)", higher_is_better=True, fmt="{:.1f}"),)

    def generate(self, length, num_samples):
        o = self.options
        return generate_json_kv(total=self.total, tokenizer=self.tokenizer, length=length, num_samples=num_samples,
                                seed=o.seed, shots=o.shots, pairs=o.pairs)

    def score(self, sample, prediction) -> dict[str, float]:
        return {"subem": float(json_kv_score(prediction, list(sample.outputs)))}

    def gold_text(self, sample) -> str:
        """The gold value after ``Corresponding value:``, as the demos write theirs (one space before it)."""
        return f" {sample.outputs[0]}"

    def details(self, examples, predictions, scores) -> dict[str, Any]:
        """The pairs each context holds (complete ones, after a cut), where the gold pair sits among them (0 = first,
        1 = last; None where a cut took it) and how many contexts still hold the gold value (all, unless ``pairs`` cut
        them)."""
        contexts = [ex.sample.input.split(f"\n\n{INSTRUCTION}", 1)[0] for ex in examples]
        pairs = [len(_PAIR.findall(c)) for c in contexts]
        depths = [round(ex.sample.index / max(n - 1, 1), 4) if ex.sample.index < n else None
                  for ex, n in zip(examples, pairs)]
        return {"pairs": pairs, "gold_depths": depths,
                "gold_in_context": sum(ex.sample.outputs[0] in c for ex, c in zip(examples, contexts))}

"""``graphwalks``: OpenAI's GraphWalks (dataset card ``openai/graphwalks``, MIT): a directed graph as an edge list
fills the context; the model is asked the nodes at exactly depth d of a BFS from a node (``bfs``) or a node's parents
(``parents``), and answers ``Final Answer: [...]`` on its last line.

Prompt and generator: ``graphwalks_gen`` (the card's prompt at its 2026-02-27 revision, md5 node ids, a random graph
of fixed out-degree sized to fill L with the model's tokenizer; exact BFS and parents answers).

Metric: F1 between the predicted and the gold node sets, as lm-evaluation-harness scores GraphWalks
(``lm_eval/tasks/graphwalks/utils.py``, lm-eval 0.4.13): ``f1`` parses the last line of the output (trailing
newlines dropped) — no ``Final Answer: [...]`` there, no nodes —, ``flexible_f1`` the last line that holds one; the
list split at commas, each item stripped of spaces and quotes. Precision = overlap / predicted (0 for none
predicted), recall = overlap / gold (**0 for an empty gold set**), F1 = 2PR/(P + R), 0 when P + R = 0: a sample whose
answer is the empty set scores 0 whatever the model says. The card's own snippet and NVIDIA's NeMo-Skills/NeMo-Gym
score that case otherwise (the card: no overlap as 1; NeMo: both sets empty as 1); ``empty_gold`` in each record
counts such samples, and ``empty_answers: false`` draws none. Reported × 100.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from ..base import Metric
from .base import GeneratedOptions, GeneratedTask
from .graphwalks_gen import generate_graphwalks

__all__ = ["Graphwalks", "GraphwalksOptions", "final_answer", "set_f1"]

_FINAL = re.compile(r"Final Answer:\s*\[(.*)\]")


class GraphwalksOptions(GeneratedOptions):
    """GraphWalks' options: the operations, the graph's out-degree, the BFS depths, the generation budget."""

    problems: list[Literal["bfs", "parents"]] = Field(["bfs", "parents"], min_length=1,
                                                      description="operations, sample i asking problems[i % len]")
    out_degree: int = Field(3, ge=1, le=64, description="edges leaving every node (the card's rows: 1 to 5)")
    depths: list[int] = Field([1, 2], min_length=1,
                              description="BFS depths, one drawn per bfs sample (the card publishes none)")
    empty_answers: bool = Field(True, description=(
        "allow operations whose answer is the empty set (the card has them; lm-eval's F1 scores them 0)"))
    tokens_to_generate: int = Field(256, ge=1, description="greedy generation budget [tokens], counted in L")

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[int]) -> list[int]:
        if any(d < 1 for d in v):
            raise ValueError(f"BFS depths are at least 1, got {v}")
        return v


def final_answer(response: str, flexible: bool = False) -> list[str] | None:
    """The node list of a response's ``Final Answer: [...]``: on its last line (trailing newlines dropped), or with
    ``flexible`` the last line holding one; items split at commas, stripped of spaces then quotes, blank ones
    dropped. None where there is none (lm-eval's parse error)."""
    lines = response.rstrip("\n").split("\n")
    for line in reversed(lines) if flexible else lines[-1:]:
        m = _FINAL.search(line)
        if m:
            return [item.strip().strip("'\"") for item in m.group(1).split(",") if item.strip()]
    return None


def set_f1(predicted: list[str] | None, gold: list[str]) -> float:
    """F1 of two node sets as lm-eval scores GraphWalks: precision = overlap / |predicted| (0 when none),
    recall = overlap / |gold| (0 when the gold set is empty), 2PR/(P + R), 0 when P + R = 0."""
    pred, truth = set(predicted or ()), set(gold)
    overlap = len(pred & truth)
    p = overlap / len(pred) if pred else 0.0
    r = overlap / len(truth) if truth else 0.0
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


class Graphwalks(GeneratedTask):
    """OpenAI's GraphWalks: the nodes at exactly depth d of a BFS, or a node's parents, in a random graph filling L.

    Samples from ``graphwalks_gen``; metric ``f1`` (lm-eval's set F1 of the last line's ``Final Answer``, × 100).
    """

    name = "graphwalks"
    Options = GraphwalksOptions
    generator = "graphwalks/2026-02-27/2"  # /2: empty_answers false refuses an answer empty in every draw
    metrics = (Metric(key="f1", label="set F1 (%)", higher_is_better=True, fmt="{:.1f}"),
               Metric(key="flexible_f1", label="set F1, any line (%)", higher_is_better=True, fmt="{:.1f}"))

    def generate(self, length, num_samples):
        o = self.options
        return generate_graphwalks(total=self.total, length=length, num_samples=num_samples, seed=o.seed,
                                   out_degree=o.out_degree, problems=list(o.problems), depths=list(o.depths),
                                   empty_answers=o.empty_answers)

    def score(self, sample, prediction) -> dict[str, float]:
        gold = list(sample.outputs)
        return {"f1": set_f1(final_answer(prediction), gold),
                "flexible_f1": set_f1(final_answer(prediction, flexible=True), gold)}

    def gold_text(self, sample) -> str:
        """The card's answer line for the gold nodes: ``Final Answer: [a, b]`` (``Final Answer: []`` for none)."""
        return f"Final Answer: [{', '.join(sample.outputs)}]"

    def details(self, examples, predictions, scores) -> dict[str, Any]:
        """F1 per operation, the samples whose gold set is empty, whose output has no final answer on its last line,
        and whose gold answer line (``Final Answer: [...]``) alone is longer than the generation budget."""
        out: dict[str, Any] = {}
        for problem in ("bfs", "parents"):
            idx = [i for i, ex in enumerate(examples) if (ex.sample.index > 0) == (problem == "bfs")]
            out[f"f1_{problem}"] = round(100 * sum(scores[i]["f1"] for i in idx) / len(idx), 2) if idx else None
        lines = [self.gold_text(ex.sample) for ex in examples]
        over = sum(len(self.tokenizer(s, add_special_tokens=False)["input_ids"]) > self.budget for s in lines)
        return {**out, "empty_gold": sum(not ex.sample.outputs for ex in examples),
                "parse_failures": sum(final_answer(p) is None for p in predictions),
                "gold_over_budget": over, "gold_sizes": [len(ex.sample.outputs) for ex in examples],
                "depths": [ex.sample.index for ex in examples]}

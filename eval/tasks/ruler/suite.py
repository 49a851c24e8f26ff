"""The RULER suite (Hsieh et al. 2024, arXiv:2404.06654): a chosen set of RULER tasks over
strategies × lengths, each cell scored per task and by RULER's average.

``task: ruler`` with ``ruler: {tasks: [...], num_samples: ..., ...}`` (the options every RULER task
shares, ``base.RulerOptions``; task settings at RULER's defaults). Every task's samples come
from its own generator and the sample cache, so a sweep of many strategies generates them once,
and a second run not at all. A task whose prompts cannot fit a length (RULER's templates and
haystack steps are long: at 1024 tokens and below many cannot) is refused at that length, in one
line naming why, and left out of that length's average; a length no task fits has no average
(``score`` None, every task under ``refused``).

Record: ``score`` = the mean of the task scores at that length (RULER's average; ``tasks_scored``
says over how many), ``scores`` = ``{task: score}``, ``refused`` = ``{task: reason}``, and per
task the prompt token counts. Reports: the average as strategies × lengths, one table per length
with every task's score beside the average, ``score_vs_length.png`` (one line per strategy) and
``task_heatmap.png`` (task × length, one panel per strategy).

**Effective length** (RULER's §4: the longest length at which a model still scores at least a
threshold; the paper's threshold is Llama-2-7B's average at its 4K window, 85.6): per strategy,
the largest measured length L whose average, and every measured shorter length's, is at or above
the threshold — a dip below it ends the reach even where a longer length recovers. None when the
shortest measured length already falls below. The threshold is ``threshold`` when given (a
number, %), else RULER's convention for an extended model: the unscaled model's own average at its
window — the ``vanilla`` cell at T (none without that cell). In ``results.md`` (a table under the
averages), ``effective_length.json`` (``{strategy: length or null}`` with the threshold and where it
came from) and ``score_vs_length.png`` (the threshold drawn as a dotted level). A given threshold
is recorded with the run (its identity); left out, runs from before the option resume. A vanilla
cell scoring 0 at T makes a threshold every score passes: the effective lengths are then null, with
the reason in the JSON and ``results.md`` and a warning line.
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from ropescale.runs.config import NestedErrors, error_parts
from ropescale.runs.memory import Need
from ropescale.strategies import BASELINE

from ..base import Task, get_task
from ..prompts import PromptError
from .base import RulerOptions, RulerTask

__all__ = ["DEFAULT_TASKS", "RulerSuite", "RulerSuiteOptions", "effective_length", "effective_lengths"]

DEFAULT_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]


class RulerSuiteOptions(RulerOptions):
    """The RULER suite's options: which tasks, and the threshold of the effective length."""

    tasks: list[str] = Field(default_factory=lambda: list(DEFAULT_TASKS), min_length=1,
                             description="RULER tasks to run (default: the 11 synthetic ones)")
    # 0 would pass every score: every strategy's effective length the longest length, which says nothing
    threshold: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description=(
        "effective length's threshold (RULER average, %); default the vanilla cell's average at T"))

    def key(self) -> dict[str, Any]:
        # left at its default (the vanilla cell at T): out of the key, so runs from before the option resume
        return {k: v for k, v in super().key().items() if k != "threshold" or v is not None}

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        out = []
        for name in v:
            try:
                task = get_task(name)
            except KeyError as e:
                raise ValueError(str(e)) from None
            if not (isinstance(task, type) and issubclass(task, RulerTask)):
                raise ValueError(f"{name} is not a RULER task")
            try:
                task.Options()  # a task's own checks (qa offline without its data)
            except ValidationError as e:  # its keys read as paths under the task's name
                raise NestedErrors(error_parts(e, task.Options)).under(name) from None
            if task.name not in out:
                out.append(task.name)
        return out


class RulerSuite(Task):
    """RULER: several RULER tasks per cell, scored each and averaged."""

    name = "ruler"
    Options = RulerSuiteOptions
    metrics = RulerTask.metrics
    uses_data = True

    @cached_property
    def tasks(self) -> dict[str, RulerTask]:
        shared = self.options.model_dump(exclude={"tasks", "threshold"})
        out = {}
        for name in self.options.tasks:
            cls = get_task(name)
            out[name] = cls(cls.Options(**shared), tokenizer=self.tokenizer, train_length=self.train_length,
                            documents=self.documents, source=self.source)
        return out

    @cached_property
    def refused(self) -> dict[int, dict[str, str]]:
        return {}

    def examples(self, length: int) -> list[tuple[str, Any]]:
        out, refused = [], {}
        for name, task in self.tasks.items():
            try:
                out += [(name, ex) for ex in task.examples(length)]
            except PromptError as e:
                refused[name] = str(e)
                logging.getLogger("ropescale").warning("ruler @ %d: %s refused: %s", length, name, e)
        self.refused[length] = refused
        return out

    def memory(self, length: int, model) -> Need | None:
        needs = [t.memory(length, model) for t in self.tasks.values()]
        worst = max(needs, key=lambda n: sum(n.device.values()))
        return Need(what=f"ruler at {length} tokens ({len(needs)} tasks, batch {self.options.batch_size})",
                    device=worst.device, host={"prompts": sum(sum(n.host.values()) for n in needs)})

    def measure(self, model, examples, indices, *, length, strategy, device, desc) -> list:
        out = []
        for name, task in self.tasks.items():
            mine = [i for i in indices if examples[i][0] == name]
            if mine:
                sub = {i: examples[i][1] for i in mine}
                part = task.measure(model, sub, mine, length=length, strategy=strategy, device=device,
                                    desc=f"{desc} {name}" if desc else None)
                out += part
        return out

    def combine(self, parts, examples, *, length, strategy) -> dict[str, Any]:
        preds = dict(x for part in parts for x in part)
        if sorted(preds) != list(range(len(examples))):
            raise RuntimeError("ruler: the processes' parts do not cover every example exactly once")
        scores, per_task = {}, {}
        for name, task in self.tasks.items():
            idx = [i for i, (n, _) in enumerate(examples) if n == name]
            if not idx:
                continue
            rec = task.combine([[(j, preds[i]) for j, i in enumerate(idx)]], [examples[i][1] for i in idx],
                               length=length, strategy=strategy)
            scores[name] = rec["score"]
            per_task[name] = {k: rec[k] for k in ("samples", "nulls", "tokens_to_generate", "prompt_tokens_max",
                                                  "generation", "predictions")}
        avg = round(sum(scores.values()) / len(scores), 2) if scores else None  # no task fits this length
        first = next(iter(self.tasks.values()))
        return {"score": avg, "tasks_scored": len(scores), "tasks": list(self.tasks), "scores": scores,
                "refused": self.refused.get(length, {}), "per_task": per_task,
                "template": self.options.template,
                "template_text": first.template if self.options.template == "chat" else None}

    @classmethod
    def report(cls, records: list[dict]) -> str:
        """The effective length per strategy, then per length: every task's score beside the
        average, strategies as rows (— where refused)."""
        from ...plots import len_label, strategies_of

        tasks = records[0]["tasks"]
        train = records[0].get("train_length")
        parts = _effective_report(records)
        for length in sorted({r["length"] for r in records}):
            rows = {r["strategy"]: r for r in records if r["length"] == length}
            parts += [f"**{len_label(length, train)}** (RULER score, %; average over the tasks that fit)", "",
                      "| strategy | average | " + " | ".join(tasks) + " |", "|---|" + "---:|" * (len(tasks) + 1)]
            for s in strategies_of(records):
                if s in rows:
                    r = rows[s]
                    cells = [f"{r['scores'][t]:.1f}" if t in r["scores"] else "—" for t in tasks]
                    avg = "—" if r["score"] is None else f"{r['score']:.1f}"
                    parts.append(f"| {s} | {avg} | " + " | ".join(cells) + " |")
            refused = next(iter(rows.values()))["refused"]
            if refused:
                parts.append("")
                parts.append("Refused at this length: " + "; ".join(f"{t} ({why.split(': ', 1)[-1]})"
                                                                      for t, why in refused.items()))
            parts.append("")
        return "\n".join(parts)

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        import json

        from ...plots import plot_metric, plot_task_heatmaps

        paths = {"plot": output / "score_vs_length.png", "heatmap": output / "task_heatmap.png",
                 "effective_length": output / "effective_length.json"}
        summary = effective_lengths(records)
        if "reason" in summary:
            logging.getLogger("ropescale").warning("ruler: effective length not computed: %s", summary["reason"])
        level = (summary["threshold"], "threshold") if summary["threshold"] is not None and "reason" not in summary \
            else None
        plot_metric(records, "score", "RULER average score (%)", paths["plot"], level=level)
        plot_task_heatmaps(records, paths["heatmap"])
        paths["effective_length"].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        return paths


def effective_length(scores: dict[int, float | None], threshold: float) -> int | None:
    """The largest length of ``scores`` (``{length [tokens]: average %}``) whose score, and every
    shorter length's, is ≥ ``threshold``; None when the shortest is below (or has no score)."""
    reach = None
    for length in sorted(scores):
        score = scores[length]
        if score is None or score < threshold:
            break
        reach = length
    return reach


def effective_lengths(records: list[dict]) -> dict[str, Any]:
    """``{"threshold": %, "threshold_from": words, "effective_length": {strategy: length | None}}``
    over the suite's records (threshold: the records' option, else the vanilla cell at T; without
    either, threshold None and no lengths). A threshold of 0 (the vanilla cell scoring 0 at T)
    passes every score — every strategy would reach the longest length, whatever it scores — so
    every length is None and ``reason`` says why."""
    from ...plots import strategies_of

    options = records[0].get("options") or {}
    threshold, source = options.get("threshold"), "given (threshold)"
    if threshold is None:
        train = records[0].get("train_length")
        base = [r for r in records if r["strategy"] == BASELINE and r["length"] == train and r["score"] is not None]
        if not base:
            return {"threshold": None, "threshold_from": f"no threshold given and no vanilla cell at T = {train}",
                    "effective_length": {}}
        threshold, source = base[0]["score"], f"the vanilla cell's average at T = {train}"
    if threshold <= 0:
        return {"threshold": threshold, "threshold_from": source,
                "effective_length": dict.fromkeys(strategies_of(records)),
                "reason": f"the threshold ({source}) is {threshold:g}, which every score passes: each strategy would "
                          "reach the longest measured length whatever it scores; set ruler.threshold (the paper's: "
                          "85.6)"}
    reach = {s: effective_length({r["length"]: r["score"] for r in records if r["strategy"] == s}, threshold)
             for s in strategies_of(records)}
    return {"threshold": threshold, "threshold_from": source, "effective_length": reach}


def _effective_report(records: list[dict]) -> list[str]:
    summary = effective_lengths(records)
    if "reason" in summary:
        return [f"**Effective length**: not computed ({summary['reason']})", ""]
    if summary["threshold"] is None:
        return [f"**Effective length**: not computed ({summary['threshold_from']}; set ruler.threshold)", ""]
    lengths = sorted({r["length"] for r in records})
    out = [f"**Effective length** (the longest length whose RULER average, and every shorter measured length's, "
           f"is ≥ {summary['threshold']:.1f}: {summary['threshold_from']}; measured lengths {lengths})", "",
           "| strategy | effective length |", "|---|---:|"]
    for s, reach in summary["effective_length"].items():
        out.append(f"| {s} | {reach if reach is not None else f'< {lengths[0]}'} |")
    return out + [""]

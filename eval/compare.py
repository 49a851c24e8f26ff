"""Compare fine-tuning runs: held-out PPL at one length vs steps in one figure, and Markdown
tables (PPL by step; each run's last evaluation with the first step reaching the first run's final
PPL; with harness folders of the base model, before/after tables of perplexity and passkey).

``ropescale compare RUN_DIR ... --length L -o FIG [--at STEPS] [--before HARNESS_DIR ...] [--title T]``
(``cli.py``) calls ``read_runs`` and then ``compare``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ropescale.errors import InvalidInput
from ropescale.runs.plotting import pyplot, save_figure
from ropescale.training.report import LOG, eval_curve, read_log, steps_to_reach

from .results import read_results
from .writable import check_figure

__all__ = ["RunsArgumentError", "before_after", "by_step_table", "compare", "final_table", "plot_runs", "read_runs",
           "run_labels"]


class RunsArgumentError(InvalidInput):
    """What the arguments name is not there (a folder without its log or results, a length not
    evaluated, a folder given twice): ``ropescale compare`` refuses it in one line, exit 1."""


def plot_runs(runs: dict[str, list[dict]], length: int, path: Path, *, title: str = "",
              hlines: dict[str, float] | None = None) -> Path:
    """Held-out PPL at ``length`` vs optimiser steps, one line per run (``label → log records``);
    ``hlines``: reference levels drawn dashed (e.g. the base model without fine-tuning)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, records) in enumerate(runs.items()):
        curve = eval_curve(records, length)
        ax.plot([s for s, _ in curve], [p for _, p in curve], marker="o", ms=3, color=f"C{i}", label=label)
    for j, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, ls="--", lw=1, color=f"C{len(runs) + j}", label=label)
    ax.set(xlabel="fine-tuning step", ylabel=f"held-out perplexity at L = {length}")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.set_yscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())  # plain numbers on the log axis
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def by_step_table(runs: dict[str, list[dict]], length: int, steps: list[int]) -> str:
    """Markdown table: held-out PPL at ``length`` of each run at ``steps``."""
    out = ["| run | " + " | ".join(f"step {k}" for k in steps) + " |", "|---|" + "---:|" * len(steps)]
    for label, records in runs.items():
        curve = dict(eval_curve(records, length))
        out.append(f"| {label} | " + " | ".join(f"{curve[k]:.2f}" if k in curve else "—" for k in steps) + " |")
    return f"held-out PPL at L = {length} by fine-tuning step\n\n" + "\n".join(out)


def final_table(runs: dict[str, list[dict]], length: int, target: float, target_label: str) -> str:
    """Markdown table: each run's held-out PPL at every length at its last evaluation, its steps
    and training tokens, and the first evaluated step at which its PPL at ``length`` is ≤
    ``target`` and ≤ 1.05 × ``target``."""
    lengths = sorted({int(k) for recs in runs.values() for r in recs if "ppl" in r for k in r["ppl"]})
    out = ["| run | steps | training tokens | " + " | ".join(f"PPL @ {n}" for n in lengths)
           + f" | first step with PPL @ {length} ≤ {target:.2f} ({target_label}'s final)"
             f" | ≤ {1.05 * target:.2f} (+5%) |",
           "|---|---:|---:|" + "---:|" * len(lengths) + "---:|---:|"]
    for label, records in runs.items():
        last = [r for r in records if "ppl" in r][-1]
        steps = [r for r in records if "loss" in r]
        reach = [steps_to_reach(records, length, t) for t in (target, 1.05 * target)]
        out.append(f"| {label} | {steps[-1]['step'] if steps else 0} | {steps[-1]['tokens'] if steps else 0} | "
                   + " | ".join(f"{last['ppl'].get(str(n), float('nan')):.2f}" for n in lengths) + " | "
                   + " | ".join(str(r) if r is not None else "not reached" for r in reach) + " |")
    return "\n".join(out)


def _summary(run: Path) -> dict | None:
    """``RUN/model/finetune.json`` (None: not trained to the end); ``InvalidInput`` when unreadable."""
    path = run / "model" / "finetune.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"{path}: not JSON ({e}); a fine-tuning run's summary") from None
    if not isinstance(summary, dict):
        raise InvalidInput(f"{path}: a JSON {type(summary).__name__}, not a fine-tuning run's summary (an object)")
    return summary


def run_labels(runs: list[Path]) -> dict[Path, str]:
    """Each run folder's label: its ``finetune.json`` label, else the folder's name; runs that
    share one are told apart by the folder as given (``yarn + LoRA (runs/a)``) — their logs
    were merged into one line and one row. Raises ``InvalidInput`` for a folder given twice."""
    seen: dict[Path, Path] = {}
    for run in runs:
        key = run.resolve()
        if key in seen:
            raise RunsArgumentError(f"{run}: given twice (as {seen[key]} too); name each run once")
        seen[key] = run
    base = {run: ((_summary(run) or {}).get("label") or run.name) for run in runs}
    counts = {label: list(base.values()).count(label) for label in base.values()}
    return {run: f"{label} ({run})" if counts[label] > 1 else label for run, label in base.items()}


def _key(record: dict) -> tuple:
    return record["name"], json.dumps(record["params"], sort_keys=True), bool(record.get("logn"))


def _harness_records(folder: Path, task: str) -> list[dict]:
    return [r for r in read_results(folder / "results.jsonl") if r["task"] == task]


def before_after(runs: list[Path], before: list[Path], task: str, metric: str,
                 labels: dict[Path, str] | None = None) -> str:
    """Markdown table: ``metric`` of the harness ``task`` per length, for each run's strategy on
    the base model (found in the ``before`` harness folders by strategy and parameters) and for
    the fine-tuned model (``RUN/eval/<task>``). ``labels``: each run's row label (``run_labels``;
    default: the label in its ``finetune.json``)."""
    base, base_models = {}, set()
    for folder in before:
        for r in _harness_records(folder, task):
            base.setdefault(_key(r), {})[r["length"]] = r
            base_models.add(r["model"])
    rows, lengths, caption = [], set(), None
    for run in runs:
        after = _harness_records(run / "eval" / task, task)
        if not after:
            continue
        summary = _summary(run) or {}
        label = (labels or {}).get(run) or summary.get("label") or run.name
        caption = caption or after[0]
        found = base.get(_key(after[0]), {})
        rows.append((f"{(summary.get('label') or run.name).split(' + ')[0]}, no fine-tuning", found))
        rows.append((f"{label}, fine-tuned {summary.get('steps', '?')} steps", {r["length"]: r for r in after}))
        lengths |= {r["length"] for r in after}
    lengths = sorted(lengths)
    fmt = (lambda r: f"{r[metric]:.2f}") if task == "perplexity" else (
        lambda r: f"{r[metric]:.2f} ({r[metric + '_ci'][0]:.2f}–{r[metric + '_ci'][1]:.2f})")
    out = ["| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    seen = set()
    for label, by_length in rows:
        if label in seen:
            continue
        seen.add(label)
        out.append(f"| {label} | " + " | ".join(fmt(by_length[n]) if n in by_length else "—" for n in lengths) + " |")
    if caption:
        out.insert(0, f"{task} `{metric}`; data: {caption.get('data') or '—'}; options: "
                      f"{json.dumps(caption.get('options'))}; base model: {', '.join(sorted(base_models)) or '—'}; "
                      "fine-tuned: RUN/model\n")
    return "\n".join(out)


DEFAULT_AT = (0, 50, 100, 200, 400, 1000)


def read_runs(runs: list[Path], length: int, before: list[Path] = ()) -> dict[str, list[dict]]:
    """The training logs of the run folders (``label → log records``), after checking what
    ``compare`` needs: every run folder has a ``log.jsonl``, every ``before`` folder a
    ``results.jsonl``, and every run a held-out PPL at ``length``. Runs that share a label are
    told apart by their folder (``run_labels``). Raises ``RunsArgumentError`` (naming the folder
    or the length) or ``InvalidInput`` (the ``file:line`` of a log line that is not a record, a
    summary that is not JSON) in one line."""
    records = {}
    runs = list(map(Path, runs))
    for run, label in run_labels(runs).items():
        log = read_log(run)
        if not log:
            raise RunsArgumentError(f"{run}: no {LOG} (a fine-tuning output folder)")
        records[label] = log
    for folder in map(Path, before):
        if not (folder / "results.jsonl").is_file():
            raise RunsArgumentError(f"--before {folder}: no results.jsonl (a harness results folder)")
    for label, log in records.items():
        if not eval_curve(log, length):
            evaluated = sorted({int(k) for r in log if "ppl" in r for k in r["ppl"]})
            raise RunsArgumentError(f"--length {length}: {label} has no held-out PPL at it; evaluated: "
                                    f"{evaluated}")
    return records


def compare(records: dict[str, list[dict]], runs: list[Path], length: int, output: Path, *, title: str = "",
            at: list[int] = DEFAULT_AT, before: list[Path] = ()) -> str:
    """What ``ropescale compare`` shows for the runs ``read_runs`` read: draws PPL at ``length``
    vs steps of each run into ``output`` and returns the Markdown tables — PPL by step at ``at``,
    each run's last evaluation with the first step at which it reaches the first run's final PPL;
    with ``before``, the harness's perplexity and passkey results of each run's strategy on the
    base model next to the fine-tuned model's. Raises ``InvalidInput`` (one line) for an
    ``output`` matplotlib cannot save (its extension) or write (its folder), before drawing."""
    check_figure(output, f"-o {output}")
    plot_runs(records, length, output, title=title)
    first_label, first = next(iter(records.items()))
    target = eval_curve(first, length)[-1][1]
    parts = [by_step_table(records, length, list(at)), final_table(records, length, target, first_label)]
    if before:
        for task, metric in (("perplexity", "ppl"), ("passkey", "accuracy"), ("passkey", "candidate_accuracy")):
            table = before_after([Path(r) for r in runs], [Path(b) for b in before], task, metric,
                                 labels=run_labels([Path(r) for r in runs]))
            if table.count("\n") > 2:
                parts.append(table)
    return "\n\n".join(parts)

"""The training log and its figures.

``log.jsonl`` (one JSON object per line, written by the main process only):
    ``{"step": k, "loss": …, "lr": …, "tokens": …, "tokens_per_s": …, "grad_norm": …}`` after each
    optimiser step k ≥ 1 (loss: mean next-token NLL [nats] over the step's global batch; tokens:
    training tokens seen so far, all processes; tokens_per_s: over the run's training time so far,
    evaluations excluded), and ``{"step": k, "ppl": {"L": PPL, …}}`` for each held-out evaluation
    (step 0 = before training).

``loss.png``: training loss and held-out PPL per length vs steps. ``plot_runs`` draws PPL at one
length vs steps for several runs (the README's comparison), and ``python -m
ropescale.training.report RUN_DIR ... --length L -o FIG`` draws it and prints the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["LOG", "TrainingLog", "read_log", "eval_curve", "steps_to_reach", "plot_training", "plot_runs", "main"]

LOG = "log.jsonl"


def read_log(path: str | Path) -> list[dict]:
    """Records of a ``log.jsonl`` (a torn last line from a killed run is skipped)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class TrainingLog:
    """Appends records to ``log.jsonl`` (one line at a time, closed after each) when ``enabled``
    (the main process)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def keep_through(self, step: int) -> None:
        """Drop records of steps after ``step`` (−1: all): what a run resumed from the checkpoint
        of ``step`` writes again (a checkpoint is saved after that step's log and evaluation)."""
        if self.enabled:
            keep = [r for r in read_log(self.path) if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def eval_curve(records: list[dict], length: int) -> list[tuple[int, float]]:
    """``(step, PPL at length)`` of every held-out evaluation in the log."""
    return [(r["step"], r["ppl"][str(length)]) for r in records if "ppl" in r and str(length) in r["ppl"]]


def steps_to_reach(records: list[dict], length: int, target: float) -> int | None:
    """First evaluated step whose held-out PPL at ``length`` is ≤ ``target`` (None: never)."""
    return next((step for step, ppl in eval_curve(records, length) if ppl <= target), None)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(records: list[dict], path: Path, title: str) -> Path:
    """Loss per step (and its 20-step running mean) and held-out PPL per length vs step."""
    plt = _plt()
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "ppl" in r]
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(11 if evals else 6, 4), squeeze=False)
    ax = axes[0][0]
    if steps:
        x, y = [r["step"] for r in steps], [r["loss"] for r in steps]
        ax.plot(x, y, lw=0.6, alpha=0.4, color="C0", label="loss per step")
        k = 20
        smooth = [sum(y[max(0, i - k + 1): i + 1]) / len(y[max(0, i - k + 1): i + 1]) for i in range(len(y))]
        ax.plot(x, smooth, color="C0", label=f"running mean ({k} steps)")
        ax.legend(fontsize=8)
    ax.set(xlabel="optimiser step", ylabel="training loss [nats/token]", title="training loss")
    ax.grid(alpha=0.3)
    if evals:
        ax = axes[0][1]
        lengths = sorted({int(k) for r in evals for k in r["ppl"]})
        for i, length in enumerate(lengths):
            curve = eval_curve(records, length)
            ax.plot([s for s, _ in curve], [p for _, p in curve], marker="o", ms=3, color=f"C{i}", label=f"L = {length}")
        ax.set(xlabel="optimiser step", ylabel="held-out perplexity", title="held-out perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_runs(runs: dict[str, list[dict]], length: int, path: Path, *, title: str = "",
              hlines: dict[str, float] | None = None) -> Path:
    """Held-out PPL at ``length`` vs optimiser steps, one line per run (``label → log records``);
    ``hlines``: reference levels drawn dashed (e.g. the base model without fine-tuning)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, records) in enumerate(runs.items()):
        curve = eval_curve(records, length)
        ax.plot([s for s, _ in curve], [p for _, p in curve], marker="o", ms=3, color=f"C{i}", label=label)
    for j, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, ls="--", lw=1, color=f"C{len(runs) + j}", label=label)
    ax.set(xlabel="fine-tuning step", ylabel=f"held-out perplexity at L = {length}", title=title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _label(run: Path) -> str:
    summary = run / "model" / "finetune.json"
    if summary.is_file():
        return json.loads(summary.read_text()).get("label") or run.name
    return run.name


def main(argv: list[str] | None = None) -> None:
    """``python -m ropescale.training.report RUN_DIR ... --length L -o FIG``: PPL at L vs steps of
    each run in one figure, and a Markdown table: PPL at every evaluated length at the last step,
    and the first step at which each run reaches the first run's final PPL at L."""
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--output", "-o", type=Path, required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    runs = {}
    for run in args.runs:
        records = read_log(run)
        if not records:
            raise SystemExit(f"{run}: no {LOG}")
        runs[_label(run)] = records
    plot_runs(runs, args.length, args.output, title=args.title)
    first_label, first = next(iter(runs.items()))
    target = eval_curve(first, args.length)[-1][1]
    lengths = sorted({int(k) for recs in runs.values() for r in recs if "ppl" in r for k in r["ppl"]})
    print(f"| run | steps | tokens | " + " | ".join(f"PPL @ {n}" for n in lengths)
          + f" | first step with PPL @ {args.length} ≤ {target:.2f} ({first_label}'s final) |")
    print("|---|---:|---:|" + "---:|" * len(lengths) + "---:|")
    for label, records in runs.items():
        last = [r for r in records if "ppl" in r][-1]
        steps = [r for r in records if "loss" in r]
        reach = steps_to_reach(records, args.length, target)
        print(f"| {label} | {steps[-1]['step'] if steps else 0} | {steps[-1]['tokens'] if steps else 0} | "
              + " | ".join(f"{last['ppl'].get(str(n), float('nan')):.2f}" for n in lengths)
              + f" | {reach if reach is not None else 'not reached'} |")
    print(f"figure: {args.output}")


if __name__ == "__main__":
    main()

"""The training log and its figures.

``log.jsonl`` (one JSON object per line, written by the main process only):
    ``{"step": k, "loss": …, "lr": …, "tokens": …, "tokens_per_s": …, "grad_norm": …}`` after each
    optimiser step k ≥ 1 (loss: mean next-token NLL [nats] over the step's global batch; tokens:
    training tokens seen so far, all processes; tokens_per_s: over the run's training time so far,
    evaluations excluded), and ``{"step": k, "ppl": {"L": PPL, …}}`` for each held-out evaluation
    (step 0 = before training).

``loss.png``: training loss and held-out PPL per length vs steps. ``plot_runs`` draws PPL at one
length vs steps for several runs (the README's comparison), and ``python -m ropescale.training
RUN_DIR ... --length L -o FIG`` draws it and prints the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["LOG", "TrainingLog", "read_log", "eval_curve", "steps_to_reach", "by_step_table", "final_table", "plot_training", "plot_runs", "main"]

LOG = "log.jsonl"


def read_log(path: str | Path) -> list[dict]:
    """Records of a ``log.jsonl`` (a torn last line from a killed run is skipped)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
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
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
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
    ax.set(xlabel="fine-tuning step", ylabel=f"held-out perplexity at L = {length}")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.set_yscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())  # plain numbers on the log axis
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def by_step_table(runs: dict[str, list[dict]], length: int, steps: list[int]) -> str:
    """Markdown table: held-out PPL at ``length`` of each run at ``steps``."""
    out = [f"| run | " + " | ".join(f"step {k}" for k in steps) + " |", "|---|" + "---:|" * len(steps)]
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
           + f" | first step with PPL @ {length} ≤ {target:.2f} ({target_label}'s final) | ≤ {1.05 * target:.2f} (+5%) |",
           "|---|---:|---:|" + "---:|" * len(lengths) + "---:|---:|"]
    for label, records in runs.items():
        last = [r for r in records if "ppl" in r][-1]
        steps = [r for r in records if "loss" in r]
        reach = [steps_to_reach(records, length, t) for t in (target, 1.05 * target)]
        out.append(f"| {label} | {steps[-1]['step'] if steps else 0} | {steps[-1]['tokens'] if steps else 0} | "
                   + " | ".join(f"{last['ppl'].get(str(n), float('nan')):.2f}" for n in lengths) + " | "
                   + " | ".join(str(r) if r is not None else "not reached" for r in reach) + " |")
    return "\n".join(out)


def _label(run: Path) -> str:
    summary = run / "model" / "finetune.json"
    if summary.is_file():
        return json.loads(summary.read_text(encoding="utf-8")).get("label") or run.name
    return run.name


def _key(record: dict) -> tuple:
    return record["name"], json.dumps(record["params"], sort_keys=True), bool(record.get("logn"))


def _harness_records(folder: Path, task: str) -> list[dict]:
    from eval.sweep import read_results

    return [r for r in read_results(folder / "results.jsonl") if r["task"] == task]


def before_after(runs: list[Path], before: list[Path], task: str, metric: str) -> str:
    """Markdown table: ``metric`` of the harness ``task`` per length, for each run's strategy on
    the base model (found in the ``before`` harness folders by strategy and parameters) and for
    the fine-tuned model (``RUN/eval/<task>``)."""
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
        summary = json.loads((run / "model" / "finetune.json").read_text(encoding="utf-8"))
        caption = caption or after[0]
        found = base.get(_key(after[0]), {})
        rows.append((f"{summary['label'].split(' + ')[0]}, no fine-tuning", found))
        rows.append((f"{summary['label']}, fine-tuned {summary['steps']} steps", {r["length"]: r for r in after}))
        lengths |= {r["length"] for r in after}
    lengths = sorted(lengths)
    fmt = (lambda r: f"{r[metric]:.2f}") if task == "perplexity" else (
        lambda r: f"{r[metric]:.2f} ({r[metric + '_ci'][0]:.2f}–{r[metric + '_ci'][1]:.2f})")
    out = [f"| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
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


def _steps(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated step numbers, e.g. 0,50,100") from None


def main(argv: list[str] | None = None) -> None:
    """``python -m ropescale.training RUN_DIR ... --length L -o FIG [--before HARNESS_DIR ...]``:
    PPL at L vs steps of each run in one figure, and Markdown tables: the held-out PPL of each
    run at its last evaluation with the first step at which it reaches the first run's final PPL
    at L; with ``--before``, the harness's perplexity and passkey results of each run's strategy on
    the base model next to the fine-tuned model's."""
    ap = argparse.ArgumentParser(prog="python -m ropescale.training", description=main.__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--output", "-o", type=Path, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--at", default="0,50,100,200,400,1000", type=_steps,
                    help="steps of the PPL-by-step table (comma-separated; those evaluated)")
    ap.add_argument("--before", type=Path, action="append", default=[],
                    help="harness results folder of the strategies on the base model (repeatable)")
    args = ap.parse_args(argv)
    runs = {}
    for run in args.runs:
        records = read_log(run)
        if not records:
            ap.error(f"{run}: no {LOG} (a fine-tuning output folder)")
        runs[_label(run)] = records
    for folder in args.before:
        if not (folder / "results.jsonl").is_file():
            ap.error(f"--before {folder}: no results.jsonl (a harness results folder)")
    for label, records in runs.items():
        if not eval_curve(records, args.length):
            evaluated = sorted({int(k) for r in records if "ppl" in r for k in r["ppl"]})
            ap.error(f"--length {args.length}: {label} has no held-out PPL at it; evaluated: {evaluated}")
    plot_runs(runs, args.length, args.output, title=args.title)
    first_label, first = next(iter(runs.items()))
    target = eval_curve(first, args.length)[-1][1]
    print(by_step_table(runs, args.length, args.at))
    print()
    print(final_table(runs, args.length, target, first_label))
    if args.before:
        for task, metric in (("perplexity", "ppl"), ("passkey", "accuracy"), ("passkey", "candidate_accuracy")):
            table = before_after(args.runs, args.before, task, metric)
            if table.count("\n") > 2:
                print("\n" + table)
    print(f"\nfigure: {args.output}")

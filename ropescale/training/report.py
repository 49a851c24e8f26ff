"""The training log and its figure.

``log.jsonl`` (one JSON object per line, written by the main process only):
    ``{"step": k, "loss": …, "lr": …, "tokens": …, "tokens_per_s": …, "grad_norm": …}`` after each
    optimiser step k ≥ 1 (loss: mean next-token NLL [nats] over the step's global batch; tokens:
    training tokens seen so far, all processes; tokens_per_s: over the run's training time so far,
    evaluations excluded), and ``{"step": k, "ppl": {"L": PPL, …}}`` for each held-out evaluation
    (step 0 = before training).

``loss.png``: training loss and held-out PPL per length vs steps. Comparing runs (PPL at one length
vs steps, tables) is the harness's ``ropescale compare`` (``eval.compare``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ropescale.errors import InvalidInput
from ropescale.runs.plotting import pyplot, save_figure

__all__ = ["LOG", "TrainingLog", "eval_curve", "plot_training", "read_log", "steps_to_reach"]

LOG = "log.jsonl"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _record_error(record) -> str | None:
    """What makes a decoded line not a log record (None: it is one)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record (a JSON object)"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a step number (a whole number >= 0)"
    if "loss" in record and not _number(record["loss"]):
        return f"loss {record['loss']!r} is not a number"
    ppl = record.get("ppl")
    if "ppl" in record and not (isinstance(ppl, dict) and all(k.isdigit() and _number(v) for k, v in ppl.items())):
        return f"ppl {ppl!r} is not a mapping of lengths to perplexities"
    return None


def read_log(path: str | Path) -> list[dict]:
    """Records of a ``log.jsonl`` (a torn line from a killed run — not JSON — is skipped).
    Raises ``InvalidInput`` naming the file and line for a line that is JSON but not a record (not
    an object, no step number, a loss or perplexities that are not numbers)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG
    if not path.is_file():
        return []
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        error = _record_error(record)
        if error:
            raise InvalidInput(f"{path}: line {number} is not a training log record ({error})")
        out.append(record)
    return out


class TrainingLog:
    """Appends records to ``log.jsonl`` (one line at a time, closed after each) when ``enabled``
    (the main process)."""

    def __init__(self, path: Path, enabled: bool = True, tracker=None):
        """``tracker``: accelerate's ``Accelerator`` with trackers started (``report_to``): every record's
        numbers are also logged there, at the record's step (``loss``, ``lr``, ``ppl/<L>``, ...)."""
        self.path, self.enabled, self.tracker = path, enabled, tracker

    def keep_through(self, step: int) -> None:
        """Drop records of steps after ``step`` (−1: all): what a run resumed from the checkpoint
        of ``step`` writes again (a checkpoint is saved after that step's log and evaluation)."""
        if self.enabled:
            keep = [r for r in read_log(self.path) if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record to ``log.jsonl`` (the main process) and report its numbers to the trackers.

        Args:
            record: ``{"step": ..., "loss": ..., ...}``; nested mappings (held-out PPL per length) reported as
                ``key/length``.
        """
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if self.tracker is not None:  # accelerate logs on the main process only
            numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                       and not isinstance(v, bool)}
            numbers |= {f"{k}/{n}": v for k, d in record.items() if isinstance(d, dict)
                        for n, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.tracker.log(numbers, step=record["step"])


def eval_curve(records: list[dict], length: int) -> list[tuple[int, float]]:
    """``(step, PPL at length)`` of every held-out evaluation in the log."""
    return [(r["step"], r["ppl"][str(length)]) for r in records if "ppl" in r and str(length) in r["ppl"]]


def steps_to_reach(records: list[dict], length: int, target: float) -> int | None:
    """First evaluated step whose held-out PPL at ``length`` is ≤ ``target`` (None: never)."""
    return next((step for step, ppl in eval_curve(records, length) if ppl <= target), None)


def plot_training(records: list[dict], path: Path, title: str) -> Path:
    """Loss per step (and its 20-step running mean) and held-out PPL per length vs step."""
    plt = pyplot()
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
            ax.plot([s for s, _ in curve], [p for _, p in curve], marker="o", ms=3, color=f"C{i}",
                    label=f"L = {length}")
        ax.set(xlabel="optimiser step", ylabel="held-out perplexity", title="held-out perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return path

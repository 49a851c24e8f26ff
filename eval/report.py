"""Results files people can load or look at: CSV, Markdown tables, plots — for any task.

``results.csv``: one row per (strategy, length) cell, every scalar field of the record.
``results.md``: one table per metric of the task, strategies as rows and lengths as columns
(T marked), under a line saying which model, data and settings produced it. The task adds
its own figures (``Task.plots``): perplexity draws ``ppl_vs_length.png`` and
``nll_vs_position.png``; the retrieval tasks draw ``accuracy_vs_length.png`` (with 95%
intervals) and ``depth_heatmap.png`` (depth × length, one panel per strategy).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ropescale.errors import InvalidInput

from .plots import len_label, strategies_of

__all__ = ["markdown_report", "markdown_table", "task_of", "write_csv", "write_reports"]

_FIRST = ["task", "strategy", "length", "train_length"]
_LAST = ["model", "data", "params", "options", "dtype", "device", "seconds"]


def task_of(records: list[dict]):
    """The task class of ``records`` (records from before tasks existed are perplexity's)."""
    from .tasks import get_task

    names = {r.get("task", "perplexity") for r in records}
    if len(names) != 1:
        raise InvalidInput(f"records of several tasks ({', '.join(sorted(names))}) cannot share one report")
    return get_task(names.pop())


def write_csv(records: list[dict], path: Path) -> None:
    """One row per cell: identity, metrics, then every other scalar field (params and options
    flattened as ``k=v;...``)."""
    metrics = [m.key for m in task_of(records).metrics]
    scalar = [k for k, v in records[0].items() if isinstance(v, (str, int, float, bool, type(None)))]
    head = [k for k in _FIRST + metrics if k in records[0]]
    fields = head + [k for k in scalar if k not in head and k not in _LAST and k != "cell"] + \
        [k for k in _LAST if k in records[0]]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({**r, **{k: ";".join(f"{a}={b}" for a, b in r[k].items())
                                for k in ("params", "options") if isinstance(r.get(k), dict)}})


def _caption(records: list[dict]) -> str:
    r = records[0]
    task = r.get("task", "perplexity")
    opts = r.get("options") or {k: r[k] for k in ("mode", "stride", "add_bos") if r.get(k) is not None}
    settings = ", ".join(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in opts.items() if v is not None)
    data = f", data `{r['data']}`" if r.get("data") else ""
    return (f"Task `{task}` — model `{r['model']}`{data}, training window T = {r.get('train_length')}, "
            f"{r.get('dtype', 'float32')}; {settings or 'default settings'}.")


def markdown_table(records: list[dict], metric=None) -> str:
    """One metric (default: the task's headline) as strategies × lengths; ``key_ci`` intervals
    are shown beside the value when the records have them."""
    metric = metric or task_of(records).metrics[0]
    lengths = sorted({r["length"] for r in records})
    train = records[0].get("train_length") if records else None
    cells = {(r["strategy"], r["length"]): r for r in records}

    def show(r: dict) -> str:
        if r[metric.key] is None:  # a cell with no value (a RULER length no task fits)
            return "—"
        text = metric.fmt.format(r[metric.key])
        ci = r.get(metric.key + "_ci")
        return text + (f" ({metric.fmt.format(ci[0])}–{metric.fmt.format(ci[1])})" if ci else "")

    head = "| strategy | " + " | ".join(len_label(n, train) for n in lengths) + " |"
    rows = [head, "|---|" + "---:|" * len(lengths)]
    for s in strategies_of(records):
        vals = [show(cells[(s, n)]) if (s, n) in cells else "" for n in lengths]
        rows.append(f"| {s} | " + " | ".join(vals) + " |")
    return "\n".join(rows) + "\n"


def markdown_report(records: list[dict]) -> str:
    """Caption, then one table per metric of the task (with its direction)."""
    parts = [_caption(records), ""]
    for m in task_of(records).metrics:
        better = "higher" if m.higher_is_better else "lower"
        parts += [f"**{m.label}** ({better} is better)", "", markdown_table(records, m)]
    extra = task_of(records).report(records)
    return "\n".join(parts + ([extra] if extra else []))


def write_reports(records: list[dict], output: str | Path) -> dict[str, Path]:
    """Write the CSV, the Markdown tables and the task's plots into ``output``; returns their paths."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    if not records:
        return {}
    paths = {"csv": output / "results.csv", "md": output / "results.md"}
    write_csv(records, paths["csv"])
    paths["md"].write_text(markdown_report(records), encoding="utf-8")
    return paths | task_of(records).plots(records, output)

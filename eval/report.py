"""Results files people can load or look at: CSV, Markdown tables, plots — for any task.

``results.csv``: one row per (strategy, length) cell, every scalar field of the record.
``results.md``: one table per metric of the task, strategies as rows and lengths as columns
(L_train marked), under a line saying which model, data and settings produced it. The task adds
its own figures (``Task.plots``): perplexity draws ``ppl_vs_length.png`` and
``nll_vs_position.png``; the retrieval tasks draw ``accuracy_vs_length.png`` (with 95%
intervals) and ``depth_heatmap.png`` (depth × length, one panel per strategy).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

__all__ = ["write_reports", "write_csv", "markdown_table", "markdown_report", "plot_metric", "plot_position",
           "plot_depth_heatmaps", "task_of"]

_FIRST = ["task", "strategy", "length", "train_length"]
_LAST = ["model", "data", "params", "options", "dtype", "device", "seconds"]


def task_of(records: list[dict]):
    """The task class of ``records`` (records from before tasks existed are perplexity's)."""
    from eval.tasks import get_task

    names = {r.get("task", "perplexity") for r in records}
    if len(names) != 1:
        raise ValueError(f"records of several tasks ({', '.join(sorted(names))}) cannot share one report")
    return get_task(names.pop())


def _strategies(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["strategy"] for r in records))


def _style(i: int, n: int) -> dict:
    """Distinct colour, marker and dash per line, so strategies that coincide stay visible."""
    import matplotlib

    colors = matplotlib.colormaps["tab10" if n <= 10 else "tab20"].colors
    return {"color": colors[i % len(colors)], "marker": "osD^vP*X"[i % 8],
            "ls": ["-", "--", "-.", ":"][i // 2 % 4], "ms": 5}


def _legend(ax, n: int) -> None:
    if n > 6:  # many lines: keep the legend off the data
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8)


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


def _len_label(length: int, train: int | None) -> str:
    if not train:
        return str(length)
    ratio = length / train
    tag = "T" if ratio == 1 else (f"{ratio:g}T")
    return f"{length} ({tag})"


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
        text = metric.fmt.format(r[metric.key])
        ci = r.get(metric.key + "_ci")
        return text + (f" ({metric.fmt.format(ci[0])}–{metric.fmt.format(ci[1])})" if ci else "")

    head = "| strategy | " + " | ".join(_len_label(n, train) for n in lengths) + " |"
    rows = [head, "|---|" + "---:|" * len(lengths)]
    for s in _strategies(records):
        vals = [show(cells[(s, n)]) if (s, n) in cells else "" for n in lengths]
        rows.append(f"| {s} | " + " | ".join(vals) + " |")
    return "\n".join(rows) + "\n"


def markdown_report(records: list[dict]) -> str:
    """Caption, then one table per metric of the task (with its direction)."""
    parts = [_caption(records), ""]
    for m in task_of(records).metrics:
        better = "higher" if m.higher_is_better else "lower"
        parts += [f"**{m.label}** ({better} is better)", "", markdown_table(records, m)]
    return "\n".join(parts)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_train(ax, train: int | None) -> None:
    if train:
        ax.axvline(train, color="grey", ls="--", lw=1)
        ax.annotate("training window", (train, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")


def plot_metric(records: list[dict], key: str, label: str, path: Path, *, ci: str | None = None,
                second: tuple[str, str, str | None] | None = None, chance: str | None = None) -> None:
    """``key`` against length, one line per strategy (with ``ci`` intervals as error bars); with
    ``second`` = (key, label, ci key), a second panel beside it; ``chance`` names a field drawn
    as a dotted level on it."""
    plt = _plt()
    panels = [(key, label, ci)] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(8.5 if len(panels) == 1 else 13, 4.5), squeeze=False)
    names = _strategies(records)
    for ax, (k, lab, ci_key) in zip(axes[0], panels):
        for i, s in enumerate(names):
            rows = sorted((r for r in records if r["strategy"] == s), key=lambda r: r["length"])
            x, y = [r["length"] for r in rows], [r[k] for r in rows]
            style = _style(i, len(names))
            if ci_key:
                err = [[max(0.0, r[k] - r[ci_key][0]) for r in rows], [max(0.0, r[ci_key][1] - r[k]) for r in rows]]
                ax.errorbar(x, y, yerr=err, label=s, capsize=3, elinewidth=0.8, **style)
            else:
                ax.plot(x, y, label=s, **style)
        if chance and k != key:
            ax.axhline(records[0][chance], color="black", ls=":", lw=1)
            ax.annotate("chance", (1, records[0][chance]), xycoords=("axes fraction", "data"),
                        xytext=(-40, 3), textcoords="offset points", fontsize=8)
        _mark_train(ax, records[0].get("train_length"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    r = records[0]
    data = f" on {r['data']}" if r.get("data") else ""
    fig.suptitle(f"{r.get('task', 'perplexity')}: {r['model']}{data}", fontsize=10)
    _legend(axes[0][-1], len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_depth_heatmaps(records: list[dict], key: str, path: Path) -> None:
    """One depth × length panel per strategy, coloured by ``key`` (0 … 1) from the records'
    ``by_depth`` lists."""
    import numpy as np

    plt = _plt()
    names = _strategies(records)
    lengths = sorted({r["length"] for r in records})
    depths = sorted({d["depth"] for r in records for d in r["by_depth"]})
    cols = min(4, len(names))
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.4 * cols + 1, 2.9 * rows_n + 0.6), squeeze=False)
    train = records[0].get("train_length")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, s in zip(axes.flat, names):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in records:
            if r["strategy"] == s:
                for d in r["by_depth"]:
                    grid[depths.index(d["depth"]), lengths.index(r["length"])] = d[key]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0%}"[:-1] if v < 1 else "100", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [_len_label(n, train).split(" ")[-1].strip("()") if train else str(n)
                                            for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("length", fontsize=8)
        ax.set_ylabel("depth", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label=key.replace("_", " "))
    r = records[0]
    data = f" on {r['data']}" if r.get("data") else ""
    fig.suptitle(f"{r.get('task')}: {key.replace('_', ' ')} by depth and length — {r['model']}{data}", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_position(records: list[dict], path: Path) -> None:
    plt = _plt()
    longest = max(r["length"] for r in records)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    rows = [r for r in records if r["length"] == longest]
    for i, r in enumerate(rows):
        pts = [((b["start"] + b["end"]) / 2, b["nll"]) for b in r["nll_by_position"] if b["nll"] is not None]
        if pts:
            ax.plot(*zip(*pts), label=r["strategy"], **_style(i, len(rows)))
    train = records[0].get("train_length")
    if train:
        ax.axvline(train, color="grey", ls="--", lw=1)
        ax.annotate("training window", (train, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set_xlabel(f"position in window (window = {longest} tokens)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title("loss by position", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax, len(rows))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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

"""Figures any task can draw from its records (``Task.plots`` calls them): a metric against
length, one line per strategy (with intervals); loss by position; depth × length heatmaps.
"""

from __future__ import annotations

from pathlib import Path

from ropescale.runs.plotting import legend, line_style, mark_train, pyplot, save_figure

__all__ = ["len_label", "plot_depth_heatmaps", "plot_metric", "plot_position", "plot_task_heatmaps", "strategies_of"]


def strategies_of(records: list[dict]) -> list[str]:
    """The records' strategies, in first-seen order."""
    return list(dict.fromkeys(r["strategy"] for r in records))


def len_label(length: int, train: int | None) -> str:
    """An axis label for a length [tokens]: ``"512 (4T)"`` against the training window T."""
    if not train:
        return str(length)
    ratio = length / train
    tag = "T" if ratio == 1 else (f"{ratio:g}T")
    return f"{length} ({tag})"


def plot_metric(records: list[dict], key: str, label: str, path: Path, *, ci: str | None = None,
                second: tuple[str, str, str | None] | None = None, chance: str | None = None,
                level: tuple[float, str] | None = None) -> None:
    """``key`` against length, one line per strategy (with ``ci`` intervals as error bars); with
    ``second`` = (key, label, ci key), a second panel beside it; ``chance`` names a field drawn
    as a dotted level on it; ``level`` = (value, words) a dotted level on the first panel."""
    plt = pyplot()
    panels = [(key, label, ci)] + ([second] if second else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(8.5 if len(panels) == 1 else 13, 4.5), squeeze=False)
    names = strategies_of(records)
    for ax, (k, lab, ci_key) in zip(axes[0], panels):
        for i, s in enumerate(names):
            rows = sorted((r for r in records if r["strategy"] == s and r[k] is not None), key=lambda r: r["length"])
            x, y = [r["length"] for r in rows], [r[k] for r in rows]
            style = line_style(i, len(names))
            if ci_key:
                ci = [r.get(ci_key) or (r[k], r[k]) for r in rows]  # a record without one: no bar
                err = [[max(0.0, r[k] - c[0]) for r, c in zip(rows, ci)],
                       [max(0.0, c[1] - r[k]) for r, c in zip(rows, ci)]]
                ax.errorbar(x, y, yerr=err, label=s, capsize=3, elinewidth=0.8, **style)
            else:
                ax.plot(x, y, label=s, **style)
        if level is not None and k == key:
            ax.axhline(level[0], color="black", ls=":", lw=1)
            ax.annotate(level[1], (1, level[0]), xycoords=("axes fraction", "data"), xytext=(-55, 3),
                        textcoords="offset points", fontsize=8)
        if chance and k != key:
            ax.axhline(records[0][chance], color="black", ls=":", lw=1)
            ax.annotate("chance", (1, records[0][chance]), xycoords=("axes fraction", "data"),
                        xytext=(-40, 3), textcoords="offset points", fontsize=8)
        mark_train(ax, records[0].get("train_length"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    r = records[0]
    data = f" on {r['data']}" if r.get("data") else ""
    fig.suptitle(f"{r.get('task', 'perplexity')}: {r['model']}{data}", fontsize=10)
    legend(axes[0][-1], len(names))
    save_figure(fig, path)


def plot_depth_heatmaps(records: list[dict], key: str, path: Path) -> None:
    """One depth × length panel per strategy, coloured by ``key`` (0 … 1) from the records'
    ``by_depth`` lists."""
    import numpy as np

    plt = pyplot()
    names = strategies_of(records)
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
        ax.set_xticks(range(len(lengths)), [len_label(n, train).split(" ")[-1].strip("()") if train else str(n)
                                            for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("length", fontsize=8)
        ax.set_ylabel("depth", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label=key.replace("_", " "))
    r = records[0]
    data = f" on {r['data']}" if r.get("data") else ""
    fig.suptitle(f"{r.get('task')}: {key.replace('_', ' ')} by depth and length — {r['model']}{data}", fontsize=10)
    save_figure(fig, path, layout=False, bbox_tight=True)  # a colour bar: no tight_layout


def plot_position(records: list[dict], path: Path) -> None:
    """NLL by position at the longest length, one line per strategy (perplexity's ``nll_by_position``).

    Args:
        records: the experiment's records.
        path: the PNG written.
    """
    plt = pyplot()
    longest = max(r["length"] for r in records)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    rows = [r for r in records if r["length"] == longest]
    for i, r in enumerate(rows):
        pts = [((b["start"] + b["end"]) / 2, b["nll"]) for b in r["nll_by_position"] if b["nll"] is not None]
        if pts:
            ax.plot(*zip(*pts), label=r["strategy"], **line_style(i, len(rows)))
    train = records[0].get("train_length")
    if train:
        ax.axvline(train, color="grey", ls="--", lw=1)
        ax.annotate("training window", (train, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set_xlabel(f"position in window (window = {longest} tokens)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title("loss by position", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax, len(rows))
    save_figure(fig, path)


def plot_task_heatmaps(records: list[dict], path: Path) -> None:
    """RULER's view: one task × length panel per strategy, coloured by score (0 … 100) from the
    records' ``scores`` (a task refused at a length is left blank)."""
    import numpy as np

    plt = pyplot()
    names = strategies_of(records)
    lengths = sorted({r["length"] for r in records})
    tasks = records[0]["tasks"]
    cols = min(4, len(names))
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(1.1 * len(lengths) * cols + 3, 0.3 * len(tasks) * rows_n + 1.5),
                             squeeze=False)
    train = records[0].get("train_length")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for k, (ax, s) in enumerate(zip(axes.flat, names)):
        grid = np.full((len(tasks), len(lengths)), np.nan)
        for r in records:
            if r["strategy"] == s:
                for t, v in r["scores"].items():
                    grid[tasks.index(t), lengths.index(r["length"])] = v
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [len_label(n, train).split(" ")[-1].strip("()") if train else str(n)
                                            for n in lengths], fontsize=7)
        ax.set_yticks(range(len(tasks)), tasks if k % cols == 0 else [""] * len(tasks), fontsize=7)
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("length", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="RULER score (%)")
    r = records[0]
    data = f" on {r['data']}" if r.get("data") else ""
    fig.suptitle(f"RULER: score by task and length — {r['model']}{data}", fontsize=10)
    save_figure(fig, path, layout=False, bbox_tight=True)  # a colour bar: no tight_layout

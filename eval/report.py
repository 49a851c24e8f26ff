"""Results files people can load or look at: CSV, Markdown table, plots.

``results.csv``: one row per (strategy, length) cell. ``results.md``: perplexity with
strategies as rows and lengths as columns (L_train marked). ``ppl_vs_length.png``: one line per
strategy, log-2 length axis, training window marked. ``nll_vs_position.png``: mean NLL by
position within the window at the longest length — where the damage past L_train shows.
"""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["write_reports", "write_csv", "markdown_table", "plot_ppl", "plot_position"]

CSV_FIELDS = ["strategy", "length", "ppl", "nll", "tokens", "windows", "mode", "stride", "add_bos",
              "model", "data", "params", "seconds", "tokens_per_s"]


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
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({**r, "params": ";".join(f"{k}={v}" for k, v in r["params"].items())})


def _len_label(length: int, train: int | None) -> str:
    if not train:
        return str(length)
    ratio = length / train
    tag = "T" if ratio == 1 else (f"{ratio:g}T")
    return f"{length} ({tag})"


def markdown_table(records: list[dict]) -> str:
    """Perplexity table: strategies × lengths (lower is better)."""
    lengths = sorted({r["length"] for r in records})
    train = records[0].get("train_length") if records else None
    cell = {(r["strategy"], r["length"]): r["ppl"] for r in records}
    head = "| strategy | " + " | ".join(_len_label(n, train) for n in lengths) + " |"
    rows = [head, "|---|" + "---:|" * len(lengths)]
    for s in _strategies(records):
        vals = [f"{cell[(s, n)]:.2f}" if (s, n) in cell else "" for n in lengths]
        rows.append(f"| {s} | " + " | ".join(vals) + " |")
    return "\n".join(rows) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ppl(records: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    names = _strategies(records)
    for i, s in enumerate(names):
        pts = sorted((r["length"], r["ppl"]) for r in records if r["strategy"] == s)
        ax.plot(*zip(*pts), label=s, **_style(i, len(names)))
    train = records[0].get("train_length")
    if train:
        ax.axvline(train, color="grey", ls="--", lw=1)
        ax.annotate("training window", (train, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{records[0]['model']} on {records[0]['data']} ({records[0]['mode']})", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax, len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
    """Write CSV, Markdown and both plots into ``output``; returns their paths."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {"csv": output / "results.csv", "md": output / "results.md",
             "plot": output / "ppl_vs_length.png", "position_plot": output / "nll_vs_position.png"}
    if not records:
        return {}
    write_csv(records, paths["csv"])
    paths["md"].write_text(markdown_table(records))
    plot_ppl(records, paths["plot"])
    plot_position(records, paths["position_plot"])
    return paths

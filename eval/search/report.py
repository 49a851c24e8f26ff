"""What a search folder holds besides its study: the best spec as a strategy entry, the trials
table (CSV) and the objective plot — shared by the Optuna tuner (``eval.search.run``) and
LongRoPE's evolutionary search (``eval.search.longrope``). The search's identity is its config's
(``SearchConfig.identity``)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ropescale.runs.manifest import OutputError
from ropescale.runs.plotting import pyplot, save_figure

from .config import SearchConfig

__all__ = ["BEST", "PARETO", "PLOT", "REPORT", "STUDY", "TRIALS", "fmt", "pareto_front",
           "perplexity_term", "plot_objective", "plot_pareto", "replacing", "spec_string", "write_csv", "write_text"]

STUDY, BEST, TRIALS, REPORT, PLOT = "study.db", "best.json", "trials.csv", "results.md", "search.png"
PARETO = "pareto.png"


def spec_string(strategy: str, params: dict) -> str:
    """``NAME:k=v,...``, the strategy entry ``eval`` and ``sweep`` read (``parse_strategy``)."""
    return strategy + (":" + ",".join(f"{k}={v!r}" for k, v in params.items()) if params else "")


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write, moved onto ``path`` when the block ends (an
    atomic rename): a run killed while writing leaves the old file or none, never a cut one.
    ``OutputError`` (one line) when the folder cannot take it (a full disk)."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # one writer at a time: the folder's lock
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path} ({e.strerror or e}); free space or use another output folder, "
                          "then rerun the same command: the search resumes") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` (UTF-8), atomically (``replacing``)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` as CSV (columns: every key, in order of first appearance), atomically."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with replacing(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def fmt(v) -> str:
    """A table cell: floats to 4 significant digits, None empty."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def plot_objective(rows: list[dict], path: Path, cfg: SearchConfig) -> None:
    """The objective of each finished trial against the trial, and the best feasible one so far.

    Args:
        rows: the trials' rows (``trials.csv``).
        path: the PNG written.
        cfg: the search (titles name its strategy, model and method).
    """
    plt = pyplot()
    done = [r for r in rows if r["objective"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ok = [r for r in done if r["feasible"] is not False]
    bad = [r for r in done if r["feasible"] is False]
    ax.scatter([r["trial"] for r in ok], [r["objective"] for r in ok], s=18, label="trial (feasible)")
    if bad:
        ax.scatter([r["trial"] for r in bad], [r["objective"] for r in bad], s=18, marker="x",
                   label="trial (PPL at T over the limit)")
    best, xs, ys = math.inf, [], []
    for r in ok:
        best = min(best, r["objective"])
        xs.append(r["trial"])
        ys.append(best)
    if xs:
        xs.append(max(r["trial"] for r in done))  # the best holds to the last trial
        ys.append(best)
        ax.step(xs, ys, where="post", color="black", lw=1.2, label="best so far (feasible)")
    ax.set_xlabel("trial")
    ax.set_ylabel("objective J [nats/token]")
    ax.set_title(f"{cfg.strategy} on {cfg.model}: {cfg.method} search", fontsize=10)
    ax.legend(fontsize=8)
    with replacing(path) as tmp:
        save_figure(fig, tmp)


def pareto_front(points) -> list[int]:
    """Indices of the non-dominated points of ``points`` (pairs ``(a, b)``, both minimised), in
    order of increasing ``a`` (then ``b``, then index).

    p dominates q when p ≤ q in both objectives and p < q in one; equal points do not dominate each
    other, so duplicates on the front are all kept. O(n log n): sorted by (a, b), a point is on the
    front when it has the least ``b`` of its ``a`` and a ``b`` below every point of smaller ``a``."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front: list[int] = []
    best_b = math.inf  # least b among points of strictly smaller a
    k = 0
    while k < len(order):
        a = points[order[k]][0]
        group = [i for i in order[k:] if points[i][0] == a]  # sorted: the equal a's are contiguous
        low = points[group[0]][1]
        if low < best_b:
            front.extend(i for i in group if points[i][1] == low)
        best_b = min(best_b, low)
        k += len(group)
    return front


def perplexity_term(row: dict, cfg: SearchConfig) -> float:
    """The perplexity part of a trial's objective, Σ_L w_L · ln PPL_L [nats/token], from its row."""
    return sum(w * math.log(row[f"ppl@{L}"]) for L, w in zip(cfg.lengths, cfg.weights()))


def plot_pareto(rows: list[dict], path: Path, cfg: SearchConfig, best: int | None = None) -> list[int]:
    """``pareto.png``: every trial's perplexity term against its passkey answer NLL (grey), the
    Pareto front (both minimised) highlighted and connected, the chosen best (trial ``best``)
    marked. Returns the front's trial numbers, in order of increasing perplexity term."""
    done = [r for r in rows if r.get("objective") is not None and r.get("retrieval_nll") is not None]
    pts = [(perplexity_term(r, cfg), r["retrieval_nll"]) for r in done]
    front = pareto_front(pts)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ok = [i for i, r in enumerate(done) if r["feasible"] is not False]
    bad = [i for i, r in enumerate(done) if r["feasible"] is False]
    ax.scatter([pts[i][0] for i in ok], [pts[i][1] for i in ok], s=16, color="0.65", label="trial")
    if bad:
        ax.scatter([pts[i][0] for i in bad], [pts[i][1] for i in bad], s=18, marker="x", color="0.65",
                   label="trial (PPL at T over the limit)")
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-o", color="tab:red", ms=5, lw=1.2,
            label=f"Pareto front ({len(front)} trials)")
    chosen = [i for i, r in enumerate(done) if r["trial"] == best]
    if chosen:
        i = chosen[0]
        ax.scatter([pts[i][0]], [pts[i][1]], s=160, marker="*", color="black", zorder=5,
                   label=f"best J (trial {best}, r = {cfg.retrieval_weight:g})")
    lengths = ", ".join(str(L) for L in cfg.lengths)
    ax.set_xlabel(f"perplexity term Σ w·NLL at {lengths} [nats/token]")
    ax.set_yscale("log")  # the answer NLL spans decades; the front sits at its bottom
    ax.set_ylabel("passkey answer NLL [nats/token, log scale]")
    ax.set_title(f"{cfg.strategy} on {cfg.model}: {len(done)} trials, both minimised", fontsize=10)
    ax.legend(fontsize=8)
    with replacing(path) as tmp:
        save_figure(fig, tmp)
    return [done[i]["trial"] for i in front]

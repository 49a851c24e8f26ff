"""What a search folder holds besides its study: the manifest identity, the best spec as a
strategy entry, the trials table (CSV) and the objective plot — shared by the Optuna tuner
(``eval.search.run``) and LongRoPE's evolutionary search (``eval.search.longrope``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from ropescale.models import model_fingerprint
from ropescale.runs.manifest import environment
from ropescale.runs.plotting import pyplot

from .config import SearchConfig

__all__ = ["BEST", "PLOT", "REPORT", "STUDY", "TRIALS", "fmt", "identity", "plot_objective", "spec_string",
           "write_csv"]

STUDY, BEST, TRIALS, REPORT, PLOT = "study.db", "best.json", "trials.csv", "results.md", "search.png"


def spec_string(strategy: str, params: dict) -> str:
    """``NAME:k=v,...``, the strategy entry ``eval`` and ``sweep`` read (``parse_strategy``)."""
    return strategy + (":" + ",".join(f"{k}={v!r}" for k, v in params.items()) if params else "")


def identity(cfg: SearchConfig) -> dict:
    from ropescale.models import load_tokenizer
    from ropescale.runs.data import load_documents, tokenize_documents
    from ropescale.runs.manifest import data_fingerprint

    env = environment()
    docs = tokenize_documents(load_tokenizer(cfg.model), load_documents(cfg.data.spec()))
    keep = ("strategy", "search", "fixed", "lengths", "length_weights", "method", "seed", "max_windows",
            "retrieval_weight", "retrieval_trials", "epsilon", "original_max_position_embeddings", "dtype",
            "evolution")
    return {"task": "search", "model": cfg.model, "weights": model_fingerprint(cfg.model),
            "data": cfg.data.spec().describe(), "data_tokens": data_fingerprint(docs),
            **cfg.model_dump(mode="json", include=set(keep)),
            "versions": {k: env[k] for k in ("ropescale", "torch", "transformers")}}


def write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def plot_objective(rows: list[dict], path: Path, cfg: SearchConfig) -> None:
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

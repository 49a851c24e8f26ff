"""``ropescale search``: run (or resume) a parameter search and write its folder.

The folder holds one search (``manifest.json``: model and weights, search data and its tokens,
strategy, space, fixed values, lengths and weights, method, seed, windows, objective settings,
versions; a rerun with another identity is refused in one line — the budget is not part of it,
so raising it extends a search). The study itself is ``study.db`` (Optuna, SQLite: resumable,
shareable by several ``ropescale search`` processes; ``eval.search.tuner``). When the run ends:

- ``best.json``: ``{"strategy": NAME, "params": {...}, "spec": "NAME:k=v,...", ...}`` —
  ``ropescale.patch(model, best["strategy"], **best["params"])`` applies it, and ``spec`` is a
  strategy entry ``eval`` / ``sweep`` / ``finetune`` accept;
- ``trials.csv``: every trial (state, parameters, objective, constraint, PPL per length, PPL at T);
- ``results.md``: the settings and the trials table; ``search.png``: objective vs trial and the
  best so far.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from ropescale.models import model_fingerprint
from ropescale.runs.config import ConfigError
from ropescale.runs.manifest import check_manifest, environment, folder_lock, prepare_output
from ropescale.runs.plotting import pyplot

from .config import SearchConfig
from .tuner import Outcome, best_trial, optuna, run_study

__all__ = ["BEST", "STUDY", "TRIALS", "run_search", "spec_string"]

STUDY, BEST, TRIALS, REPORT, PLOT = "study.db", "best.json", "trials.csv", "results.md", "search.png"


def spec_string(strategy: str, params: dict) -> str:
    """``NAME:k=v,...``, the strategy entry ``eval`` and ``sweep`` read (``parse_strategy``)."""
    return strategy + (":" + ",".join(f"{k}={v!r}" for k, v in params.items()) if params else "")


def _identity(cfg: SearchConfig) -> dict:
    from ropescale.models import load_tokenizer
    from ropescale.runs.data import load_documents, tokenize_documents
    from ropescale.runs.manifest import data_fingerprint

    env = environment()
    docs = tokenize_documents(load_tokenizer(cfg.model), load_documents(cfg.data.spec()))
    keep = ("strategy", "search", "fixed", "lengths", "length_weights", "method", "seed", "max_windows",
            "retrieval_weight", "retrieval_trials", "epsilon", "original_max_position_embeddings", "dtype")
    return {"task": "search", "model": cfg.model, "weights": model_fingerprint(cfg.model),
            "data": cfg.data.spec().describe(), "data_tokens": data_fingerprint(docs),
            **cfg.model_dump(mode="json", include=set(keep)),
            "versions": {k: env[k] for k in ("ropescale", "torch", "transformers")}}


def run_search(cfg: SearchConfig, output: str | Path, *, progress: bool = True) -> dict:
    """Run (or resume) ``cfg``'s search into ``output``; returns the ``best.json`` mapping.

    Raises ``ConfigError`` (one line) for a method that is not available, and the manifest's
    errors for a folder holding another search or busy being written."""
    output = prepare_output(Path(output))
    if cfg.method == "evolution":
        try:
            from .evolution import run_evolution
        except ImportError:
            raise ConfigError("method: evolution (LongRoPE's search) is not available in this version; "
                              "use tpe or cmaes") from None
        return run_evolution(cfg, output, progress=progress)
    with folder_lock(output):  # held while checking: processes sharing the study run unlocked
        experiment = check_manifest(output, _identity(cfg), cfg.model_dump(mode="json"))
    storage = f"sqlite:///{(output / STUDY).resolve()}"
    state: dict = {}

    def evaluate(sampled: dict) -> Outcome:
        if "objective" not in state:  # the model is loaded only when a trial is left to run
            from .objective import SearchObjective

            state["objective"] = SearchObjective(cfg, progress=progress)
            state["study"].set_user_attr("vanilla_ppl_train", state["objective"].vanilla_ppl_train)
            state["study"].set_user_attr("train_length", state["objective"].train_length)
        params, m = state["objective"](sampled)
        return Outcome(m.objective, m.constraint, attrs={"spec": params, **m.row()})

    def report(trial) -> None:
        if not progress:
            return
        if trial.user_attrs.get("invalid"):
            print(f"trial {trial.number:>4}: refused ({trial.user_attrs['invalid']})", flush=True)
            return
        a = trial.user_attrs
        ppl = ", ".join(f"{k} {v:.2f}" for k, v in a.items() if k.startswith("ppl@"))
        print(f"trial {trial.number:>4}: J {a['objective']:.4f} ({ppl}; PPL@T {a['ppl_train']:.2f}, "
              f"c {a['constraint']:+.3f}) {a['seconds']:.1f}s  {json.dumps(trial.params)}", flush=True)

    opt = optuna()
    state["study"] = opt.create_study(storage=storage, study_name=experiment, direction="minimize",
                                      load_if_exists=True)
    study = run_study(cfg.space(), evaluate, storage=storage, study_name=experiment, method=cfg.method,
                      seed=cfg.seed, budget=cfg.budget, report=report)
    with folder_lock(output):
        return write_outputs(cfg, study, output)


def write_outputs(cfg: SearchConfig, study, output: Path) -> dict:
    """``best.json``, ``trials.csv``, ``results.md`` and ``search.png`` from the study."""
    best, feasible = best_trial(study)
    if best is None:
        raise ConfigError(f"no candidate could be evaluated: every trial was refused by {cfg.strategy} "
                          f"(see {output / TRIALS}); narrow the ranges under search:")
    params = best.user_attrs["spec"]
    result = {"strategy": cfg.strategy, "params": params, "spec": spec_string(cfg.strategy, params),
              "objective": best.user_attrs["objective"], "feasible": feasible, "trial": best.number,
              "ppl": {k[4:]: v for k, v in best.user_attrs.items() if k.startswith("ppl@")},
              "ppl_train": best.user_attrs["ppl_train"], "evaluations": _evaluations(study)}
    (output / BEST).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    rows = _rows(study)
    _write_csv(rows, output / TRIALS)
    (output / REPORT).write_text(_markdown(cfg, study, result, rows), encoding="utf-8")
    _plot(rows, output / PLOT, cfg)
    return result


def _evaluations(study) -> int:
    states = optuna().trial.TrialState
    return len(study.get_trials(deepcopy=False, states=(states.COMPLETE,)))


def _rows(study) -> list[dict]:
    states = optuna().trial.TrialState
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in (states.COMPLETE, states.PRUNED):
            continue
        a = t.user_attrs
        row = {"trial": t.number, "state": t.state.name.lower(), **t.params}
        row.update({k: a.get(k) for k in ("objective", "constraint")})
        row["feasible"] = None if a.get("constraint") is None else a["constraint"] <= 0
        row.update({k: v for k, v in a.items() if k.startswith("ppl@")})
        row.update({k: a.get(k) for k in ("ppl_train", "retrieval_nll", "seconds", "invalid")})
        rows.append(row)
    return rows


def _write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _markdown(cfg: SearchConfig, study, best: dict, rows: list[dict]) -> str:
    attrs = study.user_attrs
    train = attrs.get("train_length", cfg.original_max_position_embeddings)
    lengths = ", ".join(f"{L} (weight {w:.2g})" for L, w in zip(cfg.lengths, cfg.weights()))
    lines = [
        f"# Parameter search: {cfg.strategy} on {cfg.model}", "",
        f"- model: `{cfg.model}`; search data: `{cfg.data.spec().describe()}` (first {cfg.max_windows} "
        f"windows per length); held-out data kept out: `{cfg.heldout.spec().describe() if cfg.heldout else '—'}`",
        f"- method: {cfg.method}, seed {cfg.seed}, budget {cfg.budget} trials; {best['evaluations']} candidates "
        "evaluated",
        f"- target lengths: {lengths}; training window T = {train}",
        "- objective J = Σ w_L · mean NLL_L [nats/token]"
        + (f" + {cfg.retrieval_weight:g} × passkey answer NLL" if cfg.retrieval_weight else ""),
        f"- constraint: PPL at T ≤ (1 + {cfg.epsilon:g}) × vanilla's"
        + (f" ({attrs['vanilla_ppl_train']:.3f})" if "vanilla_ppl_train" in attrs else ""),
        f"- fixed: {json.dumps(cfg.fixed)}", "",
        f"**Best** (trial {best['trial']}{'' if best['feasible'] else ', no feasible trial'}): `{best['spec']}` — "
        f"J {best['objective']:.4f}, PPL " + ", ".join(f"@{k} {v:.3f}" for k, v in best["ppl"].items())
        + f", PPL@T {best['ppl_train']:.3f}", "",
    ]
    columns = list(dict.fromkeys(k for r in rows for k in r if k != "invalid"))
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path, cfg: SearchConfig) -> None:
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
        ax.step(xs, ys, where="post", color="black", lw=1.2, label="best so far (feasible)")
    ax.set_xlabel("trial")
    ax.set_ylabel("objective J [nats/token]")
    ax.set_title(f"{cfg.strategy} on {cfg.model}: {cfg.method} search", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

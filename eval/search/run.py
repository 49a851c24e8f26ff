"""``ropescale search``: run (or resume) a parameter search and write its folder.

The folder holds one search (``manifest.json``: model and weights, search data and its tokens,
strategy, space, fixed values, lengths and weights, method, seed, windows, objective settings,
versions; a rerun with another identity is refused in one line — the budget is not part of it,
so raising it extends a search). The study itself is ``study.db`` (Optuna, SQLite: resumable,
shareable by several ``ropescale search`` processes; ``eval.search.tuner``). When the run ends:

- ``best.json``: ``{"strategy": NAME, "params": {...}, "spec": "NAME:k=v,...", ...}`` —
  ``ropescale.patch(model, best["strategy"], **best["params"])`` applies it, and ``spec`` is a
  strategy entry ``eval`` / ``sweep`` / ``finetune`` accept and ``ropescale patch --strategy SPEC``
  exports (transformers-native ``config.json`` for yarn, longrope, ntk, linear, dynamic_ntk,
  llama3; the others — rerope, self_extend, ntk_by_parts, … — need ``ropescale.load_model``);
- ``trials.csv``: every trial (state, parameters, objective, constraint, PPL per length, PPL at T);
- ``results.md``: the settings and the trials table; ``search.png``: objective vs trial and the
  best so far;
- ``pareto.png`` (only with ``retrieval_weight`` > 0, when each trial has two objectives: the
  perplexity term Σ w_L · NLL_L and the passkey answer's NLL): every trial, the Pareto front of
  the two (both minimised) and the chosen best; the front's trials are listed in ``results.md``.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from ropescale.runs.config import ConfigError
from ropescale.runs.manifest import LOCK, FolderBusyError, check_manifest, prepare_output

from .config import SearchConfig
from .report import (
    BEST,
    PARETO,
    PLOT,
    REPORT,
    STUDY,
    TRIALS,
    fmt,
    identity,
    plot_objective,
    plot_pareto,
    spec_string,
    write_csv,
)
from .tuner import Outcome, best_trial, optuna, run_study

__all__ = ["run_search", "write_outputs"]


def run_search(cfg: SearchConfig, output: str | Path, *, progress: bool = True) -> dict:
    """Run (or resume) ``cfg``'s search into ``output``; returns the ``best.json`` mapping.

    Raises ``ConfigError`` (one line) for a method that is not available, and the manifest's
    errors for a folder holding another search or busy being written."""
    from ropescale.models import resolve_device

    from ..config import resolved_dtype

    # dtype auto recorded resolved (identity, manifest): the same experiment as its explicit name
    cfg = cfg.model_copy(update={"dtype": resolved_dtype(cfg.dtype, resolve_device(cfg.device))})
    output = prepare_output(Path(output))
    if cfg.method == "evolution":
        from .longrope import run_longrope_search

        return run_longrope_search(cfg, output, progress=progress)
    ident = identity(cfg)
    with _briefly_locked(output):  # held while checking: processes sharing the study run unlocked
        experiment = check_manifest(output, ident, cfg.model_dump(mode="json"))
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
    with _briefly_locked(output):
        return write_outputs(cfg, study, output)


@contextmanager
def _briefly_locked(output: Path, wait: float = 120.0):
    """The folder's lock (``ropescale.runs.manifest.LOCK``) for a short step — the manifest check,
    the outputs — waiting up to ``wait`` seconds for another search process sharing the folder;
    ``FolderBusyError`` (one line) when a run holds it longer (a sweep writing there)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(output / LOCK), timeout=wait)
    try:
        lock.acquire()
    except Timeout:
        raise FolderBusyError(f"{output} is being written by another run (lock {LOCK}); wait for it to finish "
                              "or use another output folder") from None
    try:
        yield
    finally:
        lock.release()


def write_outputs(cfg: SearchConfig, study, output: Path) -> dict:
    """``best.json``, ``trials.csv``, ``results.md``, ``search.png`` (and ``pareto.png`` with the
    retrieval term) from the study."""
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
    write_csv(rows, output / TRIALS)
    front = plot_pareto(rows, output / PARETO, cfg, best.number) if cfg.retrieval_weight > 0 else None
    (output / REPORT).write_text(_markdown(cfg, study, result, rows, front), encoding="utf-8")
    plot_objective(rows, output / PLOT, cfg)
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


def _markdown(cfg: SearchConfig, study, best: dict, rows: list[dict], front: list[int] | None = None) -> str:
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
    if front is not None:
        lines += [f"Pareto front of (perplexity term, passkey answer NLL), both minimised ({PARETO}): trials "
                  + ", ".join(map(str, front)), ""]
    columns = list(dict.fromkeys(k for r in rows for k in r if k != "invalid"))
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"

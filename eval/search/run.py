"""``ropescale search``: run (or resume) a parameter search and write its folder.

The folder holds one search (``manifest.json``: model and weights, search data and its tokens,
strategy, space, fixed values, lengths and weights, method, seed, windows, objective settings,
versions; a rerun with another identity is refused in one line — the budget is not part of it,
so raising it extends a search). The study itself is ``study.db`` (Optuna, SQLite: resumable,
shareable by several ``ropescale search`` processes, whose asks ``study.db.lock`` serialises;
killed anywhere, a rerun resumes to the uninterrupted result; ``eval.search.tuner``). The model
and data are loaded and checked before the folder is touched. When the run ends (each file
replaced atomically, ``best.json`` last):

- ``best.json``: ``{"strategy": NAME, "params": {...}, "spec": "NAME:k=v,...", ...}`` —
  ``ropescale.patch(model, best["strategy"], **best["params"])`` applies it, and ``spec`` is a
  strategy entry ``eval`` / ``sweep`` / ``finetune`` accept and ``ropescale patch --strategy SPEC``
  exports (transformers-native ``config.json`` for yarn, longrope, ntk, linear, dynamic_ntk,
  llama3; the others — rerope, self_extend, ntk_by_parts, … — need ``ropescale.load_model``);
- ``trials.csv``: every finished trial (its index, state — complete, refused by the strategy, or
  failed: a non-finite objective —, parameters, objective, constraint, PPL per length, PPL at T);
- ``results.md``: the settings and the trials table; ``search.png``: objective vs trial and the
  best so far;
- ``pareto.png`` (only with ``retrieval_weight`` > 0, when each trial has two objectives: the
  perplexity term Σ w_L · NLL_L and the passkey answer's NLL): every trial, the Pareto front of
  the two (both minimised) and the chosen best; the front's trials are listed in ``results.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ropescale.runs.lifecycle import RunInputs
from ropescale.runs.protocol import RunFolder, execute_run
from ropescale.runs.trackers import check_installed

from .config import SearchConfig
from .objective import SearchRun, check_engine
from .report import (
    BEST,
    PARETO,
    PLOT,
    REPORT,
    STUDY,
    TRIALS,
    fmt,
    plot_objective,
    plot_pareto,
    spec_string,
    write_csv,
    write_text,
)
from .space import centre
from .trackers import SearchTrackers, trial_numbers
from .tuner import (
    FAILED,
    INVALID,
    Outcome,
    SearchFailed,
    best_trial,
    open_study,
    optuna,
    run_study,
    storage_errors,
    trial_index,
)

__all__ = ["OptunaSearch", "SearchFailed", "run_search", "write_outputs"]

BRIEF_LOCK_WAIT = 120.0  # seconds a search process waits for another holding the folder's lock for a short step


def run_search(cfg: SearchConfig, output: str | Path, *, progress: bool = True) -> dict:
    """Run (or resume) a parameter search into its folder.

    The model and the search data are loaded and checked first: a refused search writes nothing.

    Args:
        cfg: the search (``SearchConfig``; ``method: evolution`` runs LongRoPE's evolution).
        output: its folder (``study.db`` or the evolution's journal: a rerun resumes).
        progress: print each trial.

    Returns:
        The ``best.json`` mapping: ``strategy``, ``params``, ``spec`` (a strategy entry), the
        objective and the PPL per length of the best trial.

    Raises:
        ropescale.errors.RopescaleError: a model without RoPE, data too short for a length, a method
            that is not available (one line; nothing written).
        ropescale.runs.manifest.ExperimentMismatchError: the folder holds another search
            (``FolderBusyError``: it is busy being written past the wait).
        eval.search.tuner.StudyError: a ``study.db`` that cannot be used.
        eval.search.tuner.SearchFailed: every trial was refused or failed.
    """
    from ropescale.models import resolve_device

    from ..config import resolved_dtype

    # dtype auto recorded resolved (identity, manifest): the same experiment as its explicit name
    cfg = cfg.model_copy(update={"dtype": resolved_dtype(cfg.dtype, resolve_device(cfg.device))})
    if cfg.method == "evolution":
        from .longrope import EvolutionSearch

        return execute_run(EvolutionSearch(cfg, progress=progress), output)
    return execute_run(OptunaSearch(cfg, progress=progress), output)


class OptunaSearch(SearchRun):
    """A search by Optuna (TPE, CMA-ES) as a run kind (``ropescale.runs.protocol``). Several
    ``ropescale search`` processes may run one study in one folder (``shares_folder``): each loads
    and checks the model and data first, then holds the folder's lock only to check the manifest and
    create the study (``claim``) and to write the outputs (``finish``), waiting up to
    ``BRIEF_LOCK_WAIT`` seconds for another's hold."""

    shares_folder = True
    lock_wait = BRIEF_LOCK_WAIT

    def check(self) -> None:
        check_installed(self.cfg.report_to, "config")  # what needs no model, before anything loads or is written
        check_engine(self.cfg)

    def prepare(self, inputs: RunInputs, folder: RunFolder | None) -> None:
        super().prepare(inputs, folder)
        self.objective.check_candidate(centre(self.cfg.space()))  # the strategy's output, before the folder

    def claim(self, folder: RunFolder) -> None:
        self.storage = f"sqlite:///{(folder.path / STUDY).resolve()}"
        open_study(self.storage, folder.experiment)  # created once, under the lock, by whichever process comes first

    def execute(self, folder: RunFolder):
        self.objective.serve_from(folder.path)  # an engine outside this process: where it serves candidates from
        trackers = SearchTrackers(self.cfg.report_to, folder.path, folder.identity)
        try:
            return _run_study(self.cfg, self.objective, self.storage, folder.experiment, trackers, self.progress)
        finally:
            trackers.close()

    def finish(self, folder: RunFolder, study) -> dict:
        with storage_errors(self.storage):
            study.set_user_attr("vanilla_ppl_train", self.objective.vanilla_ppl_train)
            study.set_user_attr("train_length", self.objective.train_length)
            return write_outputs(self.cfg, study, folder.path)


def _run_study(cfg: SearchConfig, objective, storage: str, experiment: str, trackers: SearchTrackers,
               progress: bool):
    """The study's trials (each reported to ``trackers`` and, with ``progress``, printed); the study."""

    def evaluate(sampled: dict) -> Outcome:
        params, m = objective(sampled)
        return Outcome(m.objective, m.constraint, attrs={"spec": params, **m.row()})

    def report(trial, index: int) -> None:
        a = trial.user_attrs
        if INVALID not in a and FAILED not in a:
            trackers.log(index, trial_numbers(a, trial.params))
        if not progress:
            return
        if INVALID in a or FAILED in a:
            what = f"refused ({a[INVALID]})" if INVALID in a else f"failed ({a[FAILED]})"
            print(f"trial {index:>4}: {what}", flush=True)
            return
        ppl = ", ".join(f"{k} {v:.2f}" for k, v in a.items() if k.startswith("ppl@"))
        print(f"trial {index:>4}: J {a['objective']:.4f} ({ppl}; PPL@T {a['ppl_train']:.2f}, "
              f"c {a['constraint']:+.3f}) {a['seconds']:.1f}s  {json.dumps(trial.params)}", flush=True)

    return run_study(cfg.space(), evaluate, storage=storage, study_name=experiment, method=cfg.method,
                     seed=cfg.seed, budget=cfg.budget, report=report)


def write_outputs(cfg: SearchConfig, study, output: Path) -> dict:
    """``trials.csv``, ``results.md``, ``search.png`` (and ``pareto.png`` with the retrieval
    term), then ``best.json``, from the study; each file replaced atomically. ``SearchFailed``
    (one line; ``trials.csv`` written) when no trial is complete."""
    rows = _rows(study)
    best, feasible = best_trial(study)
    if best is None:
        write_csv(rows, output / TRIALS)
        raise SearchFailed(_no_trial(cfg, rows, output / TRIALS))
    params = best.user_attrs["spec"]
    index = trial_index(study.get_trials(deepcopy=False))
    result = {"strategy": cfg.strategy, "params": params, "spec": spec_string(cfg.strategy, params),
              "objective": best.user_attrs["objective"], "feasible": feasible, "trial": index[best.number],
              "ppl": {k[4:]: v for k, v in best.user_attrs.items() if k.startswith("ppl@")},
              "ppl_train": best.user_attrs["ppl_train"], "evaluations": _evaluations(study)}
    write_csv(rows, output / TRIALS)
    front = plot_pareto(rows, output / PARETO, cfg, result["trial"]) if cfg.retrieval_weight > 0 else None
    write_text(output / REPORT, _markdown(cfg, study, result, rows, front))
    plot_objective(rows, output / PLOT, cfg)
    write_text(output / BEST, json.dumps(result, indent=1) + "\n")  # last: it marks the search done
    return result


def _no_trial(cfg: SearchConfig, rows: list[dict], table: Path) -> str:
    """The one line of a search none of whose trials could be used."""
    refused = [r for r in rows if r["state"] == "refused"]
    failed = [r for r in rows if r["state"] == "failed"]
    parts = []
    if failed:
        parts.append(f"{len(failed)} measured a non-finite objective (first: {failed[0]['failed']})")
    if refused:
        parts.append(f"{len(refused)} refused by {cfg.strategy} (first: {refused[0]['invalid']})")
    advice = ("narrow the ranges under search: or change fixed:" if refused and not failed
              else "check the model in float32 (dtype), the lengths and the ranges under search:")
    return f"no usable trial in {len(rows)}: " + "; ".join(parts) + f"; see {table}; {advice}"


def _evaluations(study) -> int:
    states = optuna().trial.TrialState
    return len(study.get_trials(deepcopy=False, states=(states.COMPLETE,)))


def _rows(study) -> list[dict]:
    """One row per finished trial, numbered by its index (``trial_index``: killed and redone trials
    are not rows); state ``complete``, ``refused`` (by the strategy) or ``failed`` (non-finite)."""
    states = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    index = trial_index(trials)
    rows = []
    for t in trials:
        if t.state not in (states.COMPLETE, states.PRUNED):
            continue
        a = t.user_attrs
        state = "complete" if t.state == states.COMPLETE else "refused" if INVALID in a else "failed"
        row = {"trial": index[t.number], "state": state, **t.params}
        row.update({k: a.get(k) for k in ("objective", "constraint")})
        row["feasible"] = None if a.get("constraint") is None else a["constraint"] <= 0
        row.update({k: v for k, v in a.items() if k.startswith(("ppl@", "nll@"))})
        row.update({k: a.get(k) for k in ("ppl_train", "retrieval_nll", "seconds", INVALID, FAILED)})
        if a.get("kl_train") is not None:  # the KL constraint's measure, when the search has one
            row["kl_train"] = a["kl_train"]
        if a.get("needle_nll") is not None:  # LongRoPE2's needle term, when the search has it
            row["needle_nll"] = a["needle_nll"]
        if a.get("parity") is not None:  # an engine outside this process: the first window's |Δ mean NLL|
            row["parity"] = a["parity"]
        rows.append(row)
    return rows


def _markdown(cfg: SearchConfig, study, best: dict, rows: list[dict], front: list[int] | None = None) -> str:
    attrs = study.user_attrs
    train = attrs.get("train_length", cfg.original_max_position_embeddings)
    lengths = ", ".join(f"{L} (weight {w:.2g})" for L, w in zip(cfg.lengths, cfg.weights()))
    lines = [
        f"# Parameter search: {cfg.strategy} on {cfg.model}", "",
        f"- model: `{cfg.model}`; search data: `{cfg.data.spec().describe()}` ({cfg.max_windows} windows "
        f"per length, evenly spaced over the split); held-out data kept out: "
        f"`{cfg.heldout.spec().describe() if cfg.heldout else '—'}`",
        f"- method: {cfg.method}, seed {cfg.seed}, budget {cfg.budget} trials; {best['evaluations']} candidates "
        "evaluated",
        f"- target lengths: {lengths}; training window T = {train}",
        "- objective J = Σ w_L · mean NLL_L [nats/token]"
        + (f" + {cfg.retrieval_weight:g} × passkey answer NLL" if cfg.retrieval_weight else "")
        + (f" + {cfg.needle_weight:g} × needle answer NLL" if cfg.needle_weight else "")
        + "".join(f" + {t.weight:g} × {t.task} gold answer NLL ({t.trials} examples)" for t in cfg.tasks),
        f"- constraint: PPL at T ≤ (1 + {cfg.epsilon:g}) × vanilla's"
        + (f" ({attrs['vanilla_ppl_train']:.3f})" if "vanilla_ppl_train" in attrs else "")
        + (f"; KL(unpatched ‖ candidate) at T ≤ {cfg.max_kl:g} nats/token" if cfg.max_kl is not None else ""),
        f"- fixed: {json.dumps(cfg.fixed)}", "",
        f"**Best** (trial {best['trial']}{'' if best['feasible'] else ', no feasible trial'}): `{best['spec']}` — "
        f"J {best['objective']:.4f}, PPL " + ", ".join(f"@{k} {v:.3f}" for k, v in best["ppl"].items())
        + f", PPL@T {best['ppl_train']:.3f}", "",
    ]
    if front is not None:
        lines += [f"Pareto front of (perplexity term, passkey answer NLL), both minimised ({PARETO}): trials "
                  + ", ".join(map(str, front)), ""]
    columns = list(dict.fromkeys(k for r in rows for k in r if k not in (INVALID, FAILED)))
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"

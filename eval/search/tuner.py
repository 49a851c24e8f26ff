"""The general tuner: an Optuna study over a ``search_space``, resumable and shareable.

The study lives in an RDB storage (``sqlite:///OUTPUT/study.db``): every finished trial is
committed as it ends, so a killed search loses at most the trial in progress, and several
processes pointed at one storage evaluate candidates at once. Trials are driven by Optuna's
ask/tell interface:

- **Budget over resumes**: the loop stops when the study holds ``budget`` finished trials
  (complete, or pruned because the strategy refused the combination, e.g. yarn's
  beta_fast ≤ beta_slow), however many runs it took.
- **Deterministic resume**: each trial's sampler is seeded with (``seed``, the trial's index — for
  TPE its number less the failed trials before it, for CMA-ES the finished + running trials), so
  with one process a search stopped after k trials and resumed proposes exactly what an
  uninterrupted one does (TPE and CMA-ES are functions of the history and their seed; CMA-ES keeps
  its own state in the trials). A trial left running by a killed process of this machine is marked
  failed on resume and its candidate proposed again.
- **Several processes** (TPE): trial numbers are unique, so no two processes draw with one seed;
  TPE's constant liar counts the others' running trials. The trials then depend on timing, not
  only on the seed. CMA-ES processes that ask at the same moment may draw the same candidate.
- **Constraint** c ≤ 0 (``eval.search.objective``): TPE takes it as an Optuna constraint
  (``Trial.set_constraint``, or ``constraints_func`` before Optuna 5: feasibility-aware TPE;
  c is also kept in the trial's user attrs); CMA-ES has no
  constraint support, so it minimises J + ``PENALTY`` · max(0, c) instead. The best trial is the
  feasible one with the lowest J, either way (the lowest J overall, flagged, when none is feasible).

Optuna: Akiba et al., KDD 2019, arXiv:1907.10902; TPE: Bergstra et al., NeurIPS 2011; CMA-ES:
Hansen 2016, arXiv:1604.00772 (the ``cmaes`` package).
"""

from __future__ import annotations

import hashlib
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from ropescale.runs.config import ConfigError

from .space import Dimension

__all__ = ["PENALTY", "Outcome", "best_trial", "finished", "optuna", "run_study"]

PENALTY = 10.0  # CMA-ES: nats of objective per unit of relative PPL excess at T (c)
WORKER = "worker"  # user attr: host:pid of the process evaluating a trial


def optuna():
    """The ``optuna`` module, or a one-line ``ConfigError`` saying how to install it."""
    try:
        import optuna as module
    except ImportError:
        raise ConfigError("search needs Optuna: pip install 'ropescale[search]' (optuna>=4)") from None
    module.logging.set_verbosity(module.logging.WARNING)
    return module


@dataclass
class Outcome:
    """What evaluating one candidate gives: the objective J (minimised), the constraint c (≤ 0
    feasible; None: unconstrained) and attributes stored with the trial (JSON-able)."""

    value: float
    constraint: float | None = None
    attrs: dict = field(default_factory=dict)


def _constraints(trial) -> tuple[float, ...]:
    c = trial.user_attrs.get("constraint")
    return () if c is None else (c,)


def _trial_constraints() -> bool:
    """Whether this Optuna stores constraints on the trial (``Trial.set_constraint``, ≥ 5)."""
    return hasattr(optuna().trial.Trial, "set_constraint")


def _seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:4], "little")


def _sampler(method: str, seed: int):
    opt = optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opt.exceptions.ExperimentalWarning)  # constraints_func is "experimental"
        if method == "tpe":
            if _trial_constraints():  # Optuna ≥ 5: TPE reads Trial.set_constraint
                return opt.samplers.TPESampler(seed=seed)
            return opt.samplers.TPESampler(seed=seed, constraints_func=_constraints)
        if method == "cmaes":
            try:
                import cmaes  # noqa: F401 — Optuna's CmaEsSampler needs it
            except ImportError:
                raise ConfigError("method: cmaes needs the cmaes package: pip install cmaes") from None
            return opt.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    raise ConfigError(f"method: {method!r} is not an Optuna sampler here; use tpe or cmaes")


def finished(study) -> list:
    """The study's finished trials (complete or pruned), in trial order."""
    states = optuna().trial.TrialState
    return [t for t in study.get_trials(deepcopy=False) if t.state in (states.COMPLETE, states.PRUNED)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail_stale(study) -> int:
    """Mark trials left running by dead processes of this host as failed; their number."""
    states, host, n = optuna().trial.TrialState, socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(states.RUNNING,)):
        worker = str(t.user_attrs.get(WORKER, ""))
        who, _, pid = worker.rpartition(":")
        if who == host and pid.isdigit() and not _alive(int(pid)):
            study.tell(t.number, state=states.FAIL)
            n += 1
    return n


def _distribution(dim: Dimension):
    d = optuna().distributions
    if dim.kind == "int":
        return d.IntDistribution(int(dim.low), int(dim.high), log=dim.log)
    return d.FloatDistribution(dim.low, dim.high, log=dim.log)


def _suggest(trial, dim: Dimension):
    if dim.kind == "int":
        return trial.suggest_int(dim.name, int(dim.low), int(dim.high), log=dim.log)
    return trial.suggest_float(dim.name, dim.low, dim.high, log=dim.log)


def best_trial(study):
    """``(trial, feasible)``: the complete trial with the lowest objective among feasible ones
    (user attr ``constraint`` ≤ 0 or absent), else among all; ``(None, False)`` when none is complete."""
    states = optuna().trial.TrialState
    done = [t for t in study.get_trials(deepcopy=False, states=(states.COMPLETE,))]
    if not done:
        return None, False
    key = lambda t: (t.user_attrs.get("objective", t.value), t.number)
    ok = [t for t in done if (t.user_attrs.get("constraint") or 0.0) <= 0]
    return (min(ok, key=key), True) if ok else (min(done, key=key), False)


def run_study(space: list[Dimension], evaluate: Callable[[dict], Outcome], *, storage: str, study_name: str,
              method: str = "tpe", seed: int = 0, budget: int, report: Callable[[object], None] | None = None):
    """Run (or resume) the study until it holds ``budget`` finished trials; returns it.

    ``evaluate(sampled)`` gets ``{name: value}`` for the dimensions of ``space`` and returns an
    ``Outcome``; a ``ValueError`` from it (the strategy refuses the combination) prunes the trial
    with the message as user attr ``invalid``. ``report(trial)`` is called after each trial this
    process finishes. ``storage``: an Optuna storage URL (``sqlite:///path/study.db``).
    """
    opt = optuna()
    if budget < 1:
        raise ConfigError(f"budget={budget}: a search needs at least 1 trial")
    study = opt.create_study(storage=storage, study_name=study_name, direction="minimize", load_if_exists=True)
    _fail_stale(study)
    dists = {d.name: _distribution(d) for d in space}
    states = opt.trial.TrialState
    while True:
        running = study.get_trials(deepcopy=False, states=(states.RUNNING,))
        done = len(finished(study))
        if done + len(running) >= budget:
            break
        if method == "tpe":
            # TPE samples each parameter when it is suggested: seed by the trial's own number (less the
            # failed trials before it), unique even when processes ask at the same moment
            trial = study.ask()
            failed = sum(t.number < trial.number for t in study.get_trials(deepcopy=False, states=(states.FAIL,)))
            study.sampler = _sampler(method, _seed(seed, trial.number - failed))
            sampled = {d.name: _suggest(trial, d) for d in space}
        else:  # CMA-ES samples all parameters at ask
            study.sampler = _sampler(method, _seed(seed, done + len(running)))
            trial = study.ask(dists)
            sampled = {name: trial.params[name] for name in dists}
        trial.set_user_attr(WORKER, f"{socket.gethostname()}:{os.getpid()}")
        try:
            out = evaluate(sampled)
        except ValueError as e:
            trial.set_user_attr("invalid", str(e))
            frozen = study.tell(trial, state=states.PRUNED)
        else:
            for k, v in out.attrs.items():
                trial.set_user_attr(k, v)
            trial.set_user_attr("objective", out.value)
            value = out.value
            if out.constraint is not None:
                trial.set_user_attr("constraint", out.constraint)
                if method == "tpe" and _trial_constraints():
                    trial.set_constraint("ppl_at_T", out.constraint)
                if method == "cmaes":
                    value += PENALTY * max(0.0, out.constraint)
            frozen = study.tell(trial, value)
        if report:
            report(frozen)
    return study

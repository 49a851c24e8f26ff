"""The general tuner: an Optuna study over a ``search_space``, resumable and shareable.

The study lives in an RDB storage (``sqlite:///OUTPUT/study.db``): every finished trial is
committed as it ends, so a killed search loses at most the trial in progress, and several
processes pointed at one storage evaluate candidates at once. Trials are driven by Optuna's
ask/tell interface:

- **Budget over resumes**: the loop stops when the study holds ``budget`` finished trials,
  however many runs it took. Finished: complete, or pruned — because the strategy refused the
  candidate (``Refused``, e.g. yarn's beta_fast ≤ beta_slow; user attr ``invalid``) or because
  its objective or constraint was not a finite number (user attr ``failed``; never the best).
- **Kill -9 at any point, then resume = the uninterrupted search**: creating the storage, failing
  stale trials and asking for a trial (with its worker tag ``host:pid``) happen under a file lock
  beside the database (``study.db.lock``, released by the OS when its holder dies). So a trial
  still running without a tag, seen under the lock, was asked by a process killed before it
  tagged it, and one tagged by a dead process of this host was killed later (during its objective
  or before ``tell``): both are marked failed (``TrialState.FAIL``) and their candidate proposed
  again. Each trial's sampler is seeded with (``seed``, the trial's *index*: its number less the
  failed trials before it), and CMA-ES's own per-trial reseed (Optuna adds the trial number) is
  given that index too, so a search killed anywhere and resumed proposes and scores exactly what
  an uninterrupted one does (TPE and CMA-ES are functions of the finished trials and their seed;
  CMA-ES keeps its state in the complete trials, which a failed trial never is). The index is what
  reports call a trial's number (``trial_index``).
- **Several processes** (TPE): indices are unique, so no two processes draw with one seed; TPE's
  constant liar counts the others' running trials. The trials then depend on
  timing, not only on the seed. CMA-ES processes draw from one distribution per generation and may
  propose near-identical candidates.
- **Constraint** c ≤ 0 (``eval.search.objective``): TPE takes it as an Optuna constraint
  (``Trial.set_constraint``, or ``constraints_func`` before Optuna 5: feasibility-aware TPE;
  c is also kept in the trial's user attrs); CMA-ES has no
  constraint support, so it minimises J + ``PENALTY`` · max(0, c) instead. The best trial is the
  feasible one with the lowest J, either way (the lowest J overall, flagged, when none is feasible).
- **A damaged or full storage** (cut or random bytes in ``study.db``, a full disk): ``StudyError``,
  one line naming the file and what to do, instead of SQLAlchemy's traceback.

Optuna: Akiba et al., KDD 2019, arXiv:1907.10902; TPE: Bergstra et al., NeurIPS 2011; CMA-ES:
Hansen 2016, arXiv:1604.00772 (the ``cmaes`` package).
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import socket
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ropescale.errors import RopescaleError
from ropescale.runs.config import ConfigError

from .space import Dimension

__all__ = ["FAILED", "INVALID", "PENALTY", "Outcome", "Refused", "SearchFailed", "StudyError", "best_trial", "finished",
           "open_study", "optuna", "run_study", "trial_index"]

PENALTY = 10.0  # CMA-ES: nats of objective per unit of relative PPL excess at T (c)
WORKER = "worker"  # user attr: host:pid of the process evaluating a trial
INVALID = "invalid"  # user attr: why the strategy refused the candidate
FAILED = "failed"  # user attr: why the candidate's measurement is unusable (a non-finite objective)
SQLITE_TIMEOUT = 60.0  # seconds a process waits for another's write to SQLite before giving up


class Refused(RopescaleError):
    """Raised by an objective when the strategy refuses the candidate's parameters (yarn's
    beta_fast ≤ beta_slow): the trial is pruned with the message and the search goes on. Any other
    exception from the objective stops the search (a user error: one line; else a bug)."""


class StudyError(RopescaleError):
    """The study's storage cannot be read or written (a damaged file, a full disk)."""


class SearchFailed(RopescaleError):
    """No trial of the search could be used: each was refused by the strategy or measured a
    non-finite objective. Here, not in ``eval.search.run``, so that ``run`` and ``longrope`` (which
    ``run`` calls for method evolution) both raise it without importing each other."""


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


def _sampler(method: str, seed: int, index: int):
    opt = optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opt.exceptions.ExperimentalWarning)  # constraints_func is "experimental"
        if method == "tpe":
            # constant liar (Optuna 5's default, given for Optuna 4): other processes' running trials count
            if _trial_constraints():  # Optuna ≥ 5: TPE reads Trial.set_constraint
                return opt.samplers.TPESampler(seed=_seed(seed, index), constant_liar=True)
            return opt.samplers.TPESampler(seed=_seed(seed, index), constraints_func=_constraints, constant_liar=True)
        if method == "cmaes":
            try:
                import cmaes  # noqa: F401 — Optuna's CmaEsSampler needs it
            except ImportError:
                raise ConfigError("method: cmaes needs the cmaes package: pip install cmaes") from None

            class IndexedCmaEs(opt.samplers.CmaEsSampler):
                """Optuna's CMA-ES, reseeding its optimizer with the trial's index instead of its
                number (``sample_relative`` adds ``trial.number`` to the seed): a trial redone after
                a kill gets a new number but the index, hence the draw, of the trial it replaces."""

                def sample_relative(self, study, trial, search_space):
                    indexed = copy.copy(trial)  # shallow: the same storage id, another number
                    indexed.number = index
                    return super().sample_relative(study, indexed, search_space)

            return IndexedCmaEs(seed=_seed(seed, index), warn_independent_sampling=False)
    raise ConfigError(f"method: {method!r} is not an Optuna sampler here; use tpe or cmaes")


def finished(study) -> list:
    """The study's finished trials (complete or pruned), in trial order."""
    states = optuna().trial.TrialState
    return [t for t in study.get_trials(deepcopy=False) if t.state in (states.COMPLETE, states.PRUNED)]


def trial_index(trials: list) -> dict[int, int]:
    """``{trial number: index}`` for ``trials`` (all of a study's): a trial's number less the failed
    (killed, redone) trials before it — the position a trial has in an uninterrupted search."""
    states, out, failed = optuna().trial.TrialState, {}, 0
    for t in sorted(trials, key=lambda t: t.number):
        if t.state == states.FAIL:
            failed += 1
        else:
            out[t.number] = t.number - failed
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail_stale(study, *, locked: bool) -> int:
    """Mark as failed the running trials whose process is gone: tagged by a dead process of this
    host, or (``locked``: called under the study's lock, which an asking process holds until its
    trial is tagged) not tagged at all. Returns their number."""
    states, host, n = optuna().trial.TrialState, socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(states.RUNNING,)):
        worker = str(t.user_attrs.get(WORKER, ""))
        who, _, pid = worker.rpartition(":")
        if (not worker and locked) or (who == host and pid.isdigit() and not _alive(int(pid))):
            study.tell(t.number, state=states.FAIL)
            n += 1
    return n


def _distribution(dim: Dimension):
    d = optuna().distributions
    if dim.kind == "int":
        return d.IntDistribution(int(dim.low), int(dim.high), log=dim.log)
    return d.FloatDistribution(dim.low, dim.high, log=dim.log)


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


def _sqlite_file(storage: str) -> Path | None:
    prefix = "sqlite:///"
    return Path(storage[len(prefix):]) if storage.startswith(prefix) and len(storage) > len(prefix) else None


def _default_lock(storage: str) -> Path | None:
    db = _sqlite_file(storage)
    return None if db is None else db.with_name(db.name + ".lock")


@contextmanager
def storage_errors(storage: str) -> Iterator[None]:
    """SQLAlchemy's and Optuna's storage errors (a damaged ``study.db``, a full disk, another
    Optuna's schema) as one-line ``StudyError``s naming the file."""
    import sqlalchemy.exc

    where = _sqlite_file(storage) or storage
    try:
        yield
    except (sqlalchemy.exc.SQLAlchemyError, optuna().exceptions.StorageInternalError) as e:
        cause = e if isinstance(e, sqlalchemy.exc.SQLAlchemyError) else (e.__cause__ or e)
        reason = str(getattr(cause, "orig", None) or cause).splitlines()[0]
        if "full" in reason or "disk I/O" in reason:
            hint = ("free space (or use another output folder) and rerun the same command: the search resumes "
                    "from its finished trials")
        elif "not a database" in reason or "malformed" in reason or "corrupt" in reason:
            hint = "the file is damaged: move it away to start the search over, or use another output folder"
        else:
            hint = "move it away to start the search over, or use another output folder"
        raise StudyError(f"{where}: cannot use the search's study database ({reason}); {hint}") from None
    except RuntimeError as e:  # Optuna: a schema of another Optuna version
        if "optuna" not in str(e).lower() or "schema" not in str(e).lower():
            raise
        raise StudyError(f"{where}: {str(e).splitlines()[0]}") from None


@contextmanager
def _locked(lock: Path | None, wait: float = 600.0) -> Iterator[None]:
    if lock is None:
        yield
        return
    from filelock import FileLock, Timeout

    try:
        with FileLock(str(lock), timeout=wait):
            yield
    except Timeout:
        raise StudyError(f"{lock}: another search process has held the study's lock for {wait:g} s; "
                         "is one stuck? stop it, or use another output folder") from None


def open_study(storage: str, study_name: str, *, lock: Path | str | None = None):
    """The study ``study_name`` in ``storage``, created if absent (under ``lock``, default
    ``<study.db>.lock`` for SQLite: two processes starting on a fresh folder never both create
    its tables). Raises ``StudyError`` (one line) for a storage that cannot be used."""
    opt = optuna()
    lock = Path(lock) if lock is not None else _default_lock(storage)
    with storage_errors(storage), _locked(lock):
        kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT}} if _sqlite_file(storage) else {}
        rdb = opt.storages.RDBStorage(storage, engine_kwargs=kwargs)
        return opt.create_study(storage=rdb, study_name=study_name, direction="minimize", load_if_exists=True)


def run_study(space: list[Dimension], evaluate: Callable[[dict], Outcome], *, storage: str, study_name: str,
              method: str = "tpe", seed: int = 0, budget: int, report: Callable[[object, int], None] | None = None,
              lock: Path | str | None = None):
    """Run (or resume) the study until it holds ``budget`` finished trials; returns it.

    ``evaluate(sampled)`` gets ``{name: value}`` for the dimensions of ``space`` and returns an
    ``Outcome``; ``Refused`` from it (the strategy refuses the combination) prunes the trial with
    the message as user attr ``invalid``; a non-finite objective or constraint prunes it with user
    attr ``failed``; any other exception fails the trial (redone by the next run) and propagates.
    ``report(trial, index)`` is called after each trial this process finishes. ``storage``: an
    Optuna storage URL (``sqlite:///path/study.db``); ``lock``: the file lock guarding its creation
    and every ask (default ``<db>.lock`` for SQLite; other storages run without one, and then a
    trial whose process died before tagging it stays running). Raises ``StudyError`` (one line)
    for a storage that cannot be used.
    """
    opt = optuna()
    if budget < 1:
        raise ConfigError(f"budget={budget}: a search needs at least 1 trial")
    lock = Path(lock) if lock is not None else _default_lock(storage)
    study = open_study(storage, study_name, lock=lock)
    dists = {d.name: _distribution(d) for d in space}
    states = opt.trial.TrialState
    host_pid = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        with storage_errors(storage):
            with _locked(lock) if lock is not None else nullcontext():
                _fail_stale(study, locked=lock is not None)
                trials = study.get_trials(deepcopy=False)
                done = sum(t.state in (states.COMPLETE, states.PRUNED) for t in trials)
                running = sum(t.state == states.RUNNING for t in trials)
                if done + running >= budget:
                    break
                # the next trial's number is len(trials) (asks are serialised by the lock); its index
                # discounts the failed ones, so a redone trial draws with the seed of the one it replaces
                index = len(trials) - sum(t.state == states.FAIL for t in trials)
                study.sampler = _sampler(method, seed, index)
                trial = study.ask(dists)
                trial.set_user_attr(WORKER, host_pid)
            sampled = {name: trial.params[name] for name in dists}
        try:
            try:
                out = evaluate(sampled)
            except Refused as e:
                with storage_errors(storage):
                    trial.set_user_attr(INVALID, str(e))
                    frozen = study.tell(trial, state=states.PRUNED)
            else:
                with storage_errors(storage):
                    frozen = _tell(study, trial, out, method)
        except BaseException:  # the objective or the storage failed, or Ctrl-C: this trial is redone
            _abandon(study, trial)
            raise
        if report:
            report(frozen, index)
    return study


def _tell(study, trial, out: Outcome, method: str):
    """Store ``out`` with ``trial`` and finish it: complete, or pruned as failed when its objective or
    constraint is not a finite number (NaN, ±inf: no ranking can use it)."""
    states = optuna().trial.TrialState
    for k, v in out.attrs.items():
        trial.set_user_attr(k, v)
    value, c = float(out.value), out.constraint
    bad = [f"{name} is {v}" for name, v in (("objective", value), ("constraint", c))
           if v is not None and not math.isfinite(v)]
    if bad:
        trial.set_user_attr(FAILED, "; ".join(bad))
        return study.tell(trial, state=states.PRUNED)
    trial.set_user_attr("objective", value)
    if c is not None:
        trial.set_user_attr("constraint", c)
        if method == "tpe" and _trial_constraints():
            trial.set_constraint("ppl_at_T", c)
        if method == "cmaes":
            value += PENALTY * max(0.0, c)
    return study.tell(trial, value)


def _abandon(study, trial) -> None:
    """Fail ``trial`` after its objective or its ``tell`` raised (Ctrl-C, a user error, a full
    disk, a bug), so the next run redoes its candidate; a storage that cannot take even that leaves
    it running, and the next process fails it as its worker's (this process's) is gone."""
    with suppress(Exception):  # the original error is the one to show
        study.tell(trial, state=optuna().trial.TrialState.FAIL)

"""The tuner on synthetic objectives (no model): it finds a known optimum, honours the constraint,
counts the budget over resumes, and a killed-and-resumed search equals an uninterrupted one."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eval.search.space import Dimension
from eval.search.tuner import WORKER, Outcome, best_trial, finished, optuna, run_study
from ropescale.runs.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SPACE = [Dimension("x", "float", -5.0, 5.0), Dimension("n", "int", 1, 64, log=True)]


def bowl(p: dict) -> Outcome:
    """Minimum 0 at x = 1.3, n = 20 (hand-placed)."""
    return Outcome((p["x"] - 1.3) ** 2 + ((p["n"] - 20) / 10) ** 2)


def _url(tmp_path, name="study.db") -> str:
    return f"sqlite:///{tmp_path / name}"


@pytest.mark.parametrize("method", ["tpe", "cmaes"])
def test_finds_a_known_optimum(tmp_path, method):
    study = run_study(SPACE, bowl, storage=_url(tmp_path), study_name="s", method=method, seed=1, budget=80)
    best, feasible = best_trial(study)
    assert feasible
    assert abs(best.params["x"] - 1.3) < 0.3 and abs(best.params["n"] - 20) <= 4
    assert len(finished(study)) == 80


def test_the_best_trial_is_feasible(tmp_path):
    # minimum of x² at x = 0, but only x ≥ 1 is allowed (c = 1 − x ≤ 0): the best lies just above 1
    f = lambda p: Outcome(p["x"] ** 2, constraint=1.0 - p["x"])
    study = run_study(SPACE[:1], f, storage=_url(tmp_path), study_name="s", seed=0, budget=60)
    best, feasible = best_trial(study)
    assert feasible and 1.0 <= best.params["x"] < 1.5
    assert any(t.user_attrs["constraint"] > 0 for t in study.trials)  # infeasible ones were tried and skipped


def test_a_refused_combination_is_pruned_and_counts(tmp_path):
    def f(p):
        if p["x"] < 0:
            raise ValueError("x must not be negative")
        return bowl(p)

    study = run_study(SPACE, f, storage=_url(tmp_path), study_name="s", seed=0, budget=12)
    states = optuna().trial.TrialState
    pruned = [t for t in study.trials if t.state == states.PRUNED]
    assert pruned and all(t.user_attrs["invalid"] == "x must not be negative" for t in pruned)
    assert len(finished(study)) == 12


@pytest.mark.parametrize("method", ["tpe", "cmaes"])
def test_stopped_and_resumed_gives_the_uninterrupted_trials(tmp_path, method):
    whole = run_study(SPACE, bowl, storage=_url(tmp_path, "a.db"), study_name="s", method=method, seed=5,
                      budget=20)
    part = run_study(SPACE, bowl, storage=_url(tmp_path, "b.db"), study_name="s", method=method, seed=5, budget=7)
    assert len(part.trials) == 7
    again = run_study(SPACE, bowl, storage=_url(tmp_path, "b.db"), study_name="s", method=method, seed=5,
                      budget=20)
    assert [t.params for t in again.trials] == [t.params for t in whole.trials]
    assert [t.value for t in again.trials] == [t.value for t in whole.trials]
    # the budget counts over resumes: nothing is left to do
    calls = []
    run_study(SPACE, lambda p: calls.append(p) or bowl(p), storage=_url(tmp_path, "b.db"), study_name="s",
              method=method, seed=5, budget=20)
    assert calls == []


def test_a_trial_killed_mid_evaluation_is_failed_and_redone(tmp_path):
    whole = run_study(SPACE, bowl, storage=_url(tmp_path, "a.db"), study_name="s", seed=2, budget=12)
    url = _url(tmp_path, "b.db")
    run_study(SPACE, bowl, storage=url, study_name="s", seed=2, budget=5)
    # a process that asked for a trial and died before telling it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    study = optuna().load_study(study_name="s", storage=url)
    stale = study.ask({"x": optuna().distributions.FloatDistribution(-5, 5)})
    stale.set_user_attr(WORKER, f"{socket.gethostname()}:{int(dead.stdout)}")
    again = run_study(SPACE, bowl, storage=url, study_name="s", seed=2, budget=12)
    states = optuna().trial.TrialState
    assert again.trials[5].state == states.FAIL
    done = [t for t in again.trials if t.state == states.COMPLETE]
    assert [t.params for t in done] == [t.params for t in whole.trials]


def test_a_trial_of_a_live_process_is_left_running(tmp_path):
    url = _url(tmp_path)
    run_study(SPACE, bowl, storage=url, study_name="s", seed=0, budget=2)
    study = optuna().load_study(study_name="s", storage=url)
    busy = study.ask({"x": optuna().distributions.FloatDistribution(-5, 5)})
    import os

    busy.set_user_attr(WORKER, f"{socket.gethostname()}:{os.getpid()}")
    again = run_study(SPACE, bowl, storage=url, study_name="s", seed=0, budget=4)
    assert again.trials[2].state == optuna().trial.TrialState.RUNNING  # another process's: not touched
    assert len(finished(again)) == 3  # budget 4 counts the running one


def test_budget_below_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="at least 1 trial"):
        run_study(SPACE, bowl, storage=_url(tmp_path), study_name="s", budget=0)


def test_two_processes_share_one_study(tmp_path):
    url = _url(tmp_path)
    optuna().create_study(storage=url, study_name="s", direction="minimize")  # created once, before both start
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from tests.eval.search.test_tuner import SPACE, bowl\n"
            "from eval.search.tuner import run_study\n"
            f"run_study(SPACE, bowl, storage={url!r}, study_name='s', seed=0, budget=16)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    study = optuna().load_study(study_name="s", storage=url)
    done = finished(study)
    # each process stops when the study holds the budget; at most one trial over it per extra process
    assert 16 <= len(done) <= 17
    workers = {t.user_attrs[WORKER] for t in done}
    assert len(workers) == 2  # both evaluated candidates
    assert len({tuple(sorted(t.params.items())) for t in done}) == len(done)  # no candidate twice

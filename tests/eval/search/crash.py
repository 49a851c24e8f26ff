"""The subject of the kill -9 and two-process tests: a search run in this process that SIGKILLs
itself at a chosen point, or meets a second process at the storage's creation.

    python -m tests.eval.search.crash [--kill POINT:N] [--barrier DIR] cli ARG...
    python -m tests.eval.search.crash [--kill POINT:N] [--barrier DIR] tuner URL METHOD SEED BUDGET

``cli``: ``cli.main(ARG...)`` (``ropescale search CONFIG -o DIR``); ``tuner``: ``run_study`` on
``SPACE`` / ``bowl`` (no model). Kill points (N: the N-th such event of this process, from 1):

- ``ask``: right after Optuna's ``Study.ask`` returns (the trial exists, its worker tag not yet);
- ``param``: right after a sampled parameter is stored (in the middle of an ask);
- ``objective``: after a trial's objective, before Optuna's ``tell`` (the trial is still running);
- ``commit``: inside an SQLAlchemy commit, its statements sent, before the commit (a write half done);
- ``tell``: right after ``tell`` returns (the trial is finished, nothing else yet);
- ``write``: while ``trials.csv`` is being written (its rows given to the writer, the file not closed);
- ``manifest``: while ``manifest.json`` is being written (half its text written, the file not closed).

``--barrier DIR [--parties K]``: before the storage is opened, wait until K
processes (default 2) have reached this point, so all open a fresh ``study.db`` at the same moment
(a process that waits for the others longer than 2 s goes on: behind a lock they cannot come).
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import sys
import time
from pathlib import Path

from eval.search.space import Dimension
from eval.search.tuner import Outcome

SPACE = [Dimension("x", "float", -5.0, 5.0), Dimension("n", "int", 1, 64, log=True)]


def bowl(p: dict) -> Outcome:
    """Minimum 0 at x = 1.3, n = 20 (hand-placed)."""
    return Outcome((p["x"] - 1.3) ** 2 + ((p["n"] - 20) / 10) ** 2)


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _counting(n: int):
    seen = [0]

    def hit() -> bool:
        seen[0] += 1
        return seen[0] == n

    return hit


def _wrap(owner, name: str, hit, *, before: bool = False) -> None:
    """``owner.name`` replaced by a method that dies on the counted call: before the original runs
    (``before``) or right after it returns."""
    real = getattr(owner, name)

    def patched(self, *a, **k):
        if before and hit():
            _die()
        out = real(self, *a, **k)
        if not before and hit():
            _die()
        return out

    setattr(owner, name, patched)


def _kill_in_commit(hit) -> None:
    """Die inside an SQLAlchemy commit: its statements sent (a write transaction open), not committed."""
    import sqlalchemy.orm

    commit = sqlalchemy.orm.Session.commit

    def patched(self):
        if hit():
            self.flush()  # the statements reach SQLite: a write transaction is open
            _die()
        return commit(self)

    sqlalchemy.orm.Session.commit = patched


def _kill_in_manifest(hit) -> None:
    """Die with half of ``manifest.json``'s text written, the file not closed."""
    write_text = Path.write_text

    def patched(self, data, *a, **k):
        if "manifest" in self.name and hit():
            with self.open("w", encoding="utf-8") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                _die()
        return write_text(self, data, *a, **k)

    Path.write_text = patched


def _kill_points():
    """``{point: install(hit)}`` for every kill point of the module docstring."""
    import optuna

    return {
        "ask": lambda hit: _wrap(optuna.study.Study, "ask", hit),
        # what the cached storage calls to store a sampled parameter
        "param": lambda hit: _wrap(optuna.storages.RDBStorage, "_set_trial_param", hit),
        "objective": lambda hit: _wrap(optuna.study.Study, "tell", hit, before=True),
        "tell": lambda hit: _wrap(optuna.study.Study, "tell", hit),
        "commit": _kill_in_commit,
        "write": lambda hit: _wrap(csv.DictWriter, "writerows", hit),
        "manifest": _kill_in_manifest,
    }


def install_kill(point: str, n: int) -> None:
    """SIGKILL this process at the ``n``-th event of kill ``point``."""
    points = _kill_points()
    if point not in points:
        raise SystemExit(f"unknown kill point {point!r}")
    points[point](_counting(n))


def install_barrier(folder: Path, parties: int = 2, wait: float = 2.0) -> None:
    import optuna

    init = optuna.storages.RDBStorage.__init__
    done = [False]

    def patched(self, *a, **k):
        if not done[0]:
            done[0] = True
            folder.mkdir(parents=True, exist_ok=True)
            (folder / str(os.getpid())).touch()
            end = time.monotonic() + wait
            while len(list(folder.iterdir())) < parties and time.monotonic() < end:
                time.sleep(0.005)
        init(self, *a, **k)

    optuna.storages.RDBStorage.__init__ = patched


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill")
    parser.add_argument("--barrier")
    parser.add_argument("--parties", type=int, default=2)
    parser.add_argument("mode", choices=["cli", "tuner"])
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.kill:
        point, _, n = args.kill.partition(":")
        install_kill(point, int(n or 1))
    if args.barrier:
        install_barrier(Path(args.barrier), args.parties)
    if args.mode == "cli":
        from cli import main as cli

        cli(args.rest, standalone_mode=True)
    else:
        from eval.search.tuner import run_study

        url, method, seed, budget = args.rest
        run_study(SPACE, bowl, storage=url, study_name="s", method=method, seed=int(seed), budget=int(budget))


if __name__ == "__main__":
    main(sys.argv[1:])

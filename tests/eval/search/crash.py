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


def install_kill(point: str, n: int) -> None:
    import optuna
    import sqlalchemy.orm

    hit = _counting(n)
    if point == "ask":
        ask = optuna.study.Study.ask

        def patched(self, *a, **k):
            trial = ask(self, *a, **k)
            if hit():
                _die()
            return trial

        optuna.study.Study.ask = patched
    elif point == "param":
        store = optuna.storages.RDBStorage._set_trial_param  # what the cached storage calls

        def patched(self, *a, **k):
            store(self, *a, **k)
            if hit():
                _die()

        optuna.storages.RDBStorage._set_trial_param = patched
    elif point in ("objective", "tell"):
        tell = optuna.study.Study.tell

        def patched(self, *a, **k):
            if point == "objective" and hit():
                _die()
            out = tell(self, *a, **k)
            if point == "tell" and hit():
                _die()
            return out

        optuna.study.Study.tell = patched
    elif point == "commit":
        commit = sqlalchemy.orm.Session.commit

        def patched(self):
            if hit():
                self.flush()  # the statements reach SQLite: a write transaction is open
                _die()
            return commit(self)

        sqlalchemy.orm.Session.commit = patched
    elif point == "write":
        writerows = csv.DictWriter.writerows

        def patched(self, rows):
            writerows(self, rows)
            if hit():
                _die()

        csv.DictWriter.writerows = patched
    elif point == "manifest":
        write_text = Path.write_text

        def patched(self, data, *a, **k):
            if "manifest" in self.name and hit():
                with self.open("w", encoding="utf-8") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    _die()
            return write_text(self, data, *a, **k)

        Path.write_text = patched
    else:
        raise SystemExit(f"unknown kill point {point!r}")


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

"""The real engines as subprocesses: find an engine's own Python, run one of its scripts, read its answer.

The engines live in their own virtual environments (vLLM pins its own torch and transformers; llama-cpp-python
compiles llama.cpp; mlx-lm): they are never dependencies of ropescale, and nothing here imports them.
``bench/engines/install.sh`` makes the environments. An engine that runs so declares its ``Environment`` in its
harness package (``eval/engines/<engine>/__init__.py``: the variable naming its Python, its folder under the
engines' root, its scripts folder and default script); its parity driver and scoring engine carry it, so the
harness registry (``eval.engines.registry``) finds it by the engine's name. The scripts (``scripts/*.py`` of the
engine's package: package data, never imported, never importing ropescale) run as
``PYTHON SCRIPT REQUEST.json RESULT.json``.

Where an engine's Python is looked for (the first that exists): its ``variable`` (``ROPESCALE_VLLM_PYTHON`` …:
a python executable); ``<root>/<venv>/bin/python`` under ``ROPESCALE_ENGINES``, then
``~/.cache/ropescale/engines`` (install.sh's default prefix).

Errors: ``EngineAbsent`` (one line naming the variable to set and the install script) when an engine is not
installed; ``EngineFailed`` (one line: the script's last error line, the log kept in a file) when a script exits
non-zero, or leaves a result that is not a JSON object (torn: the file kept and named).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ropescale.errors import RopescaleError

__all__ = ["INSTALL", "EngineAbsent", "EngineFailed", "Environment", "engine_python", "engine_roots",
           "engine_status", "environment", "require_engine", "run_engine"]

INSTALL = "bench/engines/install.sh"


class EngineAbsent(RopescaleError, LookupError):
    """The engine's environment is not installed (or its variable names no executable)."""


class EngineFailed(RopescaleError, RuntimeError):
    """An engine's script exited with an error; the message is its last error line."""


def engine_roots() -> list[Path]:
    """Where the engines' environments are looked for: ``ROPESCALE_ENGINES``, then ``~/.cache/ropescale/engines``."""
    roots = [os.environ.get("ROPESCALE_ENGINES"), str(Path.home() / ".cache" / "ropescale" / "engines")]
    return [Path(r) for r in roots if r]


@dataclass(frozen=True)
class Environment:
    """An engine's own Python environment and the scripts run in it.

    engine: the engine's name; variable: the environment variable naming its Python; venv: its folder under the
    engines' root; scripts: the folder of its scripts; script: the script run unless another is named (its file
    name in ``scripts``).
    """

    engine: str
    variable: str
    venv: str
    scripts: Path
    script: str

    @property
    def label(self) -> str:
        """How messages name the engine: its library engine's label (``"vLLM"``)."""
        from ropescale.serving.engines import get_engine

        return get_engine(self.engine).label

    def python(self) -> Path | None:
        """The Python executable of the environment, or None when it is not installed (a variable set to a
        missing file counts as absent)."""
        given = os.environ.get(self.variable)
        if given:
            return Path(given) if Path(given).is_file() else None
        for root in engine_roots():
            p = root / self.venv / "bin" / "python"
            if p.is_file():
                return p
        return None

    def status(self) -> str:
        """One line: where the engine runs from, or why it is absent and how to install it."""
        py = self.python()
        if py is not None:
            return f"{self.label}: {py}"
        given = os.environ.get(self.variable)
        why = f"{self.variable}={given} is not a file" if given else \
            f"no {self.venv}/bin/python under {', '.join(str(r) for r in engine_roots())} and {self.variable} unset"
        return (f"{self.label} is not installed ({why}); install it with {INSTALL} "
                f"or set {self.variable} to its environment's python")

    def require(self) -> Path:
        """``python()``, or ``EngineAbsent`` with ``status``'s one line."""
        py = self.python()
        if py is None:
            raise EngineAbsent(self.status())
        return py


def environment(engine: str) -> Environment:
    """The ``Environment`` of ``engine`` (its harness package's); ``EngineAbsent`` (one line) for an engine that
    runs no subprocess."""
    from .registry import environments

    known = environments()
    if engine not in known:
        raise EngineAbsent(f"unknown engine {engine!r}; known: {', '.join(sorted(known))}")
    return known[engine]


def engine_python(engine: str) -> Path | None:
    """The Python executable of ``engine``'s environment, or None when it is not installed."""
    return environment(engine).python()


def engine_status(engine: str) -> str:
    """One line: where ``engine`` runs from, or why it is absent and how to install it."""
    return environment(engine).status()


def require_engine(engine: str) -> Path:
    """``engine_python(engine)``, or ``EngineAbsent`` with ``engine_status``'s one line."""
    return environment(engine).require()


def _last_error(log: str) -> str:
    """The line of a driver's log that says what went wrong: the first ``...Error: ...`` line that
    is not a wrapper pointing elsewhere (vLLM's EngineDeadError says "see the stack trace above"),
    else the last error line, else the last line."""
    import re

    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\w*(Error|Exception): ", ln)]
    causes = [ln for ln in errors if not re.search(r"stack trace|root cause|EngineDeadError|encountered", ln)]
    pick = (causes or errors or lines or ["no output"])[0 if causes else -1]
    return re.sub(r"^\(\w+ pid=\d+\) ERROR [\d:\- ]+\[[^\]]+\] ", "", pick)[:400]


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill every process left in the driver's session (its own, if it still runs, and its children)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_engine(engine: str, request: dict[str, Any], *, script: str | None = None, timeout: float = 1800,
               log_dir: str | Path | None = None, quiet: bool = True) -> dict[str, Any]:
    """Run ``engine``'s script (its ``Environment.script``, or ``script``: another of its scripts folder, or a
    path) on ``request`` (a JSON-able dict with its ``mode``) in the engine's own Python and return the script's
    JSON result, plus ``"seconds"`` (wall time of the subprocess).

    The engine's chatter goes to ``log_dir/<engine>-<mode>.log`` (a temporary file when None), or
    to this process's stderr when ``quiet`` is False. ``timeout`` [s]. Raises ``EngineAbsent`` and
    ``EngineFailed`` (one line each)."""
    spec = environment(engine)
    py = require_engine(engine)
    driver = spec.scripts / (script or spec.script)
    with tempfile.TemporaryDirectory(prefix="ropescale-engine-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        log_path = Path(log_dir or tmp) / f"{spec.venv}-{request.get('mode', 'run')}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # the engine's environment, not ours
        start = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            # a session of its own: the driver's children (vLLM's engine-core and worker processes, which
            # outlive a driver that leaves by os._exit) are killed with it when it ends
            proc = subprocess.Popen([str(py), str(driver), str(req), str(res)], env=env,
                                    stdout=log if quiet else sys.stderr, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"{spec.label} driver ran past {timeout:g} s "
                                   f"(log: {log_path})") from None
            finally:
                _kill_session(proc)
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not res.is_file():
            text = log_path.read_text(encoding="utf-8", errors="replace") if quiet else ""
            kept = log_path
            if log_dir is None:  # keep the log past the temporary folder
                kept = Path(tempfile.mkstemp(prefix=f"ropescale-{spec.venv}-", suffix=".log")[1])
                kept.write_text(text, encoding="utf-8")
            raise EngineFailed(f"{spec.label} driver failed (exit {proc.returncode}): "
                               f"{_last_error(text)} (log: {kept})")
        try:
            out = json.loads(res.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:  # torn (the driver killed mid-write, a full disk) or not JSON
            out, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            why = None if isinstance(out, dict) else f"a JSON {type(out).__name__}, not an object"
        if why is not None:  # the temporary folder goes: keep what the driver wrote (and its log)
            keep = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="ropescale-engine-"))
            kept = keep / f"{log_path.stem}.result.json"
            shutil.copyfile(res, kept)
            if log_dir is None:
                log_path = Path(shutil.copy(log_path, keep))
            raise EngineFailed(f"{spec.label} driver {driver.name} left an unreadable result "
                               f"({why}): {kept} (log: {log_path})")
    out["seconds"] = seconds
    return out

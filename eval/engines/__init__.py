"""Serving engines on the harness side: their drivers for ``ropescale parity``, and the real engines
(vLLM, llama.cpp) as subprocesses — find their Python, run a driver script, read numbers.

Each engine of the library (``ropescale.serving.engines``) may have a driver here: an
``eval.engines.base.EngineDriver`` subclass with the same ``name``, in a module of this package
(``transformers_engine.py``, ``vllm_engine.py``, ``llama_cpp_engine.py``) or a plugin's (the
``ropescale.engines`` entry points), registered in ``DRIVERS``. It says where the engine's Python
is and runs the engine for parity; an engine without one is compared through its library
re-implementation alone.

The engines live in their own virtual environments (vLLM pins its own torch and transformers < 5.20;
llama-cpp-python compiles llama.cpp): they are never dependencies of ropescale, and nothing here
imports them. ``bench/engines/install.sh`` makes the two environments; this module finds their
interpreters and runs the standalone driver scripts beside it (``vllm_driver.py``, ``llama_cpp_driver.py``,
``convert_gguf.py``; package data of ``ropescale_eval.engines``, located by this file's path) as
``PYTHON DRIVER REQUEST.json RESULT.json``.

Where an engine's Python is looked for (the first that exists): its driver's ``python_env``
variable (``ROPESCALE_VLLM_PYTHON`` / ``ROPESCALE_LLAMA_CPP_PYTHON``: a python executable);
``<root>/<venv>/bin/python`` (``vllm``, ``llama``) under ``ROPESCALE_ENGINES``, then
``~/.cache/ropescale/engines`` (install.sh's default prefix).
llama.cpp's own converter (``convert_hf_to_gguf.py`` from the llama-cpp-python sdist's
``vendor/llama.cpp``): ``ROPESCALE_LLAMA_CPP_SOURCE``, else ``<root>/llama/src/llama.cpp``.

Errors: ``EngineAbsent`` (one line naming the variable to set and the install script) when an
engine is not installed; ``EngineFailed`` (one line: the driver's last error line, the log kept
in a file) when a driver exits non-zero, or leaves a result that is not a JSON object (torn:
the file kept and named).
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
from pathlib import Path
from typing import Any

from ropescale.errors import RopescaleError
from ropescale.registry import Registry
from ropescale.serving.engines import UnknownEngineError, get_engine

__all__ = [
    "DRIVERS",
    "EngineAbsent",
    "EngineFailed",
    "driver_class",
    "engine_python",
    "engine_status",
    "llama_cpp_source",
    "require_engine",
    "run_engine",
]

HERE = Path(__file__).resolve().parent
INSTALL = "bench/engines/install.sh"

# the drivers by engine name (``eval.engines.base.EngineDriver`` subclasses register on definition);
# the driver scripts beside them run in the engines' own environments and are never imported
DRIVERS: Registry[type] = Registry("engine driver", "engine drivers", UnknownEngineError, package=__name__,
                                   skip=("base", "vllm_driver", "llama_cpp_driver", "mlx_driver", "convert_gguf",
                                         "mlx_scoring", "vllm_eval", "scoring"),
                                   plugins="ropescale.engines")


class EngineAbsent(RopescaleError, LookupError):
    """The engine's environment is not installed (or its variable names no executable)."""


class EngineFailed(RopescaleError, RuntimeError):
    """An engine driver exited with an error; the message is its last error line."""


def _roots() -> list[Path]:
    roots = [os.environ.get("ROPESCALE_ENGINES"), str(Path.home() / ".cache" / "ropescale" / "engines")]
    return [Path(r) for r in roots if r]


def driver_class(engine: str) -> type | None:
    """The driver class registered for ``engine`` (after discovering every driver), or None."""
    DRIVERS.discover()
    return DRIVERS.get(engine)


def _known(engine: str) -> dict[str, str]:
    """``engine``'s subprocess settings: ``env`` (the variable naming its Python), ``venv``,
    ``driver`` (the script), ``label``; ``EngineAbsent`` for an engine that runs no subprocess."""
    cls = driver_class(engine)
    if cls is None or not getattr(cls, "python_env", None):
        known = ", ".join(n for n, c in sorted(DRIVERS.items()) if getattr(c, "python_env", None))
        raise EngineAbsent(f"unknown engine {engine!r}; known: {known}")
    return {"env": cls.python_env, "venv": cls.venv, "driver": cls.script, "label": get_engine(engine).label}


def engine_python(engine: str) -> Path | None:
    """The Python executable of ``engine``'s environment (``"vllm"``, ``"llama.cpp"``), or None
    when it is not installed. A variable set to a missing file counts as absent."""
    spec = _known(engine)
    given = os.environ.get(spec["env"])
    if given:
        return Path(given) if Path(given).is_file() else None
    for root in _roots():
        p = root / spec["venv"] / "bin" / "python"
        if p.is_file():
            return p
    return None


def engine_status(engine: str) -> str:
    """One line: where ``engine`` runs from, or why it is absent and how to install it."""
    spec = _known(engine)
    py = engine_python(engine)
    if py is not None:
        return f"{spec['label']}: {py}"
    given = os.environ.get(spec["env"])
    why = f"{spec['env']}={given} is not a file" if given else \
        f"no {spec['venv']}/bin/python under {', '.join(str(r) for r in _roots())} and {spec['env']} unset"
    return (f"{spec['label']} is not installed ({why}); install it with {INSTALL} "
            f"or set {spec['env']} to its environment's python")


def require_engine(engine: str) -> Path:
    """``engine_python(engine)``, or ``EngineAbsent`` with ``engine_status``'s one line."""
    py = engine_python(engine)
    if py is None:
        raise EngineAbsent(engine_status(engine))
    return py


def llama_cpp_source() -> Path | None:
    """llama.cpp's source folder (holding ``convert_hf_to_gguf.py`` and ``gguf-py``) from the
    llama-cpp-python sdist, or None."""
    given = os.environ.get("ROPESCALE_LLAMA_CPP_SOURCE")
    candidates = [Path(given)] if given else [r / "llama" / "src" / "llama.cpp" for r in _roots()]
    return next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)


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
    """Run ``engine``'s driver (or ``script``, another file beside this one) on ``request`` (a
    JSON-able dict with its ``mode``) in the engine's own Python and return the driver's JSON
    result, plus ``"seconds"`` (wall time of the subprocess).

    The engine's chatter goes to ``log_dir/<engine>-<mode>.log`` (a temporary file when None), or
    to this process's stderr when ``quiet`` is False. ``timeout`` [s]. Raises ``EngineAbsent`` and
    ``EngineFailed`` (one line each)."""
    py = require_engine(engine)
    driver = HERE / (script or _known(engine)["driver"])
    with tempfile.TemporaryDirectory(prefix="ropescale-engine-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        log_path = Path(log_dir or tmp) / f"{_known(engine)['venv']}-{request.get('mode', 'run')}.log"
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
                raise EngineFailed(f"{_known(engine)['label']} driver ran past {timeout:g} s "
                                   f"(log: {log_path})") from None
            finally:
                _kill_session(proc)
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not res.is_file():
            text = log_path.read_text(encoding="utf-8", errors="replace") if quiet else ""
            kept = log_path
            if log_dir is None:  # keep the log past the temporary folder
                kept = Path(tempfile.mkstemp(prefix=f"ropescale-{_known(engine)['venv']}-", suffix=".log")[1])
                kept.write_text(text, encoding="utf-8")
            raise EngineFailed(f"{_known(engine)['label']} driver failed (exit {proc.returncode}): "
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
            raise EngineFailed(f"{_known(engine)['label']} driver {driver.name} left an unreadable result "
                               f"({why}): {kept} (log: {log_path})")
    out["seconds"] = seconds
    return out

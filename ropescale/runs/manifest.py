"""One results folder = one experiment: its manifest, its lock, and the fingerprints that say
whether two runs are the same experiment.

``manifest.json`` is written when a run starts: the resolved config and the experiment's
*identity* — task and options, model and a fingerprint of its weights, data source and a
fingerprint of its tokens, dtype, training-window override, library versions. A rerun into a
folder whose identity differs is refused with one line saying what differs (adding strategies or
lengths to the same experiment is allowed: they are new cells of it). The identity's hash is
part of every cell id, so a resumed cell is one computed with the same model, data and code.

A lock file (``filelock``) keeps two runs from writing one folder at once. A run's identity is
built by ``ropescale.runs.lifecycle.run_identity`` (the run's own fields, fingerprints, versions).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ropescale._version import __version__
from ropescale.errors import OutputError, RopescaleError
from ropescale.models import weights_fingerprint
from ropescale.pip_models import model_licence
from ropescale.runs.processes import on_main

__all__ = [
    "LOCK",
    "MANIFEST",
    "ExperimentMismatchError",
    "FolderBusyError",
    "OutputError",
    "check_manifest",
    "data_fingerprint",
    "environment",
    "folder_lock",
    "prepare_output",
    "record_patch",
    "weights_fingerprint",
]

MANIFEST = "manifest.json"
LOCK = ".ropescale.lock"


class ExperimentMismatchError(RopescaleError, ValueError):
    """The folder holds another experiment."""


class FolderBusyError(RopescaleError, ValueError):
    """Another run is writing the folder."""


def prepare_output(output: Path) -> Path:
    """Create ``output`` (and parents) and make sure files can be written in it; ``OutputError``
    in one line otherwise (a file in the way, no permission, a read-only file system)."""
    if output.exists() and not output.is_dir():
        raise OutputError(f"output {output} is a file, not a folder")
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / f".ropescale-write-test-{os.getpid()}"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except NotADirectoryError:
        raise OutputError(f"output {output}: a part of the path is a file, not a folder") from None
    except OSError as e:
        raise OutputError(f"output {output}: cannot write there ({e.strerror or e})") from None
    return output


def _git_hash() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Versions and machine facts a run records beside its results."""
    import transformers

    return {"ropescale": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "git": _git_hash(), "machine": platform.machine(),
            "threads": torch.get_num_threads()}


def data_fingerprint(docs: list[torch.Tensor] | None) -> str | None:
    """sha256 of the documents' token ids (in order, with their lengths), 16 hex digits."""
    if docs is None:
        return None
    h = hashlib.sha256()
    for d in docs:
        h.update(len(d).to_bytes(8, "little"))
        h.update(d.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def check_manifest(output: Path, ident: dict[str, Any], config: dict[str, Any], state=None, *,
                   write: bool = True) -> str:
    """Check the folder's manifest (``ExperimentMismatchError`` naming what differs) and write it
    with the run's number of processes. ``state`` (accelerate's ``PartialState`` / ``Accelerator``
    of a launched run): the main process checks and writes, the others check once it is written.
    ``write=False`` checks only (every process, no barrier): a run checks before its slow setup and
    claims the folder once its inputs are known to work. Returns the identity's hash (part of every
    cell id). Under a launch the main process's refusal is raised on every process
    (``ropescale.runs.processes.on_main``)."""
    if not write:
        return _check_manifest(output, ident, config, write=False, processes=1)
    if state is None:
        return _check_manifest(output, ident, config, write=True, processes=1)
    digest = on_main(state, lambda: _check_manifest(output, ident, config, write=True,
                                                    processes=state.num_processes))
    if not state.is_main_process:  # each process's own identity against the one written
        digest = _check_manifest(output, ident, config, write=False, processes=state.num_processes)
    return digest


def _check_manifest(output: Path, ident: dict[str, Any], config: dict[str, Any], *, write: bool, processes: int) -> str:
    path = output / MANIFEST
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    patches = {}  # record_patch's entries, kept across reruns (resumed cells patch nothing again)
    if path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
            old, patches = before["identity"], before.get("patches", {})
        except (ValueError, KeyError, TypeError):
            raise ExperimentMismatchError(f"{path}: unreadable manifest; use a new output folder") from None
        if not isinstance(old, dict):  # hand-edited: a list or a string has no keys to compare
            raise ExperimentMismatchError(f"{path}: not a ropescale manifest, or a corrupt one (identity is not a "
                                          f"mapping but {type(old).__name__}); use a new output folder") from None
        diff = [k for k in sorted(set(old) | set(ident)) if old.get(k) != ident.get(k)]
        if diff:
            shown = "; ".join(f"{k}: {ident.get(k)!r} now, {old.get(k)!r} in the folder" for k in diff)
            raise ExperimentMismatchError(
                f"{output} holds another experiment ({shown}); give a new output folder (or delete this one)")
    elif (output / "results.jsonl").exists() and (output / "results.jsonl").stat().st_size:
        raise ExperimentMismatchError(f"{output} holds results without a manifest (written before ropescale "
                                      "recorded one), so they cannot be matched to this run; use a new folder")
    if write:  # beside it, then renamed over it: a run killed while writing leaves the old manifest, never a cut one
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"identity": ident, "identity_hash": digest, "config": config,
                                   "processes": processes, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                                  | ({"patches": patches} if patches else {})
                                  | ({"licence": licence} if (licence := _licence(config)) else {}),
                                  indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return digest


def _licence(config: dict[str, Any]) -> dict[str, str] | None:
    """The licence of the run's model where it carries one (a pip model: ``ropescale.pip_models``)."""
    model = config.get("model") if isinstance(config, dict) else None
    return model_licence(model) if isinstance(model, str) and model else None


def record_patch(output: Path, strategy: str, layers: list[dict[str, Any]]) -> None:
    """Add what ``strategy`` (its display name) does per attention layer (``PatchHandle.report()``: rope type,
    θ, channels, the rule applied, the query temperature kept, removed or added) to the folder's manifest,
    under ``patches``; not part of the identity. Written once per strategy, beside the manifest and renamed
    over it. A folder without a manifest is left alone."""
    path = output / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(manifest, dict) or strategy in manifest.get("patches", {}):
        return
    manifest.setdefault("patches", {})[strategy] = layers
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def folder_lock(output: Path, wait: float = 0.0):
    """An exclusive lock on ``output`` for the run; ``FolderBusyError`` when another run holds it
    (past ``wait`` seconds: the short holds of search processes sharing a folder wait for each other)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(output / LOCK), timeout=wait)

    class _Held:
        def __enter__(self):
            try:
                lock.acquire()
            except Timeout:
                raise FolderBusyError(f"{output} is being written by another run (lock {LOCK}); wait for it to "
                                      "finish or use another output folder") from None
            return self

        def __exit__(self, *exc):
            lock.release()

    return _Held()

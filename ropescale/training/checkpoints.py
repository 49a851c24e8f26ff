"""Training checkpoints: ``checkpoints/step-NNNNNN/`` folders written by accelerate's ``save_state``,
each counted complete only once its marker ``complete.json`` reads back.

A save that fails part-way — the disk fills up, the process is killed — leaves a folder without
a readable marker, which ``complete_checkpoints`` ignores, so a rerun resumes from the previous
complete checkpoint (bit-exact on CPU: same data order, model, optimiser, scheduler and RNG
states). A full disk during the save is reported in one line (``CheckpointWriteError``, an
``OutputError``) naming the folder, instead of torch's writer traceback
(``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`` / ``file write
failed``), safetensors' ``IoError(StorageFull)`` or ``OSError(ENOSPC)``.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

from ropescale.errors import OutputError

__all__ = ["CHECKPOINTS", "COMPLETE", "CheckpointWriteError", "complete_checkpoints", "save_checkpoint"]

CHECKPOINTS = "checkpoints"
COMPLETE = "complete.json"  # written into a checkpoint folder once save_state has returned
_LOW_SPACE = 64 * 2 ** 20  # bytes: below this a failed write is put down to a full disk
# how torch's zip writer, safetensors and the OS report a write that did not go through
_WRITE_FAILED = ("no space left on device", "storagefull", "disk quota", "file write failed", "unexpected pos",
                 "pytorchstreamwriter failed", "inline_container")


class CheckpointWriteError(OutputError):
    """A checkpoint could not be written (a full disk, most often); the run stopped, the partial
    checkpoint removed, the complete ones kept."""


def complete_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, folder)``, oldest first: a folder whose save was cut off has
    no completion marker, and one whose marker is unreadable (emptied or cut by a full disk) is
    not complete either — both are ignored, so a resume falls back to the previous complete one."""
    root = Path(output) / CHECKPOINTS
    found = []
    for p in root.glob("step-*") if root.is_dir() else []:
        try:
            found.append((int(json.loads((p / COMPLETE).read_text(encoding="utf-8"))["step"]), p))
        except (OSError, ValueError, KeyError, TypeError):  # no marker, or not one this loop wrote
            continue
    return sorted(found)


def _free_bytes(folder: Path) -> int | None:
    for p in (folder, *folder.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _write_failure(err: BaseException, folder: Path) -> str | None:
    """Why ``err`` is a failed write into ``folder`` ("no space left on the device", or the OS's
    reason), or None when it is not a write failure (a bug: re-raised as it is)."""
    text = " ".join(str(err).split()).lower()
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    if any(s in text for s in _WRITE_FAILED) or isinstance(err, OSError):
        free = _free_bytes(folder)
        if ("no space left" in text or "storagefull" in text or "quota" in text
                or (free is not None and free < _LOW_SPACE)):
            return "no space left on the device" + (f" ({free / 2 ** 20:.0f} MiB free)" if free is not None else "")
        return err.strerror if isinstance(err, OSError) and err.strerror else text[:200]
    return None


def save_checkpoint(acc, output: Path, step: int, keep: int, *, extra=None) -> Path:
    """``acc.save_state`` into ``output/checkpoints/step-NNNNNN`` (and ``extra(folder)``, called on
    every process: the sharded states accelerate does not hold), then the completion marker, then
    all but the newest ``keep`` complete checkpoints removed. Returns the folder.

    Raises ``CheckpointWriteError`` (one line: the folder, "no space left on the device", the step
    a rerun resumes from) when the state or the marker cannot be written; the partial folder is
    removed (never marked complete either way). Other errors propagate unchanged."""
    folder = Path(output) / CHECKPOINTS / f"step-{step:06d}"
    try:
        acc.save_state(str(folder))
        if extra is not None:
            extra(folder)
        acc.wait_for_everyone()
        if acc.is_main_process:
            (folder / COMPLETE).write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")
    except Exception as e:  # classified below; anything not a write failure is re-raised
        reason = _write_failure(e, folder)
        if reason is None:
            raise
        if acc.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)  # incomplete: unusable, and it holds the space
        kept = complete_checkpoints(output)
        resume = f"step {kept[-1][0]} ({kept[-1][1].name})" if kept else "the start (no complete checkpoint)"
        raise CheckpointWriteError(f"checkpoint {folder} at step {step}: could not be written: {reason}; the run "
                                   f"stopped, the partial checkpoint removed — free space and rerun the same "
                                   f"command: it resumes from {resume}") from None
    if acc.is_main_process:
        for _, old in complete_checkpoints(output)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return folder

"""Where an export is written: checked before any work, written whole or not at all.

``check_output`` refuses, in one line, an output that cannot be written (a file in the way, a
read-only or permission-less folder), or that is the source model's own folder (an export there
would overwrite the model's ``config.json``), before anything is loaded or written. ``staged``
gives a fresh folder to write into and moves what it holds into place only once everything is
written: a full disk, a failed write or a refusal met half-way leaves the output as it was (no
truncated ``model.gguf``, no folder holding half an export). A failed write is reported as
``OutputError`` (one line naming the folder and the system's reason), other errors pass through
unchanged, the partial files removed either way.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ropescale.errors import OutputError, RopescaleError

__all__ = ["OutputError", "check_output", "same_path", "staged", "write_failure"]

# how safetensors (Rust: "I/O error: No space left on device (os error 28)") and others word a
# write that did not go through, when the error is not an OSError
_WRITE_FAILED = ("no space left", "os error 28", "storagefull", "disk quota", "read-only file system",
                 "os error 30", "permission denied", "os error 13")


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name the same existing file or folder (any spelling, symlinks)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def check_output(output: str | os.PathLike, *, source: str | os.PathLike | None = None,
                 what: str = "output") -> Path:
    """``output`` as a ``Path`` once it is known that a folder can be written there: it is a
    folder or does not exist yet, its nearest existing folder accepts a new file (a probe is
    created and removed: permission bits do not stop root, a read-only file system does), and it
    is not the folder ``source`` (the model exported; any spelling of it, symlinks included).
    Creates nothing. Raises ``OutputError`` (one line) otherwise."""
    output = Path(output)
    if source is not None and same_path(output, source):
        raise OutputError(f"{what} {output} is the model's own folder {source}: exporting there would overwrite its "
                          "config.json; choose another folder")
    if output.is_symlink() and not output.exists():
        raise OutputError(f"{what} {output} is a symbolic link to nothing ({os.readlink(output)})")
    if output.exists() and not output.is_dir():
        raise OutputError(f"{what} {output} is a file, not a folder")
    base = _existing_ancestor(output)
    if not base.is_dir():
        raise OutputError(f"{what} {output}: {base} is a file, not a folder")
    probe = base / f".ropescale-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise OutputError(f"{what} {output}: cannot write in {base} ({e.strerror or e})") from None
    return output


def write_failure(err: BaseException) -> str | None:
    """The reason ``err`` is a failed write (the system's words, or "no space left on the
    device"), or None when it is something else (a refusal, a bug)."""
    text = " ".join(str(err).split())
    low = text.lower()
    if isinstance(err, OSError):
        # numpy's tofile (gguf-py's writer) reports a short write as "N requested and M written", no errno
        if err.errno in (errno.ENOSPC, errno.EDQUOT) or (err.errno is None and "requested and" in low):
            return "no space left on the device"
        return err.strerror or text or type(err).__name__
    if any(s in low for s in _WRITE_FAILED):
        full = any(s in low for s in ("no space left", "os error 28", "storagefull", "disk quota"))
        return "no space left on the device" if full else text[:200]
    return None


def _fail(err: BaseException, output: Path, what: str | None) -> None:
    reason = None if isinstance(err, RopescaleError) else write_failure(err)  # refusals: as they are
    if reason is None:
        raise err
    raise OutputError(f"{what or f'output {output}'}: could not be written ({reason}); it is left as it was, "
                      "nothing half-written") from None


@contextmanager
def staged(output: str | os.PathLike, *, what: str | None = None) -> Iterator[Path]:
    """A new empty folder to write an export into; when the block ends without error, what it
    holds is moved into ``output`` (renames on one file system: nothing more to write, so a full
    disk cannot cut it short).

    A missing ``output`` is the staging folder renamed (its missing parents are created, and
    removed again on failure). An existing ``output`` folder keeps its other files; each
    written file replaces its namesake (``os.replace``). On any error the staging folder (and
    the parents made for it) is removed; a failed write is raised as ``OutputError`` (one line
    naming ``what``, default "output OUTPUT"), anything else unchanged."""
    output = Path(output)
    made: list[Path] = []
    existed = output.is_dir()
    try:
        if not existed:
            for p in reversed(output.parents):
                if not p.exists():
                    p.mkdir()
                    made.append(p)
        # inside an existing output (same file system as what it replaces), else beside it
        home, name = (output, ".ropescale-export") if existed else (output.parent, f".{output.name}.ropescale-export")
        stage = home / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        stage.mkdir()  # honours the umask, unlike mkdtemp's 0700
    except OSError as e:
        for p in reversed(made):
            _rmdir(p)
        _fail(e, output, what)
    try:
        yield stage
        if existed:
            for item in sorted(stage.iterdir()):
                dst = output / item.name
                if dst.is_dir() and not dst.is_symlink():
                    shutil.rmtree(dst)
                os.replace(item, dst)
            stage.rmdir()
        else:
            os.rename(stage, output)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        for p in reversed(made):
            _rmdir(p)
        if not isinstance(e, Exception):
            raise
        _fail(e, output, what)


def _rmdir(p: Path) -> None:
    with suppress(OSError):  # not empty (someone else wrote there): kept
        p.rmdir()

"""Where a command will write, checked before it works: a folder it fills, a figure it saves.

Commands that compute for minutes and write at the end (``ropescale reference train``, ``reference
card``, ``compare``) check their outputs first, so that a path they cannot write is one line
before the work, not a traceback after it. The checks create nothing: a folder that is not there
yet passes when its nearest existing parent is a folder that takes a new file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ropescale.errors import InvalidInput

__all__ = ["check_figure", "check_folder", "figure_formats"]


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(folder: Path, what: str) -> None:
    """A file can be created in ``folder`` (created and removed at once)."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".ropescale-write-test-"):
            pass
    except OSError as e:
        raise InvalidInput(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def check_folder(path: str | Path, what: str) -> Path:
    """``path`` is a folder files can be written in, or can be created as one. ``what`` names the
    option in the message (``--output runs/m``). Raises ``InvalidInput`` in one line (a file in
    the way, no permission, a read-only file system)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InvalidInput(f"{what}: a file, not a folder")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise InvalidInput(f"{what}: a part of the path ({base}) is a file, not a folder")
    _probe(base, what)
    return path


def figure_formats() -> list[str]:
    """File extensions matplotlib saves figures as (``png``, ``pdf``, ``svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_figure(path: str | Path, what: str) -> Path:
    """``path`` names a figure matplotlib can save (its extension one of ``figure_formats``) in a
    folder that can be written. Raises ``InvalidInput`` in one line naming the supported formats
    or why the folder cannot be written."""
    path = Path(path)
    formats = figure_formats()
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in formats:
        got = f"the extension .{suffix} is not a figure format" if suffix else "no file extension"
        raise InvalidInput(f"{what}: {got}; use one of {', '.join('.' + f for f in formats)}")
    if path.is_dir():
        raise InvalidInput(f"{what}: a folder; name the figure file")
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise InvalidInput(f"{what}: a part of the path ({base}) is a file, not a folder")
    _probe(base, what)
    if path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as e:
            raise InvalidInput(f"{what}: cannot write the file ({e.strerror or e})") from None
    return path

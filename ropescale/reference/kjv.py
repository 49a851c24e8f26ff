"""The King James Bible from Debian's ``bible-kjv`` package, split by book.

The text is public domain. Debian's ``bible`` program prints it with chapter headings
("Genesis 1") and verse numbers; we drop both and keep one verse per line, chapters
separated by a blank line, one document per book.

Split: every 9th book (0-based index ``i % 9 == 7``) is held out — Ruth, Esther, Ezekiel,
Habakkuk, Acts, 2 Thessalonians, 1 John (7 of 66 books). No book is in both splits.

Raises:
    KjvNotInstalledError: the ``bible`` program is missing (with the install command).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess

from ropescale.errors import RopescaleError

__all__ = ["HELD_OUT_EVERY", "HELD_OUT_OFFSET", "KjvNotInstalledError", "books", "split"]

HELD_OUT_EVERY = 9
HELD_OUT_OFFSET = 7
_VERSE = re.compile(r"^\s+\d+ (.*)$")
_HEADING = re.compile(r"^(\S.*) (\d+)$")


class KjvNotInstalledError(RopescaleError, RuntimeError):
    """Debian's ``bible-kjv`` package is not installed."""


@functools.lru_cache(maxsize=1)
def books() -> tuple[tuple[str, str], ...]:
    """All 66 books as ``(name, text)`` in canonical order."""
    exe = shutil.which("bible")
    if exe is None:
        raise KjvNotInstalledError(
            "the KJV corpus needs Debian's bible-kjv package: "
            "run `apt-get install -y bible-kjv` (it provides the `bible` program)"
        )
    raw = subprocess.run(
        [exe, "gen1:1-rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    lines = raw.split("\n")
    out: list[tuple[str, list[list[str]]]] = []
    for i, line in enumerate(lines):
        prev_blank = i == 0 or lines[i - 1] == ""
        next_blank = i + 1 >= len(lines) or lines[i + 1] == ""
        heading = _HEADING.match(line) if prev_blank and next_blank else None
        if heading:
            name = heading.group(1)
            if not out or out[-1][0] != name:
                out.append((name, []))
            out[-1][1].append([])  # new chapter
        elif (m := _VERSE.match(line)) and out:
            out[-1][1][-1].append(m.group(1).strip())
        elif line.strip() and out and out[-1][1][-1]:
            out[-1][1][-1][-1] += " " + line.strip()  # continuation of a wrapped verse
    if len(out) != 66:
        raise RuntimeError(f"expected 66 books from `bible`, parsed {len(out)}")
    return tuple((name, "\n\n".join("\n".join(ch) for ch in chapters)) for name, chapters in out)


def split(name: str) -> list[tuple[str, str]]:
    """Books of split ``name`` (``"train"`` or ``"heldout"``) as ``(book, text)`` pairs."""
    if name not in ("train", "heldout"):
        raise ValueError(f"unknown KJV split {name!r}; choose 'train' or 'heldout'")
    held = name == "heldout"
    return [b for i, b in enumerate(books()) if (i % HELD_OUT_EVERY == HELD_OUT_OFFSET) == held]

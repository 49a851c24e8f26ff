"""The Debian Administrator's Handbook (Hertzog & Mas; GPL-2.0+ or CC-BY-SA-3.0) as evaluation text: a book of
about 220,000 tokens that is not the KJV, read offline from Debian's ``debian-handbook`` package
(``apt-get install debian-handbook``: its English HTML under ``/usr/share/doc/debian-handbook/html/en-US``).

Read in the book's own order — from the first page the index links, each page's ``<link rel="next">`` to the
next — one document per chapter (a chapter page and its sections), the text of each page's body without
its navigation (the banner, the title images, the Prev/Next lists): each block (paragraph, heading, list
item, table row) a line of its own separated by a blank line, runs of white space inside it made single.
ropescale reads the installed package; it ships none of the book.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

from ropescale.errors import RopescaleError

__all__ = ["HANDBOOK", "HandbookMissing", "chapters"]

HANDBOOK = Path(os.environ.get("ROPESCALE_HANDBOOK", "/usr/share/doc/debian-handbook/html/en-US"))
_BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "li", "tr", "pre", "dt", "dd", "br", "table"}
_SKIP_IDS = {"banner", "title"}


class HandbookMissing(RopescaleError, ValueError):
    """The Debian Administrator's Handbook is not installed where it is read."""


class _Page(HTMLParser):
    """A page's body text (navigation left out) and the page its ``<link rel="next">`` names."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.next: str | None = None
        self.chapter = False
        self._skip = 0  # depth inside a skipped element

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "link" and a.get("rel") == "next":
            self.next = a.get("href")
        if tag == "div" and "chapter" in (a.get("class") or "").split():
            self.chapter = True
        if self._skip:
            self._skip += tag not in ("img", "br", "meta", "link")
            return
        if tag == "head" or a.get("id") in _SKIP_IDS or "docnav" in (a.get("class") or "").split():
            self._skip = 1
            return
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            self._skip -= 1
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(re.sub(r"\s+", " ", data))  # the source's line breaks are not the text's

    def text(self) -> str:
        """The page's blocks (paragraphs, headings, list items …), one per line, separated by a blank line."""
        blocks = (b.strip() for b in "".join(self.parts).split("\n"))
        return "\n\n".join(b for b in blocks if b)


def _page(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def chapters(folder: Path | None = None) -> Iterator[str]:
    """The book's chapters in reading order, each as one text (its pages joined by a blank line).

    Raises ``HandbookMissing`` (one line naming the install) when the HTML is not in ``folder``
    (default ``HANDBOOK``; ``$ROPESCALE_HANDBOOK`` moves it)."""
    folder = Path(folder or HANDBOOK)
    if not (folder / "index.html").is_file():
        raise HandbookMissing(f"debian-handbook: the Debian Administrator's Handbook is not at {folder}; "
                              "apt-get install debian-handbook (or point ROPESCALE_HANDBOOK at its en-US folder)")
    name, seen, chapter = _page(folder / "index.html").next, set(), []
    while name and name not in seen and (folder / name).is_file():
        seen.add(name)
        page = _page(folder / name)
        if page.chapter and chapter:
            yield "\n\n".join(chapter)
            chapter = []
        chapter.append(page.text())
        name = page.next
    if chapter:
        yield "\n\n".join(chapter)

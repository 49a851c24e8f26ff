"""The Debian Administrator's Handbook as evaluation text (``debian-handbook``): read in the book's order through
its ``rel="next"`` links, one document per chapter, navigation left out — checked on a hand-made three-page
book; the missing package is one line; the real book, when Debian's package is installed, is the long
non-KJV text the real-model results use."""

import pytest

from ropescale.reference.handbook import HANDBOOK, HandbookMissing, chapters
from ropescale.runs.data import DataError, DataSpec, load_documents

NAV = ('<div id="banner"><a href="x"><span class="text">Download the ebook</span></a></div>'
       '<p id="title"><a class="left" href="y"><img alt="Product Site" src="i.png" /></a></p>'
       '<ul class="docnav top"><li class="previous"><a href="p.html"><strong>Prev</strong></a></li>'
       '<li class="next"><a href="n.html"><strong>Next</strong></a></li></ul>')


def _page(name: str, nxt: str | None, body: str) -> tuple[str, str]:
    link = f'<link rel="next" href="{nxt}" />' if nxt else ""
    return name, f"<html><head><title>t</title>{link}</head><body>{NAV}{body}{NAV}</body></html>"


@pytest.fixture
def book(tmp_path):
    pages = [
        _page("index.html", "preface.html", '<div class="book"><p>Table of contents</p></div>'),
        _page("preface.html", "one.html", '<div class="preface"><div class="para">Why   this\n book.</div></div>'),
        _page("one.html", "one-a.html", '<div class="chapter"><h2>Chapter 1. Start</h2>'
                                        '<div class="para">Run <code class="command">apt</code> now.</div></div>'),
        _page("one-a.html", "two.html", '<div class="section"><ul><li>first</li><li>second &amp; last</li></ul></div>'),
        _page("two.html", None, '<div class="chapter"><h2>Chapter 2. End</h2><p>Done.</p></div>'),
    ]
    for name, html in pages:
        (tmp_path / name).write_text(html, encoding="utf-8")
    return tmp_path


def test_pages_are_read_in_order_as_chapters_without_navigation(book):
    assert list(chapters(book)) == ["Why this book.",
                                    "Chapter 1. Start\n\nRun apt now.\n\nfirst\n\nsecond & last",
                                    "Chapter 2. End\n\nDone."]


def test_a_missing_book_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(HandbookMissing, match=r"^debian-handbook: .* is not at .*; apt-get install debian-handbook"):
        list(chapters(tmp_path))
    monkeypatch.setattr("ropescale.reference.handbook.HANDBOOK", tmp_path)
    with pytest.raises(DataError, match="apt-get install debian-handbook"):
        load_documents(DataSpec("debian-handbook"))


@pytest.mark.skipif(not (HANDBOOK / "index.html").is_file(), reason="Debian's debian-handbook is not installed")
def test_the_installed_book_is_a_long_non_kjv_text():
    docs = load_documents(DataSpec("debian-handbook"))
    assert len(docs) >= 15 and sum(map(len, docs)) > 900_000
    assert docs[1].startswith("Chapter 1. The Debian Project")
    assert not any("Download the ebook" in d or "\nPrev\n" in d for d in docs)
    assert DataSpec("debian-handbook", join=True).describe() == "debian-handbook joined"

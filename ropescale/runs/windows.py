"""Cut documents into evaluation windows; every scored token is scored exactly once.

A ``Window`` covers document tokens ``[start, end)`` and scores (predicts) the tokens
``[score_from, end)``, each from all window tokens before it. With ``bos=True`` a BOS token is
prepended to each window, so the window holds ``length − 1`` document tokens and even its first
document token is scored.

chunk: non-overlapping windows of exactly ``length`` tokens; a document's shorter remainder
    is dropped.
sliding: windows of up to ``length`` tokens advanced by ``stride``; each window scores only the
    tokens the previous one did not (the method of the HF perplexity guide), so each token is
    scored once with the most context the window allows. Without BOS a window's first token has
    no context, so a window starts at least one token before the first token it scores (with
    ``stride`` = ``length`` the windows then advance by ``length − 1``).
"""

from __future__ import annotations

from typing import NamedTuple

from ropescale.errors import RopescaleError

__all__ = ["Window", "WindowError", "cap_windows", "chunk_windows", "make_windows", "sliding_windows"]


class WindowError(RopescaleError, ValueError):
    """The data is too short for the requested windows, or the settings are inconsistent."""


class Window(NamedTuple):
    """One scoring window: tokens [``start``, ``end``) of document ``doc``, scored from ``score_from`` on
    (earlier tokens are context only, sliding mode)."""

    doc: int
    start: int
    end: int
    score_from: int


def chunk_windows(doc_lengths: list[int], length: int, bos: bool = False) -> list[Window]:
    """Non-overlapping windows of ``length`` tokens per document (``length`` − 1 of text after a BOS), each token
    scored once; the first token of a window without BOS is context only. A document's tail shorter than a
    window is left out."""
    n = length - int(bos)
    first = 0 if bos else 1
    return [Window(d, s, s + n, s + first)
            for d, total in enumerate(doc_lengths) for s in range(0, total - n + 1, n)]


def sliding_windows(doc_lengths: list[int], length: int, stride: int, bos: bool = False) -> list[Window]:
    """Windows of at most ``length`` tokens starting every ``stride`` tokens per document, each scoring only the
    tokens the previous window did not (every token scored once, with up to ``length`` − ``stride`` of context).
    Raises ``WindowError`` unless 0 < ``stride`` ≤ the window's text length."""
    if not 0 < stride <= length - int(bos):
        raise WindowError(f"stride must be between 1 and the window length; got stride={stride}, length={length}")
    n = length - int(bos)
    out = []
    for d, total in enumerate(doc_lengths):
        prev_end = 0 if bos else 1  # without BOS the first token has no context
        begin = 0
        while prev_end < total:
            if not bos:
                begin = min(begin, prev_end - 1)  # the first scored token needs one token of context
            end = min(begin + n, total)
            out.append(Window(d, begin, end, prev_end))
            prev_end = end
            begin += stride
    return out


def cap_windows(windows: list[Window], max_windows: int | None) -> list[Window]:
    """At most ``max_windows`` windows, evenly spaced over the list (deterministic)."""
    if not max_windows or len(windows) <= max_windows:
        return windows
    step = len(windows) / max_windows
    return [windows[int(i * step)] for i in range(max_windows)]


def make_windows(doc_lengths: list[int], length: int, mode: str = "chunk", stride: int | None = None,
                 bos: bool = False, max_windows: int | None = None) -> list[Window]:
    """Windows for one sweep length. Raises ``WindowError`` when no document is long enough."""
    if mode == "chunk":
        windows = chunk_windows(doc_lengths, length, bos)
    elif mode == "sliding":
        # refuse, as chunk mode does, rather than label shorter windows as this length
        fits = max(doc_lengths, default=0) >= length - int(bos)
        windows = sliding_windows(doc_lengths, length, stride or length // 2, bos) if fits else []
    else:
        raise WindowError(f"unknown mode {mode!r}; choose 'chunk' or 'sliding'")
    if not windows:
        raise WindowError(
            f"dataset too short for length {length}: the longest document has "
            f"{max(doc_lengths, default=0)} tokens ({len(doc_lengths)} documents); "
            "use shorter lengths or more/longer documents")
    return cap_windows(windows, max_windows)

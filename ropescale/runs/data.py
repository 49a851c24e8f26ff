"""Where the evaluation text comes from, as a list of separate documents.

Sources (``DataSpec.source``):
    ``kjv-heldout`` / ``kjv-train`` — the bundled KJV splits (held-out books by default);
    ``debian-handbook`` — the Debian Administrator's Handbook from Debian's package, one document per
        chapter (``ropescale.reference.handbook``): a long text that is not the KJV;
    a local path — a ``.txt`` file (one document), a folder (one document per ``*.txt`` file,
        sorted), a ``.jsonl``/``.json`` or ``.parquet`` file (one document per row);
    anything else — a Hugging Face dataset id (``pg19``, ``wikitext`` with ``config``), read in
        streaming mode so only ``max_documents`` rows are fetched.

Raises ``DataError`` for a missing column, an empty source or a file type we do not read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ropescale.errors import RopescaleError
from ropescale.reference import kjv

__all__ = ["BOOKS", "KJV_SPLITS", "DataError", "DataSpec", "load_documents", "tokenize_documents"]

KJV_SPLITS = {"kjv-heldout": "heldout", "kjv-train": "train"}
BOOKS = ("debian-handbook",)  # local books read by name (ropescale.reference)


class DataError(RopescaleError, ValueError):
    """The evaluation data cannot be read or is unusable."""


@dataclass(frozen=True)
class DataSpec:
    """Where documents come from (``load_documents``): ``source`` and, for hub datasets, ``config``,
    ``split``, ``text_column``; ``max_documents`` keeps the first ones; ``join`` makes them one."""

    source: str
    config: str | None = None
    split: str = "test"
    text_column: str = "text"
    max_documents: int | None = None
    join: bool = False  # the documents as one, in order, separated by a blank line

    def describe(self) -> str:
        """Short stable name for results files."""
        if self.source in KJV_SPLITS or self.source in BOOKS or Path(self.source).exists():
            base = self.source
        else:
            base = ":".join(x for x in (self.source, self.config, self.split) if x)
        return base + (f"[:{self.max_documents}]" if self.max_documents else "") + (" joined" if self.join else "")


def _rows(rows: Iterable[dict], column: str, where: str) -> Iterable[str]:
    for row in rows:
        if column not in row:
            raise DataError(f"{where}: no column {column!r}; columns: {', '.join(row)} "
                            "(set data.text_column)")
        yield row[column]


def _read_text(path: Path) -> str:
    """A text file as UTF-8 (bad bytes as U+FFFD); ``DataError`` for text with NUL characters,
    which is UTF-16/32 (or binary) read as UTF-8: every other byte a NUL, and no warning."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if "\x00" in text:
        raise DataError(f"{path}: the text has NUL characters, so it is not UTF-8; probably UTF-16 (or binary): "
                        f"convert it, e.g. iconv -f UTF-16 -t UTF-8 {path} > {path.with_suffix('.utf8.txt')}")
    return text


def _documents(spec: DataSpec) -> Iterable[str]:
    if spec.source in KJV_SPLITS:
        return (text for _, text in kjv.split(KJV_SPLITS[spec.source]))
    if spec.source == "debian-handbook":
        from ropescale.reference.handbook import HandbookMissing, chapters

        try:
            return list(chapters())
        except HandbookMissing as e:
            raise DataError(str(e)) from None
    path = Path(spec.source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"{path}: folder has no *.txt files")
        return (_read_text(p) for p in files)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".txt", ".md", ""):
            return [_read_text(path)]
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if builder is None:
            raise DataError(f"{path}: cannot read {suffix} files; use .txt, a folder of .txt, "
                            ".jsonl or .parquet")
        import datasets
        try:
            rows = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 — datasets wraps the parser's error in its own, many lines long
            kind = {".jsonl": "JSON lines", ".json": "JSON"}.get(suffix, "parquet")
            raise DataError(f"{path}: not a readable {kind} file ({type(e).__name__}); "
                            + ("use one JSON object per row, e.g. {\"text\": \"...\"}" if builder == "json"
                               else "write it with pyarrow/pandas")) from None
        return _rows(rows, spec.text_column, str(path))
    import datasets
    try:
        rows = datasets.load_dataset(spec.source, spec.config, split=spec.split, streaming=True)
    except Exception as e:  # the hub client raises many types; keep the message
        raise DataError(f"cannot load dataset {spec.describe()!r}: it is not a bundled name "
                        f"({', '.join(KJV_SPLITS)}), not a local path, and the hub said: {e}") from e
    return _rows(rows, spec.text_column, spec.describe())


REPLACED_WARNING = 0.01  # share of characters that were not valid UTF-8 above which we warn


def load_documents(spec: DataSpec) -> list[str]:
    """The source's documents as strings (empty ones dropped), at most ``max_documents``; with
    ``join``, those as one document, in order, separated by a blank line.

    Bytes that are not UTF-8 are read as U+FFFD; when more than 1% of the characters are, a
    warning says so (the text is probably not text)."""
    docs: list[str] = []
    for text in _documents(spec):
        if text and text.strip():
            docs.append(text)
        if spec.max_documents and len(docs) >= spec.max_documents:
            break
    if not docs:
        raise DataError(f"{spec.describe()}: no non-empty documents")
    replaced = sum(d.count("\ufffd") for d in docs) / sum(len(d) for d in docs)
    if replaced > REPLACED_WARNING:
        logging.getLogger("ropescale").warning(
            "%s: %.0f%% of the characters are not valid UTF-8 and were replaced; is this really text?",
            spec.describe(), 100 * replaced)
    return ["\n\n".join(docs)] if spec.join else docs


def tokenize_documents(tokenizer, docs: list[str]) -> list[torch.Tensor]:
    """Each document's token ids ``[n_tokens]`` int64, without special tokens."""
    enc = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    return [torch.tensor(ids, dtype=torch.long) for ids in enc]

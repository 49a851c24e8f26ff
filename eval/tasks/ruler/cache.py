"""Generated RULER samples, stored once per (tokenizer, task, options, length, seed, haystack) and
reused by every strategy, run and process.

A cache entry is one compressed JSON file named by the sha256 of its key, holding the key and the
samples (``spec.RulerSample.to_json``); it is read and written under a file lock
(``filelock``), so processes of a data-parallel run (or two runs at once) generate each entry
once and the others wait and read it. RULER's generators draw their size search before any sample,
so the first k samples of a run of n are the samples of a run of k: an entry with at least the
samples asked for answers, a shorter one is replaced. A length no sample fits (``PromptError``:
the sizes say none can, or ``max_draws`` ran out) is stored as refused and refused again from the cache. An entry that
cannot be read as one — cut short, not gzip, not JSON, another program's file, another key's — is
made again and replaced (written beside it, then renamed over it: never cut).

Where: ``$ROPESCALE_CACHE/ruler`` (default ``~/.cache/ropescale/ruler``). A file in the folder's place
is refused (``OutputError``, one line); a folder that cannot be written (a read-only file system, no
permission, a full disk) is read where it has the entry and otherwise costs only time: the samples
are generated, used and not stored, with one warning line per folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock
from pydantic import BaseModel, ConfigDict

from ropescale.errors import OutputError

from ..prompts import PromptError
from .spec import RulerSample

__all__ = ["CacheStats", "cache_dir", "cached_samples", "key_digest", "tokenizer_fingerprint"]


def cache_dir() -> Path:
    """Where generated RULER samples are kept: ``$ROPESCALE_CACHE/ruler`` (default ``~/.cache/ropescale``)."""
    root = os.environ.get("ROPESCALE_CACHE") or Path.home() / ".cache" / "ropescale"
    return Path(root) / "ruler"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex digits) of what decides a text's tokens: the fast tokenizer's full
    definition (vocabulary, merges, normalizer, pre-tokenizer), else its vocabulary, with the class,
    special tokens and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(tokenizer.special_tokens_map), getattr(tokenizer, "chat_template", None)]).encode())
    return h.hexdigest()[:16]


def key_digest(key: dict[str, Any]) -> str:
    """A cache file's name from what decides its samples (24 hex digits of the sorted JSON's sha256)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CacheStats:
    """How one length's samples were had: from the cache or generated, in ``seconds``."""

    cached: bool
    seconds: float
    path: str


class _Sample(BaseModel):
    """One stored sample (``RulerSample.to_json``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    index: int
    input: str
    outputs: list[str]
    length: int
    answer_prefix: str
    token_position_answer: int | None = None


class _Entry(BaseModel):
    """A cache file's document: its key and the samples, or the refusal of a length nothing fits."""

    model_config = ConfigDict(extra="forbid", strict=True)
    key: dict[str, Any]
    samples: list[_Sample] | None = None
    refused: str | None = None


def _read(path: Path, key: dict[str, Any]) -> _Entry | None:
    """The entry stored for ``key`` at ``path``; None when there is none, or none that reads as one:
    cut short (``EOFError``), not gzip (``BadGzipFile``, ``zlib.error``), not UTF-8 JSON, another
    document (``ValidationError``), another key's."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            entry = _Entry.model_validate(json.load(f))
    except (OSError, EOFError, zlib.error, ValueError):  # ValueError: JSON, UTF-8 and pydantic's errors
        return None
    return entry if entry.key == json.loads(json.dumps(key)) else None


def _write(path: Path, doc: dict[str, Any]) -> bool:
    """``doc`` stored at ``path`` whole (beside it, then renamed over it); False, with nothing left
    behind, when the folder refuses it (a full disk, no permission)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _warn_unstored(path.parent, e)
        return False
    return True


_WARNED: set[str] = set()


def _warn_unstored(directory: Path, error: OSError) -> None:
    """One warning line per folder and process: the cache cannot be written, the run goes on."""
    if str(directory) not in _WARNED:
        _WARNED.add(str(directory))
        logging.getLogger("ropescale").warning(
            "the RULER sample cache %s cannot be written (%s): samples are generated and not stored (set "
            "ROPESCALE_CACHE to a writable folder to keep them)", directory, error.strerror or type(error).__name__)


def _open_folder(directory: Path) -> bool:
    """Create the cache folder; whether it can be written. ``OutputError`` (one line) when a file
    stands where the folder (or a folder above it) should be."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        env = os.environ.get("ROPESCALE_CACHE")
        raise OutputError(f"the RULER sample cache {directory} cannot be made: a file is in the way"
                          + (f" (ROPESCALE_CACHE={env})" if env else "")
                          + "; point ROPESCALE_CACHE at a folder, or set cache: false in the task's options") from None
    except OSError as e:  # a read-only file system, no permission
        _warn_unstored(directory, e)
        return False
    return True


def cached_samples(key: dict[str, Any], num_samples: int, make: Callable[[], list[RulerSample]], *,
                   directory: Path | None = None, use: bool = True) -> tuple[list[RulerSample], CacheStats]:
    """The first ``num_samples`` samples for ``key``: read from the cache, or ``make()``d and
    stored. ``use=False``: always made, nothing read or written. Raises ``PromptError`` (a length
    nothing fits, stored too) and ``OutputError`` (a file where the cache folder should be); a
    folder that cannot be written is read if it can be, else bypassed with one warning line."""
    t0 = time.perf_counter()
    if not use:
        samples = make()
        return samples[:num_samples], CacheStats(False, time.perf_counter() - t0, "")
    directory = directory or cache_dir()
    path = directory / f"{key_digest(key)}.json.gz"
    if _open_folder(directory):
        lock = FileLock(str(path) + ".lock")
        try:
            lock.acquire()
        except OSError as e:  # the folder exists but takes no lock file (read-only)
            _warn_unstored(directory, e)
        else:
            try:
                return _lookup(path, key, num_samples, make, t0, store=True)
            finally:
                lock.release()
    return _lookup(path, key, num_samples, make, t0, store=False)  # entries are renamed in whole: no lock to read


def _lookup(path: Path, key: dict[str, Any], num_samples: int, make: Callable[[], list[RulerSample]], t0: float,
            *, store: bool) -> tuple[list[RulerSample], CacheStats]:
    entry = _read(path, key)
    if entry is not None and entry.refused is not None:
        raise PromptError(entry.refused)
    if entry is not None and entry.samples is not None and len(entry.samples) >= num_samples:
        samples = [RulerSample.from_json(s.model_dump()) for s in entry.samples[:num_samples]]
        return samples, CacheStats(True, time.perf_counter() - t0, str(path))
    try:
        samples = make()
        doc = {"key": key, "samples": [s.to_json() for s in samples]}
    except PromptError as e:  # refusing may take many draws (max_draws): the refusal is stored too
        samples, doc = None, {"key": key, "refused": str(e)}
    stored = store and _write(path, doc)
    if samples is None:
        raise PromptError(doc["refused"])
    return samples[:num_samples], CacheStats(False, time.perf_counter() - t0, str(path) if stored else "")

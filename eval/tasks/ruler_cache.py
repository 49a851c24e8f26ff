"""Generated RULER samples, stored once per (tokenizer, task, options, length, seed, haystack) and
reused by every strategy, run and process.

A cache entry is one compressed JSON file named by the sha256 of its key, holding the key and the
samples (``ruler_spec.RulerSample.to_json``); it is read and written under a file lock
(``filelock``), so processes of a data-parallel run (or two runs at once) generate each entry
once and the others wait and read it. RULER's generators draw their size search before any sample,
so the first k samples of a run of n are the samples of a run of k: an entry with at least the
samples asked for answers, a shorter one is replaced. A length no sample fits (``PromptError``,
found after RULER's retries) is stored as refused and refused again from the cache.

Where: ``$ROPESCALE_CACHE/ruler`` (default ``~/.cache/ropescale/ruler``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from .prompts import PromptError
from .ruler_spec import RulerSample

__all__ = ["CacheStats", "cache_dir", "cached_samples", "key_digest", "tokenizer_fingerprint"]


def cache_dir() -> Path:
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
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CacheStats:
    """How one length's samples were had: from the cache or generated, in ``seconds``."""

    cached: bool
    seconds: float
    path: str


def cached_samples(key: dict[str, Any], num_samples: int, make: Callable[[], list[RulerSample]], *,
                   directory: Path | None = None, use: bool = True) -> tuple[list[RulerSample], CacheStats]:
    """The first ``num_samples`` samples for ``key``: read from the cache, or ``make()``d and
    stored. ``use=False``: always made, nothing read or written."""
    t0 = time.perf_counter()
    if not use:
        samples = make()
        return samples[:num_samples], CacheStats(False, time.perf_counter() - t0, "")
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key_digest(key)}.json.gz"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            refused = None
            try:
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    doc = json.load(f)
                if doc.get("key") == json.loads(json.dumps(key)):
                    refused = doc.get("refused")  # a length nothing fits
                    if refused is None and len(doc["samples"]) >= num_samples:
                        samples = [RulerSample.from_json(s) for s in doc["samples"][:num_samples]]
                        return samples, CacheStats(True, time.perf_counter() - t0, str(path))
            except (OSError, ValueError, KeyError, TypeError):  # a torn or foreign file: made again below
                pass
            if isinstance(refused, str):
                raise PromptError(refused)
        try:
            samples = make()
            doc = {"key": key, "samples": [s.to_json() for s in samples]}
        except PromptError as e:  # refusing takes RULER's retries: the refusal is stored too
            samples, doc = None, {"key": key, "refused": str(e)}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
        if samples is None:
            raise PromptError(doc["refused"])
    return samples[:num_samples], CacheStats(False, time.perf_counter() - t0, str(path))

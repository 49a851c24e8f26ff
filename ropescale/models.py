"""Load models by short name, path or hub id; save and reload patched models.

``reference`` (alias ``kjv-llama``) is the bundled KJV Llama (``ropescale/reference/kjv-llama``).
A directory written by ``save_patched`` holds the HF files, with the patch expressed in
``config.json`` where transformers can (``ropescale.export``), plus ``ropescale.json`` recording the
patch and the model's original rope parameters; ``load_model`` rebuilds the original model and
re-applies the patch (patching must follow ``from_pretrained``, which recomputes ``inv_freq``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ropescale.patching import PatchHandle, current_patch, patch

__all__ = ["REFERENCE_MODEL", "MODEL_ALIASES", "PATCH_FILE", "resolve_model", "load_model",
           "save_patched", "resolve_device"]

REFERENCE_MODEL = Path(__file__).parent / "reference" / "kjv-llama"
MODEL_ALIASES = {"reference": REFERENCE_MODEL, "kjv-llama": REFERENCE_MODEL}
PATCH_FILE = "ropescale.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(name_or_path: str) -> str:
    """Short name → bundled path; anything else unchanged (a path or a hub id)."""
    path = MODEL_ALIASES.get(name_or_path)
    if path is None:
        return name_or_path
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"bundled model missing at {path}; reinstall ropescale or "
                                "train it with `python -m ropescale.reference.train --output "
                                f"{path}`")
    return str(path)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "auto",
               attn_implementation: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode; re-applies a saved ``ropescale.json`` patch.

    Raises ``ValueError`` for an unknown ``dtype`` and whatever ``from_pretrained`` raises for an
    unknown id (hub access needs network; offline, only local paths and the bundled model work).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; choose one of {', '.join(_DTYPES)}")
    path = resolve_model(name_or_path)
    kwargs = {"dtype": _DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    saved = Path(path) / PATCH_FILE
    record = json.loads(saved.read_text()) if saved.is_file() else None
    if record and "base_rope_parameters" in record:  # undo the export: ropescale re-applies the patch
        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.rope_parameters = record["base_rope_parameters"]
        kwargs["config"] = config
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(resolve_device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if record:
        patch(model, record["strategy"],
              original_max_position_embeddings=record.get("original_max_position_embeddings"),
              layer_types=record.get("layer_types"),
              **{k: record[k] for k in ("dynamic_cache", "dynamic_block", "logn") if k in record},
              **record.get("params", {}))
    return model, tokenizer


def save_patched(model, tokenizer, output: str | Path) -> Path:
    """Write the patched model: HF files with the patch in ``config.json`` plus ``ropescale.json``.

    Where transformers can express the strategy, plain ``AutoModelForCausalLM.from_pretrained``
    of ``output`` gives the same logits; otherwise it fails with a ``KeyError`` naming
    ``ropescale.load_model`` rather than running vanilla RoPE. ``ropescale.load_model(output)``
    always restores the patched model. ``ropescale.json`` has ``native`` (which case applies).
    Raises ``ValueError`` when the model carries no patch.
    """
    handle: PatchHandle | None = current_patch(model)
    if handle is None:
        raise ValueError("model is not patched; call ropescale.patch(model, ...) first")
    from ropescale.export import exported_config

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    config, native = exported_config(model, handle)
    config.save_pretrained(output)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    record = handle.to_dict() | {"native": native, "base_rope_parameters": text.rope_parameters}
    (output / PATCH_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return output

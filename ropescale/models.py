"""Load models by short name, path or hub id; save and reload patched models.

``reference`` (alias ``kjv-llama``) is the bundled KJV Llama (``ropescale/reference/kjv-llama``).
A directory written by ``save_patched`` holds the plain HF files plus ``ropescale.json``;
``load_model`` re-applies that patch after loading (patching must follow ``from_pretrained``,
which recomputes ``inv_freq``).
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; choose one of {', '.join(_DTYPES)}")
    path = resolve_model(name_or_path)
    kwargs = {"dtype": _DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(resolve_device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    saved = Path(path) / PATCH_FILE
    if saved.is_file():
        record = json.loads(saved.read_text())
        patch(model, record["strategy"],
              original_max_position_embeddings=record.get("original_max_position_embeddings"),
              **record.get("params", {}))
    return model, tokenizer


def save_patched(model, tokenizer, output: str | Path) -> Path:
    """Write the model (HF format) plus ``ropescale.json`` recording its active patch.

    ``ropescale.load_model(output)`` restores the patched model. Plain transformers loading
    of the directory gives the *unpatched* model (export to native ``rope_parameters`` is not
    done here). Raises ``ValueError`` when the model carries no patch.
    """
    handle: PatchHandle | None = current_patch(model)
    if handle is None:
        raise ValueError("model is not patched; call ropescale.patch(model, ...) first")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    (output / PATCH_FILE).write_text(json.dumps(handle.to_dict(), indent=1) + "\n")
    return output

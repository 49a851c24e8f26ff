"""Models by short name, path or hub id, loaded — with the patch a saved folder records re-applied.

``reference`` (alias ``kjv-llama``) is the bundled KJV Llama (``ropescale/reference/kjv-llama``).
A folder written by ``save_patched`` (``ropescale.models.saving``) holds ``ropescale.json`` recording the
patch and the model's original rope parameters; ``load_model`` rebuilds the original model and re-applies the
patch (patching must follow ``from_pretrained``, which recomputes ``inv_freq``). A LoRA adapter folder
written by ``save_adapter`` loads the same way: ``load_model`` loads the base model named in
``adapter_config.json``, re-applies the patch, then the adapter (PEFT, an optional dependency:
``pip install 'ropescale[lora]'``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ropescale.compat import peft_wrapping
from ropescale.errors import InvalidInput, RopescaleError
from ropescale.patching import PatchHandle, patch, unpatch
from ropescale.pip_models import PIP_MODELS, PipModelError, pip_model_path

__all__ = ["ADAPTER_FILE", "DTYPES", "MODEL_ALIASES", "PATCH_FILE", "REFERENCE_MODEL", "ModelLoadError", "adapter_base",
           "load_model", "load_tokenizer", "model_config", "model_rope_config", "model_training_window",
           "resolve_device", "resolve_model"]

REFERENCE_MODEL = Path(__file__).parent.parent / "reference" / "kjv-llama"
MODEL_ALIASES = {"reference": REFERENCE_MODEL, "kjv-llama": REFERENCE_MODEL}
PATCH_FILE = "ropescale.json"
ADAPTER_FILE = "adapter_config.json"  # PEFT's
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RopescaleError, ValueError):
    """A model cannot be loaded: missing folder, unreadable files, unknown or unreachable hub id."""


def _looks_like_path(name: str) -> bool:
    """A name that can only be a local path (a hub id is ``name`` or ``org/name``)."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def resolve_model(name_or_path: str) -> str:
    """Short name → bundled path; anything else unchanged (a path or a hub id).

    A pip model's name (``gemma-3-270m``, ``ropescale.pip_models``) → its cached folder, made on first use.

    Raises ``ModelLoadError`` for a path that does not exist or holds no model, and for a pip model
    that cannot be made ready (package missing, damaged)."""
    if not str(name_or_path).strip():  # Path("") is the working folder
        raise ModelLoadError(f"model name {name_or_path!r} is empty; give a bundled name ({', '.join(MODEL_ALIASES)}), "
                             "a model folder or a hub id")
    if name_or_path in PIP_MODELS:
        try:
            return str(pip_model_path(name_or_path))
        except PipModelError as e:
            raise ModelLoadError(str(e)) from None
    path = MODEL_ALIASES.get(name_or_path)
    if path is None:
        local = Path(name_or_path).expanduser()
        if local.is_dir() and not (local / "config.json").is_file() and not (local / ADAPTER_FILE).is_file():
            raise ModelLoadError(f"{name_or_path}: folder has no config.json (nor adapter_config.json); not a Hugging "
                             "Face model or PEFT adapter folder")
        if not local.exists() and _looks_like_path(name_or_path):
            raise ModelLoadError(f"{name_or_path}: no such model folder (bundled names: {', '.join(MODEL_ALIASES)})")
        if local.is_file():
            raise ModelLoadError(f"{name_or_path}: is a file; give the model's folder, a bundled name "
                                 f"({', '.join(MODEL_ALIASES)}) or a hub id")
        return name_or_path
    if not (path / "model.safetensors").exists():
        raise ModelLoadError(f"bundled model missing at {path}; reinstall ropescale or "
                                "train it with `ropescale reference train --output "
                                f"{path}`")
    return str(path)


def adapter_base(path: str | Path) -> str | None:
    """The base model named by a PEFT adapter folder's ``adapter_config.json``
    (``base_model_name_or_path``), or None when ``path`` is not an adapter folder.
    Raises ``ModelLoadError`` for an adapter config without a readable base name."""
    config = Path(path) / ADAPTER_FILE
    if not config.is_file() or (Path(path) / "config.json").is_file():
        return None
    try:
        base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        base = None
    if not base:
        raise ModelLoadError(f"{path}: {ADAPTER_FILE} names no base_model_name_or_path; cannot load the adapter")
    return str(base)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` (CUDA when present, else CPU) or a torch device string that exists on this
    machine. Raises ``ValueError`` for an unknown name or a device that is not there."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInput(f"device {device!r} unknown; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidInput(f"device {device!r}: CUDA is not available on this machine (use cpu or auto)")
        if dev.index is not None and dev.index >= count:
            raise InvalidInput(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 … cuda:{count - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidInput(f"device {device!r}: MPS is not available on this machine (use cpu or auto)")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise InvalidInput(f"device {device!r}: ropescale runs on cpu, cuda or mps")
    return dev


def _damaged_weights(folder: Path) -> str | None:
    """One line naming the first ``*.safetensors`` file of ``folder`` whose header is unreadable or
    whose tensors run past its end (a copy or download cut short), or None when all are whole."""
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError(f"{size} bytes, shorter than a header")
                n = int.from_bytes(head, "little")
                if n > size - 8:
                    raise ValueError(f"its header claims {n} bytes, the file has {size}")
                meta = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else "unreadable header"
            return f"{f} is truncated or corrupt: {why}; re-save or re-download it"
        if 8 + n + end > size:
            return (f"{f} is truncated or corrupt: its tensors need {8 + n + end} bytes, the file has {size}; "
                    "re-save or re-download it")
    return None


def _from_pretrained(loader, name: str, path: str, **kwargs):
    """``loader.from_pretrained`` with its many failure types turned into one line."""
    from safetensors import SafetensorError

    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if Path(path).exists():
            bad = _damaged_weights(Path(path))
            if bad:
                raise ModelLoadError(bad) from None
            raise ModelLoadError(f"{name}: cannot read the model files ({first})") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        why = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else f"the hub said: {first}"
        raise ModelLoadError(f"cannot load {name!r}: not a bundled name ({', '.join(MODEL_ALIASES)}), "
                             f"not a local folder, and {why}") from None


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "auto",
               attn_implementation: str | None = None, device_map: str | dict | None = None,
               tokenizer: Any = None, served: bool = False, quantization: str | None = None) -> tuple[Any, Any]:
    """Load a model and its tokenizer, re-applying a patch saved beside it.

    A folder written by ``save_patched`` or ``export_for`` gets its ``ropescale.json`` patch back; a LoRA
    adapter folder (``save_adapter``) loads its base model, re-applies the patch and attaches the adapter.

    Args:
        name_or_path: ``reference`` (the bundled model), a local folder, or a hub id (fetched by transformers;
            offline, only local paths and the bundled model work).
        dtype: the weights' dtype: ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1`` …; ignored with ``device_map``.
        attn_implementation: transformers' attention implementation (``sdpa``, ``eager`` …), default its own.
        device_map: ``"auto"``, ``"balanced"`` or a dict: spread a model larger than one GPU over this
            machine's devices with accelerate.
        tokenizer: the model's tokenizer when the caller has loaded it already (``load_tokenizer``): returned
            as it is instead of loaded again.
        served: the model exactly as plain ``AutoModelForCausalLM.from_pretrained`` serves the folder — a saved
            patch stays in the config as its export wrote it and is not re-applied (what ``native`` starts from).
        quantization: ``"nf4"``: QLoRA's base (Dettmers et al. 2023, arXiv:2305.14314) — linear weights in
            4-bit NormalFloat with double quantization through bitsandbytes, computed in ``dtype`` (CUDA only).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: an unknown ``dtype`` or device.
        ModelLoadError: a missing folder, unreadable model files, a hub id that cannot be fetched, and with
            ``served``, a folder whose saved patch plain transformers cannot express or a LoRA adapter folder
            (one line each).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise InvalidInput(f"dtype {dtype!r} unknown; choose one of {', '.join(DTYPES)}")
    path = resolve_model(name_or_path)
    base = adapter_base(path)
    if base is not None:
        _check_adapter_load(name_or_path, served=served, quantization=quantization)
        return _load_adapter(name_or_path, path, base, dtype=dtype, device=device,
                             attn_implementation=attn_implementation, device_map=device_map, tokenizer=tokenizer)
    kwargs = {"dtype": DTYPES[dtype]} | ({"attn_implementation": attn_implementation} if attn_implementation else {})
    if quantization is not None:
        kwargs["quantization_config"] = _quantization_config(quantization, DTYPES[dtype])
        device_map = {"": str(resolve_device(device))}  # bitsandbytes quantizes as the weights reach the GPU
    record = _record_to_apply(name_or_path, path, served=served)
    if record and "base_rope_parameters" in record:  # undo the export: ropescale re-applies the patch
        kwargs["config"] = _base_config(AutoConfig, name_or_path, path, record)
    if device_map is not None:  # accelerate's big-model inference: layers spread over the devices there are
        model = _from_pretrained(AutoModelForCausalLM, name_or_path, path, device_map=device_map, **kwargs).eval()
    else:
        target = resolve_device(device)  # before loading: a device that is not there fails first
        model = _from_pretrained(AutoModelForCausalLM, name_or_path, path, **kwargs).to(target).eval()
    if tokenizer is None:
        tokenizer = _from_pretrained(AutoTokenizer, name_or_path, path)
    if record:
        _apply_record(model, record)
    return model, tokenizer


def _check_adapter_load(name: str, *, served: bool, quantization: str | None) -> None:
    """``ModelLoadError`` (one line) for what a LoRA adapter folder cannot be loaded as: served by plain
    transformers, or over a quantized base."""
    if served:
        raise ModelLoadError(f"{name}: is a LoRA adapter folder, which plain transformers does not serve; "
                             "its rotation is the patch it was trained with: patch its base model instead")
    if quantization is not None:
        raise ModelLoadError(f"{name}: is a LoRA adapter folder; a {quantization} base is loaded from a "
                             "plain model folder (merge the adapter into its base first)")


def _quantization_config(quantization: str, compute_dtype):
    """transformers' ``BitsAndBytesConfig`` for ``quantization`` (only ``nf4``: QLoRA's settings)."""
    if quantization != "nf4":
        raise InvalidInput(f"quantization {quantization!r} unknown; the one there is: nf4")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def _patch_record(path: str | Path) -> dict[str, Any] | None:
    """The ``ropescale.json`` patch record of a saved model folder, or None."""
    saved = Path(path) / PATCH_FILE
    if not saved.is_file():
        return None
    try:
        return json.loads(saved.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{saved}: not valid JSON ({e}); it is the patch record save_patched writes") from None


def _record_to_apply(name: str, path: str, *, served: bool) -> dict[str, Any] | None:
    """The saved patch to re-apply after loading, or None; with ``served``, none — the folder as plain
    transformers serves it: the export kept, nothing re-applied (``ModelLoadError`` where that is no model)."""
    record = _patch_record(path)
    if served:
        _check_served(name, record)
        return None
    return record


def _check_served(name: str, record: dict[str, Any] | None) -> None:
    """``ModelLoadError`` (one line) for a saved patch (``record``) that plain transformers cannot
    express: its folder has no model of its own for plain ``from_pretrained`` to serve."""
    if record is not None and not record.get("native"):
        raise ModelLoadError(f"{name}: its config.json carries a {record.get('strategy')} patch that plain "
                             "transformers cannot express, so it has no rotation of its own to keep; load it with "
                             "its patch (ropescale.load_model), or start from the model it was patched from")


def _saved_window(path: str) -> int | None:
    """T a saved patch (or an adapter's base model's saved patch) was applied over, or None."""
    record = _patch_record(path) or {}
    train = record.get("original_max_position_embeddings")
    if isinstance(train, dict) and train:  # one T per layer type: the model's is the full-attention layers'
        train = train.get("full_attention", max(train.values()))
    if train:
        return int(train)
    base = adapter_base(path)
    return None if base is None else _saved_window(resolve_model(base))


def _base_config(loader, name: str, path: str, record: dict[str, Any] | None):
    """The model's config with a saved patch's export undone (its ``base_rope_parameters`` back)."""
    config = _from_pretrained(loader, name, path)
    if record and "base_rope_parameters" in record:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.rope_parameters = record["base_rope_parameters"]
    return config


def model_config(name_or_path: str):
    """The transformers config of the model ``name_or_path`` names, as ropescale patches it, without
    loading weights: a saved patched model's config with its export undone (the original rope
    parameters, from ``ropescale.json``), a PEFT adapter folder's base model's. Raises
    ``ModelLoadError`` in one line."""
    from transformers import AutoConfig

    path = resolve_model(name_or_path)
    base = adapter_base(path)
    if base is not None:  # an adapter folder: its base model's config
        return model_config(base)
    return _base_config(AutoConfig, name_or_path, path, _patch_record(path))


def model_rope_config(name_or_path: str, layer_type: str | None = None):
    """d, b and T (``ropescale.rope_config.RopeConfig``) of a model from its name or folder, without
    loading weights; the same reader ``patch`` uses on a loaded model. T is the window a saved patch
    was applied over (``ropescale.json``'s ``original_max_position_embeddings``) when there is one,
    an adapter folder's base model's otherwise, else the config's (rope parameters', Phi-3's
    ``original_max_position_embeddings``, ``max_position_embeddings``). Raises ``ModelLoadError``
    or ``NoRopeConfigError`` (a ``ValueError``) in one line."""
    from dataclasses import replace

    from ropescale.rope_config import rope_config_of

    rope = rope_config_of(model_config(name_or_path), layer_type)
    saved = _saved_window(resolve_model(name_or_path))
    return rope if saved is None else replace(rope, original_max_position_embeddings=saved)


def model_training_window(name_or_path: str) -> int:
    """T [tokens] of a model from its name or folder (``model_rope_config``). Raises
    ``ModelLoadError`` / ``ValueError`` in one line, also when the config has no window."""
    from ropescale.rope_config import text_config, training_window

    saved = _saved_window(resolve_model(name_or_path))
    orig = saved or training_window(text_config(model_config(name_or_path)))
    if not orig:
        raise InvalidInput(f"{name_or_path}: config has no max_position_embeddings; set "
                           "original_max_position_embeddings")
    return orig


model_training_length = model_training_window  # the name before the glossary (T is the training window)


def _apply_record(model, record: dict[str, Any]) -> PatchHandle:
    """Re-apply a patch recorded in ``ropescale.json``."""
    return patch(model, record["strategy"],
                 original_max_position_embeddings=record.get("original_max_position_embeddings"),
                 layer_types=record.get("layer_types"),
                 **{k: record[k] for k in ("dynamic_cache", "dynamic_block", "logn", "temperature") if k in record},
                 **record.get("params", {}))


def _load_adapter(name: str, path: str, base: str, *, tokenizer: Any = None, **kwargs) -> tuple[Any, Any]:
    """An adapter folder: the base model (``load_model``; a patch saved with the base is dropped),
    the adapter's patch re-applied, then the adapter applied (PEFT ``PeftModel`` in eval mode;
    ``current_patch`` reaches the base model's patch through it)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelLoadError(f"{name}: is a LoRA adapter folder; loading it needs PEFT: "
                             "pip install 'ropescale[lora]' (peft>=0.13)") from None
    from transformers import AutoTokenizer

    if Path(base).resolve() == Path(path).resolve():
        raise ModelLoadError(f"{name}: {ADAPTER_FILE} names the adapter folder itself as its base model")
    model, _ = load_model(base, tokenizer=False, **kwargs)  # the adapter folder's tokenizer, not the base's
    unpatch(model)
    saved = Path(path) / PATCH_FILE
    if saved.is_file():  # patch before the adapter, as training did
        _apply_record(model, json.loads(saved.read_text(encoding="utf-8")))
    try:
        with peft_wrapping():
            model = PeftModel.from_pretrained(model, path, is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{name}: cannot apply the LoRA adapter to {base} ({first})") from None
    if tokenizer is None:
        tokenizer = _from_pretrained(AutoTokenizer, name, path)
    return model.eval(), tokenizer


def load_tokenizer(name_or_path: str):
    """The tokenizer of a bundled name, local folder or hub id (``ModelLoadError`` in one line)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name_or_path, resolve_model(name_or_path))

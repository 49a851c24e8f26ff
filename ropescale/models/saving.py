"""The transformers export: a patched model saved as a folder transformers (and ``load_model``) reads back.

A directory written by ``save_patched`` holds the HF files, with the patch expressed in ``config.json`` where
transformers can (``exported_config``: the strategy's export hook), plus ``ropescale.json`` recording the
patch and the model's original rope parameters (``ropescale.models.loading.load_model`` re-applies it). A LoRA
adapter folder written by ``save_adapter`` holds PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``, the tokenizer and ``ropescale.json``.

It lives beside the loader, in the save-and-load layer, not in ``ropescale/serving/``: fine-tuning
(``ropescale.training``) saves through it, and training and serving are one layer's two groups, neither
importing the other (``tests/test_layers.py``); the serving engines build on it (``ropescale.serving.engines``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ropescale.errors import InvalidInput
from ropescale.patching import PatchHandle, current_patch
from ropescale.rope_config import per_layer_type

from .loading import ADAPTER_FILE, PATCH_FILE, REFERENCE_MODEL

__all__ = ["MARKER", "exported_config", "native_rope_parameters", "save_adapter", "save_patched", "save_unexpressed"]


# --- the patch as transformers rope_parameters ------------------------------------------------------
# Strategies transformers implements are written natively by their registry ``export`` hook (beside each
# strategy in ``ropescale.strategies``): ``vanilla`` (``default``), ``ntk`` (a raised ``rope_theta``:
# b·s^(d/(d−2))), ``linear``, ``dynamic_ntk`` (``dynamic``; only when T is ``max_position_embeddings``,
# which transformers' formula uses), ``yarn``, ``llama3``, ``longrope``. Attention factors are written
# explicitly so no default can drift. For any other strategy the rope type is set to a marker that
# transformers refuses to build (``KeyError`` naming ``ropescale.load_model``) instead of silently running
# vanilla RoPE.

MARKER = "ropescale:{name} (not a transformers rope type: load with ropescale.load_model)"
_KEEP = ("rope_theta", "partial_rotary_factor")


def native_rope_parameters(handle: PatchHandle, base: dict[str, Any], max_position_embeddings: int | None,
                           layer_type: str | None = None, *, temperature_apart: bool = False) -> dict[str, Any] | None:
    """The transformers ``rope_parameters`` equivalent to ``handle`` for one layer type (its
    ``base`` parameters' ``rope_theta``/``partial_rotary_factor`` kept, the rest from the
    strategy's ``export`` hook, from that type's own context: Gemma 3's sliding and full layers
    have different ``rope_theta``), or None when transformers cannot express it (no hook, the
    hook says so, or a ``dynamic_block``/``logn``/``temperature`` option transformers has no equivalent
    for — ``temperature_apart``: the caller carries a query temperature itself, an engine's own key)."""
    temperature = not temperature_apart and (handle.options.get("logn") or handle.options.get("temperature"))
    if handle.options.get("dynamic_block", 1) != 1 or temperature:
        return None
    export = handle.strategy_obj.export
    if export is None:
        return None
    ctx = handle.contexts.get(layer_type, handle.context)
    written = export(dict(handle.params), dict(ctx), dict(base), max_position_embeddings)
    if written is None:
        return None
    return {**{k: base[k] for k in _KEEP if k in base}, **written}


def exported_config(model: Any, handle: PatchHandle, *, express: bool = True) -> tuple[Any, bool]:
    """A copy of a patched model's config carrying its patch.

    Args:
        model: the patched model.
        handle: its patch.
        express: write the patch as transformers rope parameters where they can hold it
            (``native_rope_parameters`` per layer type); False: ``MARKER`` for every patched layer type
            (a folder plain transformers refuses).

    Returns:
        ``(config, native)``: the config, and whether every patched layer type is written as
        transformers rope parameters.
    """
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rp = copy.deepcopy(text.rope_parameters)
    native = True
    for lt in handle.layer_types:
        # one set for every layer (a relative rule) over a config keyed by layer type: each type that rotates
        # gets it, a NoPE type (rope parameters None) stays None
        sets = per_layer_type(rp) if lt is None else None
        for key in [k for k, v in sets.items() if v is not None] if sets else [lt]:
            base = rp if key is None else rp[key]
            new = native_rope_parameters(handle, base, getattr(text, "max_position_embeddings", None), lt) \
                if express else None
            if new is None:
                native = False
                new = {**{k: base[k] for k in _KEEP if k in base}, "rope_type": MARKER.format(name=handle.strategy)}
            if key is None:
                rp = new
            else:
                rp[key] = new
    text.rope_parameters = rp
    return config, native


def save_patched(model: Any, tokenizer: Any, output: str | Path, *, state_dict: dict | None = None) -> Path:
    """Write the patched model: the HF files with the patch in ``config.json``, plus ``ropescale.json``.

    Where transformers can express the strategy, plain ``AutoModelForCausalLM.from_pretrained`` of ``output``
    gives the same logits (the transformers engine of ``ropescale.export_for`` checks it); otherwise it fails
    with a ``KeyError`` naming ``ropescale.load_model`` rather than running vanilla RoPE.
    ``ropescale.load_model(output)`` always restores the patched model; ``ropescale.json`` has ``native``
    (which case applies).

    Args:
        model: the patched model (``ropescale.patch``).
        tokenizer: its tokenizer, saved beside it.
        output: the folder to write (created).
        state_dict: the weights to write instead of ``model.state_dict()`` (a sharded model's, gathered).

    Returns:
        ``output`` as a ``Path``.

    Raises:
        ValueError: the model carries no patch.
    """
    handle: PatchHandle | None = current_patch(model)
    if handle is None:
        raise InvalidInput("model is not patched; call ropescale.patch(model, ...) first")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(output)
    config, native = exported_config(model, handle)
    config.save_pretrained(output)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    record = handle.to_dict() | {"native": native, "base_rope_parameters": text.rope_parameters}
    (output / PATCH_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return output


def save_unexpressed(model, output: str | Path) -> Path:
    """Rewrite a ``save_patched`` folder of ``model`` (its patch still active) so that plain
    ``from_pretrained`` refuses it (``MARKER`` in config.json, ``native: false`` in ``ropescale.json``)
    while ``ropescale.load_model`` still restores the patch: for an export whose transformers rope
    parameters turned out not to reproduce the patch. ``max_position_embeddings`` as the folder has
    it is kept. Raises ``InvalidInput`` when the model carries no patch."""
    handle: PatchHandle | None = current_patch(model)
    if handle is None:
        raise InvalidInput("model is not patched; call ropescale.patch(model, ...) first")
    output = Path(output)
    saved = json.loads((output / "config.json").read_text(encoding="utf-8"))
    config, _ = exported_config(model, handle, express=False)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    saved_text = saved.get("text_config", saved) if text is not config else saved
    if "max_position_embeddings" in saved_text:
        text.max_position_embeddings = saved_text["max_position_embeddings"]
    config.save_pretrained(output)
    record = json.loads((output / PATCH_FILE).read_text(encoding="utf-8")) | {"native": False}
    (output / PATCH_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return output


def save_adapter(model, tokenizer, output: str | Path) -> Path:
    """Write a LoRA-trained model (a PEFT ``PeftModel`` over a patched base model) as an adapter
    folder: PEFT's ``adapter_config.json`` + ``adapter_model.safetensors`` (the LoRA matrices and
    any ``modules_to_save``), the tokenizer, and ``ropescale.json`` recording the patch (with
    ``adapter: true``). ``ropescale.load_model(output)`` rebuilds it: base model, patch, adapter.
    Raises ``ValueError`` when the model is not a PEFT model or carries no patch."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise InvalidInput(f"save_adapter needs a PEFT model; got {type(model).__name__} (use save_patched)")
    handle: PatchHandle | None = current_patch(model)
    if handle is None:
        raise InvalidInput("model is not patched; call ropescale.patch(model, ...) first")
    base = model.peft_config[model.active_adapter].base_model_name_or_path
    if not base:
        raise InvalidInput("the PEFT model records no base_model_name_or_path; its adapter could not be reloaded")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    config_path = output / ADAPTER_FILE
    adapter_config = json.loads(config_path.read_text(encoding="utf-8"))
    if Path(str(base)).resolve() == REFERENCE_MODEL.resolve():  # the bundled model by name, not this install's path
        adapter_config["base_model_name_or_path"] = "reference"
        config_path.write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    record = handle.to_dict() | {"native": False, "adapter": True, "base_rope_parameters": text.rope_parameters}
    (output / PATCH_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return output

"""Express a patch as transformers ``rope_parameters`` so plain ``from_pretrained`` reproduces it.

Strategies transformers implements are written natively by their registry ``export`` hook (beside
each strategy in ``ropescale.strategies``): ``vanilla`` (``default``), ``ntk`` (a raised
``rope_theta``: b·s^(d/(d−2))), ``linear``, ``dynamic_ntk`` (``dynamic``; only when L_train is
``max_position_embeddings``, which transformers' formula uses), ``yarn``, ``llama3``, ``longrope``.
Attention factors are written explicitly so no default can drift. For any other strategy the
rope type is set to a marker that transformers refuses to build (``KeyError`` naming
``ropescale.load_model``) instead of silently running vanilla RoPE.
"""

from __future__ import annotations

import copy
from typing import Any

from ropescale.patching import PatchHandle

__all__ = ["MARKER", "exported_config", "native_rope_parameters"]

MARKER = "ropescale:{name} (not a transformers rope type: load with ropescale.load_model)"
_KEEP = ("rope_theta", "partial_rotary_factor")


def native_rope_parameters(handle: PatchHandle, base: dict[str, Any], max_position_embeddings: int | None,
                           layer_type: str | None = None) -> dict[str, Any] | None:
    """The transformers ``rope_parameters`` equivalent to ``handle`` for one layer type (its
    ``base`` parameters' ``rope_theta``/``partial_rotary_factor`` kept, the rest from the
    strategy's ``export`` hook, from that type's own context: Gemma 3's sliding and full layers
    have different ``rope_theta``), or None when transformers cannot express it (no hook, the
    hook says so, or a ``dynamic_block``/``logn`` option transformers has no equivalent for)."""
    if handle.options.get("dynamic_block", 1) != 1 or handle.options.get("logn") or handle.options.get("temperature"):
        return None
    export = handle.strategy_obj.export
    if export is None:
        return None
    ctx = handle.contexts.get(layer_type, handle.context)
    written = export(dict(handle.params), dict(ctx), dict(base), max_position_embeddings)
    if written is None:
        return None
    return {**{k: base[k] for k in _KEEP if k in base}, **written}


def exported_config(model, handle: PatchHandle):
    """``(config, native)``: a copy of the model's config carrying the patch, and whether plain
    transformers reproduces it."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rp = copy.deepcopy(text.rope_parameters)
    native = True
    for lt in handle.layer_types:
        base = rp if lt is None else rp[lt]
        new = native_rope_parameters(handle, base, getattr(text, "max_position_embeddings", None), lt)
        if new is None:
            native = False
            new = {**{k: base[k] for k in _KEEP if k in base}, "rope_type": MARKER.format(name=handle.strategy)}
        if lt is None:
            rp = new
        else:
            rp[lt] = new
    text.rope_parameters = rp
    return config, native

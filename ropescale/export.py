"""Express a patch as transformers ``rope_parameters`` so plain ``from_pretrained`` reproduces it.

Strategies transformers implements are written natively: ``vanilla`` (``default``), ``ntk`` (a
raised ``rope_theta``: b·s^(d/(d−2))), ``linear``, ``dynamic_ntk`` (``dynamic``; only when L_train is
``max_position_embeddings``, which transformers' formula uses), ``yarn``, ``llama3``, ``longrope``.
Attention factors are written explicitly so no default can drift. For any other strategy the
rope type is set to a marker that transformers refuses to build (``KeyError`` naming
``ropescale.load_model``) instead of silently running vanilla RoPE.
"""

from __future__ import annotations

import copy
from typing import Any

from ropescale.patching import PatchHandle

__all__ = ["native_rope_parameters", "exported_config", "MARKER"]

MARKER = "ropescale:{name} (not a transformers rope type: load with ropescale.load_model)"
_KEEP = ("rope_theta", "partial_rotary_factor")


def native_rope_parameters(handle: PatchHandle, base: dict[str, Any], max_position_embeddings: int | None,
                           layer_type: str | None = None) -> dict[str, Any] | None:
    """The transformers ``rope_parameters`` equivalent to ``handle`` for one layer type (its
    ``base`` parameters updated, from that type's own context: Gemma 3's sliding and full layers
    have different ``rope_theta``), or None when transformers cannot express it."""
    p, name = handle.params, handle.strategy
    ctx = handle.contexts.get(layer_type, handle.context)
    keep = {k: base[k] for k in _KEEP if k in base}
    orig = ctx["original_max_position_embeddings"]
    if handle.options.get("dynamic_block", 1) != 1 or handle.options.get("logn"):
        return None
    if name == "vanilla":
        return {**keep, "rope_type": "default"}
    if name == "ntk":
        d = ctx["dim"]
        return {**keep, "rope_type": "default", "rope_theta": ctx["rope_theta"] * p["factor"] ** (d / (d - 2))}
    if name == "linear":
        return {**keep, "rope_type": "linear", "factor": p["factor"]}
    if name == "dynamic_ntk":
        if orig != max_position_embeddings:
            return None
        return {**keep, "rope_type": "dynamic", "factor": p["factor"]}
    strat = handle.strategy_obj
    if name == "yarn":
        _, attention = strat.compute(ctx, p)
        return {**keep, "rope_type": "yarn", "factor": p["factor"], "beta_fast": p["beta_fast"],
                "beta_slow": p["beta_slow"], "attention_factor": attention,
                "original_max_position_embeddings": orig, "truncate": True}
    if name == "llama3":
        return {**keep, "rope_type": "llama3", "factor": p["factor"], "low_freq_factor": p["low_freq_factor"],
                "high_freq_factor": p["high_freq_factor"], "original_max_position_embeddings": orig}
    if name == "longrope":
        _, attention = strat.compute({**ctx, "seq_len": orig + 1}, p)
        return {**keep, "rope_type": "longrope", "short_factor": p["short_factor"], "long_factor": p["long_factor"],
                "factor": p["factor"], "attention_factor": attention, "original_max_position_embeddings": orig}
    return None


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

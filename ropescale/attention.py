"""Attention-side rules, plugged in through transformers' ``AttentionInterface``.

An attention function registered under a new name receives, per layer, ``query``
``[b, n_h, s_q, h_d]`` and ``key``/``value`` ``[b, n_kv, s_k, h_d]`` *after* RoPE (and after the
cache update), plus ``position_ids`` ``[b, s_q]`` among its keyword arguments. We wrap the model's
own implementation (``sdpa``, or the modeling file's ``eager_attention_forward``) and register
the same mask function under the new name — otherwise transformers hands a new name no mask.

log-n scaling (Su 2023, "Scaling attention by log n"; bojone/rerope): queries at position p
are multiplied by max(1, ln(p + 1) / ln(L_train)), keeping attention entropy roughly constant as
the context grows past the training window. Positions inside the window are untouched.
"""

from __future__ import annotations

import math
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["logn_factor", "enable_logn", "LOGN_PREFIX", "AttentionNotPluggableError", "check_routed"]

LOGN_PREFIX = "ropescale_logn_"
_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
_TRAIN_LENGTH: dict[int, int] = {}  # id(config) → L_train of models with log-n scaling on
_CALLS = {"n": 0}


class AttentionNotPluggableError(ValueError):
    """The model's attention does not go through transformers' AttentionInterface."""


def check_routed(model, name: str) -> None:
    """Run a 2-token forward and make sure the attention function ``name`` was called.

    Some families (Falcon in transformers 5.x) compute attention themselves; a registered
    function would then be silently ignored. Raises ``AttentionNotPluggableError``.
    """
    before = _CALLS["n"]
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    if _CALLS["n"] == before:
        raise AttentionNotPluggableError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            f"(its layers never called {name!r}); attention-side strategies cannot be applied to it")


def logn_factor(position_ids: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """max(1, ln(p + 1) / ln(L_train)) for positions ``[b, s]`` → ``[b, s]`` float32."""
    scale = torch.log(position_ids.float() + 1) / math.log(original_max_position_embeddings)
    return scale.clamp(min=1.0)


def _base_attention(module, base: str):
    if base == "eager":  # every modeling file defines its own eager function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _logn_attention(module, query, key, value, attention_mask, **kwargs):
    _CALLS["n"] += 1
    base = module.config._attn_implementation.removeprefix(LOGN_PREFIX)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"log-n scaling needs position_ids in the attention call; "
                           f"{type(module).__name__} does not pass them")
    scale = logn_factor(position_ids, _TRAIN_LENGTH[id(module.config)]).to(query.dtype)  # [b, s_q]
    query = query * scale[:, None, :, None]  # [b, n_h, s_q, h_d]
    return _base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)


for _base, _mask in _MASKS.items():
    AttentionInterface.register(LOGN_PREFIX + _base, _logn_attention)
    AttentionMaskInterface.register(LOGN_PREFIX + _base, _mask)


def enable_logn(model, original_max_position_embeddings: int):
    """Switch ``model`` to log-n-scaled attention; returns a function that switches it back.

    Raises ``ValueError`` when the model's attention is neither ``sdpa`` nor ``eager``, naming
    what it uses, and ``AttentionNotPluggableError`` when it bypasses the interface (Falcon).
    """
    config = model.config
    current = config._attn_implementation
    if current not in _MASKS:
        raise ValueError(f"log-n scaling wraps sdpa or eager attention; this model uses {current!r} "
                         "(load it with attn_implementation='sdpa')")
    _TRAIN_LENGTH[id(config)] = int(original_max_position_embeddings)
    model.set_attn_implementation(LOGN_PREFIX + current)

    def restore() -> None:
        model.set_attn_implementation(current)
        _TRAIN_LENGTH.pop(id(config), None)

    try:
        check_routed(model, LOGN_PREFIX + current)
    except Exception:
        restore()
        raise
    return restore

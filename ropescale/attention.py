"""Attention-side rules, plugged in through transformers' ``AttentionInterface``: log-n query
scaling and the truncation rules (ReRoPE, Leaky ReRoPE, SelfExtend).

An attention function registered under a new name receives, per layer, ``query``
``[b, n_h, s_q, h_d]`` and ``key``/``value`` ``[b, n_kv, s_k, h_d]`` *after* RoPE (and after the
cache update), plus ``position_ids`` ``[b, s_q]`` among its keyword arguments. We wrap the model's
own implementation (``sdpa``, or the modeling file's ``eager_attention_forward``) and register
the same mask function under the new name — otherwise transformers hands a new name no mask.

log-n scaling (Su 2023, "Scaling attention by log n"; bojone/rerope): queries at position p
are multiplied by max(1, ln(p + 1) / ln(L_train)), keeping attention entropy roughly constant as
the context grows past the training window. Positions inside the window are untouched.

Truncation rules need q and k *un-rotated*: ``patch`` swaps the rotary module for
``IdentityRotary`` (cos = 1, sin = 0, so the model's own ``apply_rotary_pos_emb`` is a no-op and
the KV cache holds un-rotated keys) and ``ropescale_truncation`` rotates them itself, per region
(``ropescale.truncated_attention``). Query positions come from ``position_ids``; key positions
from slot order (the last key is the last query), which also holds with left padding and a
(sliding-window) cache.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, prepare_padding_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ropescale.strategies.truncation import RelativeRule
from ropescale.flex_regions import flex_attention_path
from ropescale.truncated_attention import blocked_attention, fused_attention, naive_attention

__all__ = ["logn_factor", "enable_logn", "enable_truncation", "IdentityRotary", "LOGN_PREFIX",
           "TRUNCATION", "ATTENTION_PATHS", "AttentionNotPluggableError", "check_routed"]

LOGN_PREFIX = "ropescale_logn_"
_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
_LOGN_ATTR = "_ropescale_logn"  # on each submodule while log-n is on: L_train
_TRUNCATION_ATTR = "_ropescale_truncation"  # on each submodule while a truncation rule is on
_CALLS = {"n": 0}


def _set_on_modules(model, attr: str, value) -> None:
    """State for the attention function on every submodule: the function receives the attention
    layer, which reads it there (a model's parts may hold different config objects, as
    Gemma 3's multimodal class does, so nothing is keyed by config)."""
    for m in model.modules():
        setattr(m, attr, value)


def _clear_on_modules(model, attr: str) -> None:
    for m in model.modules():
        if attr in m.__dict__:
            delattr(m, attr)


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
    scale = logn_factor(position_ids, getattr(module, _LOGN_ATTR)).to(query.dtype)  # [b, s_q]
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
    _set_on_modules(model, _LOGN_ATTR, int(original_max_position_embeddings))
    model.set_attn_implementation(LOGN_PREFIX + current)

    def restore() -> None:
        model.set_attn_implementation(current)
        _clear_on_modules(model, _LOGN_ATTR)

    try:
        check_routed(model, LOGN_PREFIX + current)
    except Exception:
        restore()
        raise
    return restore


TRUNCATION = "ropescale_truncation"
_PATHS = {"fused": fused_attention, "flex": flex_attention_path, "blocked": blocked_attention,
          "naive": naive_attention}
ATTENTION_PATHS = tuple(_PATHS)


@dataclass
class _Truncation:
    rule: RelativeRule
    freqs: dict  # layer type (None: all) → (inv_freq [d/2], attention_scaling)
    interleaved: bool
    path: str  # a key of _PATHS: "fused", "flex", "blocked" or "naive"
    block: int
    logn: int | None  # L_train when log-n scaling is on



class IdentityRotary(nn.Module):
    """Rotary module returning cos = 1, sin = 0 ``[b, s, d]``: RoPE becomes a no-op, so attention
    receives (and the cache stores) un-rotated q and k. ``dims`` maps layer type → d."""

    def __init__(self, dims: dict, keep_float32: bool):
        super().__init__()
        self.dims, self.keep_float32 = dims, keep_float32

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
        d = self.dims[layer_type if layer_type in self.dims else next(iter(self.dims))]
        dtype = torch.float32 if self.keep_float32 else x.dtype
        ones = torch.ones(*position_ids.shape, d, dtype=dtype, device=x.device)  # [b, s, d]
        return ones, torch.zeros_like(ones)


def _keep_mask(attention_mask):
    """transformers' mask (None, bool keep-mask, or additive float) → bool keep-mask or None."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _truncation_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          softcap=None, sliding_window=None, **kwargs):
    _CALLS["n"] += 1
    state = getattr(module, _TRUNCATION_ATTR)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"truncation rules need position_ids in the attention call; "
                           f"{type(module).__name__} does not pass them")
    b, s_k = query.shape[0], key.shape[2]
    q_pos = position_ids.expand(b, -1).float()  # [b, s_q]
    if s_k == q_pos.shape[1]:  # no cache: the keys are the queries
        k_pos = q_pos
    else:  # cached keys: positions by slot, counting back from the last query's
        offset = (s_k - 1) - q_pos[:, -1:]  # slot of the last key minus its position
        k_pos = torch.arange(s_k, device=query.device).float()[None] - offset  # [b, s_k]
    if state.logn:
        query = query * logn_factor(q_pos, state.logn).to(query.dtype)[:, None, :, None]
    layer_type = getattr(module, "layer_type", None)
    inv_freq, att = state.freqs.get(layer_type, next(iter(state.freqs.values())))
    fn = _PATHS[state.path]
    out = fn(query, key, value, q_pos, k_pos, state.rule, inv_freq.to(query.device), att,
             keep=_keep_mask(attention_mask), scale=scaling or query.shape[-1] ** -0.5, softcap=softcap,
             sliding_window=sliding_window, interleaved=state.interleaved, dropout=dropout, block=state.block)
    return out.transpose(1, 2).contiguous(), None  # [b, s_q, n_h, h_d]


def _padding_only_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **_):
    """Mask function for the truncation rules: only which keys are real tokens, ``[b, 1, 1, s_k]``
    bool, or None without padding. The kernel applies causality and sliding windows itself, so
    no ``[b, 1, s_q, s_k]`` mask is ever built (transformers builds one for sliding layers)."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return None
    padding = padding[:, kv_offset : kv_offset + kv_length].bool()
    return None if bool(padding.all()) else padding[:, None, None, :]


AttentionInterface.register(TRUNCATION, _truncation_attention)
AttentionMaskInterface.register(TRUNCATION, _padding_only_mask)


def enable_truncation(model, rule: RelativeRule, freqs: dict, *, interleaved: bool, path: str,
                      block: int, logn: int | None):
    """Route ``model``'s attention through the truncation rule; returns the undo function.

    The caller has already made the rotary module an ``IdentityRotary``. Raises
    ``AttentionNotPluggableError`` when the model's layers bypass the interface.
    """
    config = model.config
    current = config._attn_implementation
    _set_on_modules(model, _TRUNCATION_ATTR, _Truncation(rule, freqs, interleaved, path, block, logn))
    model.set_attn_implementation(TRUNCATION)

    def restore() -> None:
        model.set_attn_implementation(current)
        _clear_on_modules(model, _TRUNCATION_ATTR)

    try:
        check_routed(model, TRUNCATION)
    except Exception:
        restore()
        raise
    return restore

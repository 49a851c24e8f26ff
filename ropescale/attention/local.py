"""Sliding-window layers at O(n·w) on the CPU: the model's own attention without an n × n mask.

transformers' ``sdpa`` attention gets its masks from the model: for a sliding-window layer (Gemma 2/3/4,
gpt-oss, Mistral, Qwen2 with ``use_sliding_window``, Cohere2, …) a ``[b, 1, n, n]`` bool mask, which
PyTorch's SDPA turns into a float one before its kernel runs — 5 bytes per (query, key) pair, 20 GiB at
65,536 tokens — and a kernel that then computes all n² scores to keep n·w of them. On Gemma 3 270M at
8,192 tokens the 15 sliding layers take two thirds of a forward (45 of 67 s on 2 cores).

``ropescale_local`` is the same attention with the masks left out: registered with transformers'
``AttentionInterface`` and a mask function that builds padding only (``[b, 1, 1, s_k]`` or None), it
runs PyTorch's fused CPU flash kernel over the keys each query can see
(``ropescale.attention.regions``): a causal call for a full-attention layer, the window band —
queries in blocks over a strided view of the keys — for a sliding one; causality and the window are
read from slot order (the last key is the last query), so a KV cache, a cached sliding window and
left padding are handled as transformers handles them. Attention sinks (gpt-oss's ``s_aux``) merge as one
more log-sum-exp term. Memory O(n·w); nothing is synchronised with the host.

Shapes: b batch, n_h query heads, n_kv key/value heads, s_q queries, s_k keys, h_d head dim; w the
layer's ``sliding_window`` [tokens] (a query sees the keys at distance 0 … w − 1, as transformers'
``sliding_window_overlay``).

``enable_local_attention`` switches a model to it only where it is exact and helps: on the CPU, from
``sdpa``, for a model with sliding-window layers and without attention soft-capping; and only after
one forward of w + 17 tokens gives the model's own hidden states (within 1e-4 of their largest entry
in float32, 2e-2 in bfloat16) — a model whose layers read anything else from the mask (an indexer, a
bidirectional block) fails that check and keeps ``sdpa``. The run harness enables it for evaluation
runs; training keeps the model's implementation.

Source: the band decomposition and log-sum-exp merge are flash attention's (Dao et al. 2022,
arXiv:2205.14135); the window semantics are transformers' ``masking_utils.sliding_window_overlay``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ropescale.attention.interface import keep_mask, padding_only_mask
from ropescale.attention.regions import RegionAttention, RegionPlan, band_calls, causal_calls, near_block

__all__ = ["LOCAL", "enable_local_attention", "local_attention"]

LOCAL = "ropescale_local"
_CHECK_EXTRA = 17  # tokens past the window in the enabling check: every band call kind runs
_TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _same(x: torch.Tensor, _side: str, _region: int, inverse: bool = False) -> torch.Tensor:
    """The rotation ``RegionAttention`` applies per region: none (q and k come rotated by the model)."""
    return x


def local_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    **kwargs):
    """``query`` ``[b, n_h, s_q, h_d]``, ``key``/``value`` ``[b, n_kv, s_k, h_d]`` (after RoPE and the cache
    update) → ``([b, s_q, n_h, h_v], None)``, as transformers' attention functions return. ``attention_mask``
    is padding only (``[b, 1, 1, s_k]``) or None; a full ``[b, 1, s_q, s_k]`` mask (a model that built its
    own, or a probe's) goes to ``sdpa`` with it, unchanged."""
    keep = keep_mask(attention_mask)
    if (keep is not None and keep.shape[-2] != 1) or dropout or kwargs.get("softcap") or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    s_q, s_k = query.shape[2], key.shape[2]
    if sliding_window and sliding_window < s_k:  # keys at slot distance 0 … w − 1
        calls = band_calls(s_q, s_k, 0, sliding_window, near_block(sliding_window))
    else:
        calls = causal_calls(s_q, s_k, 0)
    if keep is not None:
        keep = keep.expand(query.shape[0], 1, 1, s_k)[:, 0, 0]  # [b, s_k]
    plan = RegionPlan([(0, calls)], s_k - s_q, scaling or query.shape[-1] ** -0.5, keep)
    out = RegionAttention.apply(query, key, value, _same, plan, kwargs.get("s_aux"))  # [b, n_h, s_q, h_v]
    return out.transpose(1, 2).contiguous(), None  # [b, s_q, n_h, h_v]


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _window(model) -> int | None:
    """The model's ``sliding_window`` [tokens] when some of its layers use it, else None."""
    text = _text_config(model)
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    types = getattr(text, "layer_types", None)
    if types:
        return window if any("sliding" in str(t) for t in types) else None
    return window if getattr(text, "use_sliding_window", True) else None


def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the decoder alone: no [s, V] logits
        return model.base_model(input_ids=ids, use_cache=False)[0]  # [1, s, hidden]


def _register() -> None:
    AttentionInterface.register(LOCAL, local_attention)  # on first use, not at import
    AttentionMaskInterface.register(LOCAL, padding_only_mask)


def enable_local_attention(model) -> bool:
    """Switch ``model`` from ``sdpa`` to ``ropescale_local`` when it is on the CPU, has sliding-window
    layers and no attention soft-capping, and a forward of w + 17 tokens gives its own hidden states
    (see the module docstring); returns whether it did. ``model.set_attn_implementation("sdpa")``
    switches it back. Raises nothing: a model it does not fit keeps its implementation."""
    window = _window(model)
    params = next(model.parameters(), None)
    if (window is None or params is None or params.device.type != "cpu"
            or getattr(model.config, "_attn_implementation", None) != "sdpa"
            or getattr(_text_config(model), "attn_logit_softcapping", None)
            or not getattr(model, "_can_set_attn_implementation", lambda: True)()):
        return False
    _register()
    vocab = int(getattr(_text_config(model), "vocab_size", 0) or 2)
    ids = torch.arange(window + _CHECK_EXTRA, device=params.device)[None] * 7919 % vocab  # [1, w + 17]
    try:
        before = _hidden(model, ids)
        model.set_attn_implementation(LOCAL)
        after = _hidden(model, ids)
    except Exception:  # noqa: BLE001 — a model this path cannot drive keeps its own
        model.set_attn_implementation("sdpa")
        return False
    tol = _TOL.get(before.dtype, 1e-4) * max(float(before.abs().max()), 1e-6)
    if not bool((after.float() - before.float()).abs().max() <= tol):
        model.set_attn_implementation("sdpa")
        return False
    return True

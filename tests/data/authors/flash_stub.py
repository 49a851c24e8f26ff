"""A CPU stand-in for the ``flash_attn`` package, so the authors' code (written for flash-attn 2.5–2.7 on
CUDA) runs here unmodified: ``flash_attn_func`` with flash-attn's documented semantics, written out in
float64. Installed by ``install()`` as ``flash_attn``, ``flash_attn.losses.cross_entropy`` and
``flash_attn_2_cuda`` in ``sys.modules`` before their module is imported; the other entry points raise."""

from __future__ import annotations

import sys
import types

import torch


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func``: q ``[b, s_q, h, d]``, k, v ``[b, s_k, h_kv, d]`` (h a multiple of
    h_kv). Query t sees key j when j ≤ t + s_k − s_q (``causal``: bottom-right aligned, flash-attn ≥ 2.1) and
    t + s_k − s_q − left ≤ j ≤ t + s_k − s_q + right for ``window_size`` (left, right), −1 unbounded. Returns
    the output ``[b, s_q, h, d]`` in q's dtype, and with ``return_attn_probs`` also the log-sum-exp of each
    row ``[b, h, s_q]`` float32 (+inf and output 0 on a row that sees no key, as flash-attn) and None."""
    if dropout_p:
        raise NotImplementedError("the stand-in has no dropout")
    s_q, h, d = q.shape[1:]
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qd = q.double().transpose(1, 2)  # [b, h, s_q, d]
    kd = k.double().transpose(1, 2).repeat_interleave(h // h_kv, 1)
    vd = v.double().transpose(1, 2).repeat_interleave(h // h_kv, 1)
    s = qd @ kd.transpose(-1, -2) * scale  # [b, h, s_q, s_k]
    shift = torch.arange(s_q)[:, None] + (s_k - s_q)  # the key slot aligned with each query
    j = torch.arange(s_k)[None, :]
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        seen &= j <= shift + right
    if left >= 0:
        seen &= j >= shift - left
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [b, h, s_q]
    p = torch.nan_to_num((s - lse[..., None]).exp())
    out = (p @ vd).transpose(1, 2).to(q.dtype)
    if not return_attn_probs:
        return out
    return out, lse.masked_fill(~seen.any(-1), float("inf")).float(), None


def _missing(*_, **__):
    raise NotImplementedError("not provided by the CPU stand-in of flash_attn")


def install() -> None:
    """Put the stand-in modules in ``sys.modules``."""
    fa = types.ModuleType("flash_attn")
    fa.flash_attn_func = flash_attn_func
    fa.flash_attn_with_kvcache = fa.flash_attn_varlen_func = _missing
    fa.__version__ = "2.7.0"
    losses = types.ModuleType("flash_attn.losses")
    ce = types.ModuleType("flash_attn.losses.cross_entropy")
    ce.CrossEntropyLoss = torch.nn.CrossEntropyLoss
    fa.losses = losses
    losses.cross_entropy = ce
    cuda = types.ModuleType("flash_attn_2_cuda")
    sys.modules.update({"flash_attn": fa, "flash_attn.losses": losses, "flash_attn.losses.cross_entropy": ce,
                        "flash_attn_2_cuda": cuda})

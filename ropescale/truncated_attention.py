"""Exact attention under a truncation rule (``ropescale.strategies.truncation``), three ways.

All take *un-rotated* queries ``q`` ``[b, n_h, s_q, h_d]`` and keys/values ``k``, ``v``
``[b, n_kv, s_k, h_d]`` (n_h a multiple of n_kv: grouped-query attention), float positions
``q_pos`` ``[b, s_q]`` and ``k_pos`` ``[b, s_k]``, the rotary ``inv_freq`` ``[d/2]`` (d ≤ h_d: only the
first d channels rotate) with its ``attention_scaling`` m, and ``keep`` — None or a bool mask
broadcastable to ``[b, 1, s_q, s_k]`` (padding; causality is added here from slot order, the
last query being the last key; a ``[b, 1, 1, s_k]`` key mask is O(n)). They return
``[b, n_h, s_q, h_d]``. Regions are told apart by slot distance i − j, which equals the position
distance for the positions transformers passes (contiguous per row; left padding only shifts them).

``fused_attention`` is the default path: the far region and the near band each in PyTorch's fused
CPU flash kernel, merged by log-sum-exp, with a backward (``ropescale.two_region``); about the
cost of one vanilla attention.

On other devices ``ropescale.attention``'s ``fused`` path hands over to
``ropescale.flex_regions.flex_attention_path`` (the same two regions in FlexAttention, compiled on
CUDA).

``blocked_attention`` is the general path (soft-capping, attention dropout, per-query masks on
the CPU): query blocks × key blocks with an online softmax (the flash-attention
recurrence). In each block pair the scores are q_near·k_near (both rotated to their own
positions) where i − j < w and q_far·k_far (rotated to f_q(i), f_k(j)) elsewhere, so the two
regions merge exactly inside one softmax. Memory is O(n·block): never an n × n matrix. Out of
place and decided from Python integers, so autograd differentiates it and the host never waits.

``naive_attention`` is the oracle the tests use: the explicit matrix p(i, j), and scores
Σ_f A_f cos(p θ_f) + B_f sin(p θ_f) from the rotation identity, then an eager softmax. O(n²·d).
"""

from __future__ import annotations

import torch

from ropescale.strategies.truncation import RelativeRule
from ropescale.two_region import TwoRegionAttention, _Plan, band_calls, causal_calls, near_block

__all__ = ["blocked_attention", "fused_attention", "fused_route", "naive_attention", "rotate"]

_NEG = -1e30  # running-max start: exp(-inf - _NEG) = 0 without NaN


def _pairs(x: torch.Tensor, d: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two coordinates of each rotary pair: ``[..., d/2]`` each."""
    if interleaved:
        return x[..., 0:d:2], x[..., 1:d:2]
    return x[..., : d // 2], x[..., d // 2 : d]


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, 1, s, d/2]`` for float positions ``pos`` ``[b, s]``, as transformers computes
    them (float32 angles, × ``scaling``, cast to ``dtype``)."""
    angles = pos.float()[..., None] * inv_freq.to(pos.device).float()  # [b, s, d/2]
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first d = 2·cos.shape[-1] channels of ``x`` ``[b, h, s, h_d]``; the rest pass through."""
    d = 2 * cos.shape[-1]
    x1, x2 = _pairs(x, d, interleaved)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return rot if d == x.shape[-1] else torch.cat((rot, x[..., d:]), -1)


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
           interleaved: bool = False) -> torch.Tensor:
    """RoPE on ``x`` ``[b, h, s, h_d]`` at float positions ``pos`` ``[b, s]``, as transformers does
    (float32 angles, cos/sin × ``scaling`` cast to x's dtype); channels past d pass through."""
    return apply_rotation(x, *rope_tables(pos, inv_freq, scaling, x.dtype), interleaved)


class _Rotations:
    """The four rotations of one call — near q and k at their positions, far q at f_q, far k at
    f_k — with cos/sin tables computed once each (shared when q and k have the same positions).
    ``inverse=True`` applies R(−θ) = R(θ)ᵀ: the backward of a rotation."""

    def __init__(self, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, interleaved: bool):
        self.pos = {"q": q_pos, "k": k_pos, "far_q": rule.far_q(q_pos), "far_k": rule.far_k(k_pos)}
        self.inv_freq, self.scaling, self.interleaved = inv_freq, scaling, interleaved
        self.tables: dict[tuple, tuple] = {}

    def __call__(self, x: torch.Tensor, which: str, inverse: bool = False) -> torch.Tensor:
        pos = self.pos[which]
        key = ("q" if which == "k" and pos is self.pos["q"] else which, x.dtype)
        if key not in self.tables:
            self.tables[key] = rope_tables(pos, self.inv_freq, self.scaling, x.dtype)
        cos, sin = self.tables[key]
        return apply_rotation(x, cos, -sin if inverse else sin, self.interleaved)


def _visible(q_slot, k_slot, sliding_window):
    """Causal (and sliding-window) visibility by slot order: ``[s_q, s_k]`` bool."""
    dist = q_slot[:, None] - k_slot[None, :]
    vis = dist >= 0
    if sliding_window:
        vis &= dist < sliding_window
    return vis


def _softcap(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return torch.tanh(s / softcap) * softcap if softcap else s


def _plan(s_q: int, s_k: int, window: int, sliding_window: int | None, scale: float, keep) -> _Plan:
    near_hi = min(window, sliding_window) if sliding_window else window
    if sliding_window is None:
        far = causal_calls(s_q, s_k, window)
    elif sliding_window > window:
        far = band_calls(s_q, s_k, window, sliding_window, near_block(sliding_window - window))
    else:
        far = []
    near = band_calls(s_q, s_k, 0, near_hi, near_block(near_hi))
    return _Plan(far, near, s_k - s_q, scale, None if keep is None else keep[:, 0, 0])


def fused_route(device_type: str, *, softcap: float | None = None, dropout: float = 0.0, keep=None) -> str:
    """Which kernel ``fused_attention`` runs: ``"blocked"`` with attention dropout (any device);
    ``"flex"`` on any other non-CPU device (CUDA: compiled FlexAttention); on the CPU
    ``"blocked"`` for soft-capping or a per-query ``keep`` mask, else ``"two_region"``."""
    if dropout:
        return "blocked"
    if device_type != "cpu":
        return "flex"
    if softcap or (keep is not None and keep.shape[-2] != 1):
        return "blocked"
    return "two_region"


def fused_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *, keep=None,
                    scale: float, softcap: float | None = None, sliding_window: int | None = None,
                    interleaved: bool = False, dropout: float = 0.0, block: int = 512) -> torch.Tensor:
    """The two regions in fused CPU flash kernels (``ropescale.two_region``), with backward.
    Where that kernel cannot follow (``fused_route`` other than ``"two_region"``: soft-capping,
    attention dropout or a per-query ``keep`` mask, or a device other than the CPU),
    ``blocked_attention``. The ``"fused"`` attention path (``ropescale.attention``) sends other
    devices to FlexAttention (``ropescale.flex_regions``) before this."""
    if fused_route(q.device.type, softcap=softcap, dropout=dropout, keep=keep) != "two_region":
        return blocked_attention(q, k, v, q_pos, k_pos, rule, inv_freq, scaling, keep=keep, scale=scale,
                                 softcap=softcap, sliding_window=sliding_window, interleaved=interleaved,
                                 dropout=dropout, block=block)
    plan = _plan(q.shape[2], k.shape[2], rule.window, sliding_window, scale, keep)
    rotations = _Rotations(q_pos, k_pos, rule, inv_freq, scaling, interleaved)
    return TwoRegionAttention.apply(q, k, v, rotations, plan)


def blocked_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *,
                      keep=None, scale: float, softcap: float | None = None,
                      sliding_window: int | None = None, interleaved: bool = False, dropout: float = 0.0,
                      block: int = 512) -> torch.Tensor:
    b, n_h, s_q, h_d = q.shape
    n_kv, s_k = k.shape[1], k.shape[2]
    g, c0, w = n_h // n_kv, s_k - s_q, rule.window

    def grouped(x):  # [b, n_h, s, h_d] → [b, n_kv, g, s, h_d]
        return x.view(b, n_kv, g, x.shape[2], h_d)

    q_near = grouped(rotate(q, q_pos, inv_freq, scaling, interleaved))
    q_far = grouped(rotate(q, rule.far_q(q_pos), inv_freq, scaling, interleaved))
    k_near = rotate(k, k_pos, inv_freq, scaling, interleaved)[:, :, None]  # [b, n_kv, 1, s_k, h_d]
    k_far = rotate(k, rule.far_k(k_pos), inv_freq, scaling, interleaved)[:, :, None]
    v = v[:, :, None]
    q_slot = torch.arange(c0, s_k, device=q.device)
    k_slot = torch.arange(s_k, device=q.device)
    rows = []
    for qs in range(0, s_q, block):
        qe = min(qs + block, s_q)
        m = torch.full((b, n_kv, g, qe - qs, 1), _NEG, dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, n_kv, g, qe - qs, h_d, dtype=torch.float32, device=q.device)
        first = max(0, c0 + qs - sliding_window + 1) if sliding_window else 0
        for ks in range(first // block * block, c0 + qe, block):
            ke = min(ks + block, s_k)
            # the region(s) a block pair touches, from slot distances: Python integers, no host sync
            lo, hi = c0 + qs - (ke - 1), c0 + qe - 1 - ks
            dist = q_slot[qs:qe, None] - k_slot[None, ks:ke]  # [Bq, Bk]
            if hi < w:
                s = q_near[..., qs:qe, :] @ k_near[..., ks:ke, :].transpose(-1, -2)
            elif lo >= w:
                s = q_far[..., qs:qe, :] @ k_far[..., ks:ke, :].transpose(-1, -2)
            else:
                s = torch.where(dist < w, q_near[..., qs:qe, :] @ k_near[..., ks:ke, :].transpose(-1, -2),
                                q_far[..., qs:qe, :] @ k_far[..., ks:ke, :].transpose(-1, -2))
            s = _softcap(s.float() * scale, softcap)  # [b, n_kv, g, Bq, Bk]
            if lo < 0 or (sliding_window and hi >= sliding_window) or keep is not None:  # masks only where needed
                vis = (dist >= 0) & (dist < sliding_window) if sliding_window else dist >= 0
                if keep is not None:
                    blk = keep[..., ks:ke] if keep.shape[-2] == 1 else keep[..., qs:qe, ks:ke]
                    vis = vis & blk[:, :, None]  # [b, 1, 1, Bq, Bk]
                s = s.masked_fill(~vis, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = (s - m_new).exp()
            alpha = (m - m_new).exp()
            l = l * alpha + p.sum(-1, keepdim=True)
            if dropout:  # on the weights, not the normaliser: softmax first, then dropout
                p = torch.nn.functional.dropout(p, dropout)
            acc = acc * alpha + p @ v[..., ks:ke, :].float()
            m = m_new
        rows.append((acc / l.clamp_min(1e-30)).to(q.dtype))  # fully masked rows → 0
    return torch.cat(rows, -2).view(b, n_h, s_q, h_d)


def naive_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *,
                    keep=None, scale: float, softcap: float | None = None,
                    sliding_window: int | None = None, interleaved: bool = False, **_) -> torch.Tensor:
    n_h, s_q = q.shape[1], q.shape[2]
    n_kv, s_k = k.shape[1], k.shape[2]
    d = 2 * inv_freq.numel()
    k = k.repeat_interleave(n_h // n_kv, dim=1).float()  # [b, n_h, s_k, h_d]
    v = v.repeat_interleave(n_h // n_kv, dim=1).float()
    q = q.float()
    p = rule.relative_positions(q_pos.float(), k_pos.float())  # [b, s_q, s_k]
    angle = p[..., None] * inv_freq.float()  # [b, s_q, s_k, d/2]
    q1, q2 = _pairs(q, d, interleaved)  # [b, n_h, s_q, d/2]
    k1, k2 = _pairs(k, d, interleaved)
    # R(a)q · R(b)k with a − b = p: Σ_f (q1 k1 + q2 k2) cos(pθ_f) + (q1 k2 − q2 k1) sin(pθ_f)
    A = torch.einsum("bhif,bhjf->bhijf", q1, k1) + torch.einsum("bhif,bhjf->bhijf", q2, k2)
    B = torch.einsum("bhif,bhjf->bhijf", q1, k2) - torch.einsum("bhif,bhjf->bhijf", q2, k1)
    rotary = (A * angle.cos()[:, None] + B * angle.sin()[:, None]).sum(-1) * scaling**2
    s = (rotary + q[..., d:] @ k[..., d:].transpose(-1, -2)) * scale  # [b, n_h, s_q, s_k]
    s = _softcap(s, softcap)
    vis = _visible(torch.arange(s_k - s_q, s_k), torch.arange(s_k), sliding_window)
    if keep is not None:
        vis = vis & keep
    s = s.masked_fill(~vis, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1)) @ v  # fully masked rows → 0

"""Exact attention under a relative-position rule (``ropescale.strategies.relative``), three ways.

All take *un-rotated* queries ``q`` ``[b, n_h, s_q, h_d]`` and keys/values ``k``, ``v``
``[b, n_kv, s_k, h_d]`` (n_h a multiple of n_kv: grouped-query attention), float positions
``q_pos`` ``[b, s_q]`` and ``k_pos`` ``[b, s_k]``, the rotary ``inv_freq`` ``[d/2]`` (d ≤ h_d: only the
first d channels rotate) with its ``attention_scaling`` m, and ``keep`` — None or a bool mask
broadcastable to ``[b, 1, s_q, s_k]`` (padding; causality is added here from slot order, the
last query being the last key; a ``[b, 1, 1, s_k]`` key mask is O(n)). They return
``[b, n_h, s_q, h_d]``. Distance regions are told apart by slot distance i − j, which equals the
position distance for the positions transformers passes (contiguous per row; left padding only
shifts them); chunk regions by position = slot + the row's offset (``slot_offsets``).

``fused_attention`` is the default path: each region in PyTorch's fused CPU flash kernel,
merged by log-sum-exp, with a backward (``ropescale.attention.regions``); about the cost of one vanilla
attention.

On other devices ``ropescale.attention``'s ``fused`` path hands over to
``ropescale.attention.flex.flex_attention_path`` (the same regions in FlexAttention, compiled on
CUDA).

``blocked_attention`` is the general path (soft-capping, attention dropout, per-query masks, chunk
rules under a sliding window): query blocks × key blocks with an online softmax (the
flash-attention recurrence). In each block pair the scores are those of the region holding each
(i, j) — q and k rotated as that region places them —, so the regions merge exactly inside one
softmax; a block pair inside one distance region computes that region alone. Memory is
O(n·block): never an n × n matrix. Out of place and decided from Python integers, so autograd
differentiates it and the host never waits.

``naive_attention`` is the oracle the tests use: the explicit matrix p(i, j), and scores
Σ_f A_f cos(p θ_f) + B_f sin(p θ_f) from the rotation identity, then an eager softmax, all in
float64 (the rule's exact value, not another float32 rounding of it). O(n²·d) time, O(n²) memory.
"""

from __future__ import annotations

import torch

from ropescale.attention.regions import RegionAttention, RegionPlan, band_calls, causal_calls, chunk_calls, near_block
from ropescale.strategies.relative import Blend, Region, RelativeRule, pair_groups, per_pair

__all__ = ["blocked_attention", "fused_attention", "fused_route", "naive_attention", "rotate", "slot_offsets"]

_NEG = -1e30  # running-max start: exp(-inf - _NEG) = 0 without NaN


def _pairs(x: torch.Tensor, d: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two coordinates of each rotary pair: ``[..., d/2]`` each."""
    if interleaved:
        return x[..., 0:d:2], x[..., 1:d:2]
    return x[..., : d // 2], x[..., d // 2 : d]


def rope_tables(pos: torch.Tensor | Blend, inv_freq: torch.Tensor, scaling: float, dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, 1, s, d/2]`` for float positions ``pos`` ``[b, s]``, as transformers computes
    them (float32 angles, × ``scaling``, cast to ``dtype``); positions per pair group ``[b, s, G]``
    turn each pair by its group's (``per_pair``); a ``Blend`` gives the blend's complex factor per
    pair, (1 − w)·(cos a·θ, sin a·θ) + w·(cos b·θ, sin b·θ), in float32 (w in float32: GALI's
    ``rel_coef`` in the model's dtype). The rotation with these tables is linear but not orthogonal;
    its transpose (the backward) is still the rotation with −sin."""
    if isinstance(pos, Blend):
        (cos_a, sin_a), (cos_b, sin_b) = (_unit_tables(x, inv_freq) for x in (pos.a, pos.b))
        w = pos.w.float()[..., None]  # [b, s, 1]
        cos, sin = cos_a * (1 - w) + cos_b * w, sin_a * (1 - w) + sin_b * w
    else:
        cos, sin = _unit_tables(pos, inv_freq)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _unit_tables(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, s, d/2]`` float32 of the angles p·θ_f (float32, as transformers), p ``[b, s]`` or per
    pair group ``[b, s, G]``."""
    inv = inv_freq.to(pos.device).float()
    angles = per_pair(pos.float(), inv.numel()) * inv  # [b, s, d/2]
    return angles.cos(), angles.sin()


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
    """The rotations of one call — region r's queries at q_at_r(i), keys at k_at_r(j) — with cos/sin
    tables computed once per distinct position map (shared by regions and by q and k when their
    positions are the same tensor). ``inverse=True`` applies R(−θ) = R(θ)ᵀ: the backward of a
    rotation."""

    def __init__(self, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, interleaved: bool):
        self.q_pos, self.k_pos, self.regions = q_pos, k_pos, rule.regions
        self.inv_freq, self.scaling, self.interleaved = inv_freq, scaling, interleaved
        self.positions: dict[tuple, torch.Tensor] = {}
        self.tables: dict[tuple, tuple] = {}

    def _positions(self, side: str, region: int) -> tuple[tuple, torch.Tensor]:
        f = getattr(self.regions[region], f"{side}_at")
        pos = self.q_pos if side == "q" else self.k_pos
        if f is None:  # the identity: keys share the queries' tables when they are the same positions
            return (("q" if pos is self.q_pos else "k"), None), pos
        key = (side, f)
        if key not in self.positions:
            self.positions[key] = f(pos)
        return key, self.positions[key]

    def __call__(self, x: torch.Tensor, side: str, region: int, inverse: bool = False) -> torch.Tensor:
        key, pos = self._positions(side, region)
        key = (*key, x.dtype)
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


def _region_calls(region: Region, s_q: int, s_k: int, sliding_window: int | None, offset: int | None):
    if region.chunk:
        return chunk_calls(s_q, s_k, region.chunk, offset, region.lo, region.hi)
    hi = region.hi if not sliding_window else min(sliding_window, region.hi or sliding_window)
    if hi is None:
        return causal_calls(s_q, s_k, region.lo)
    return band_calls(s_q, s_k, region.lo, hi, near_block(hi - region.lo)) if hi > region.lo else []


def _plan(s_q: int, s_k: int, rule: RelativeRule, sliding_window: int | None, scale: float, keep,
          offset: int | None = None) -> RegionPlan:
    """The calls of every region; ``offset`` is the position of key slot 0 (chunk regions)."""
    parts = [(r, _region_calls(region, s_q, s_k, sliding_window, offset)) for r, region in enumerate(rule.regions)]
    return RegionPlan(parts, s_k - s_q, scale, None if keep is None else keep[:, 0, 0])


def fused_route(device_type: str, *, softcap: float | None = None, dropout: float = 0.0, keep=None,
                by_chunk: bool = False, sliding_window: int | None = None) -> str:
    """Which kernel ``fused_attention`` runs: ``"blocked"`` with attention dropout or a per-head ``keep`` mask
    (MiniMax M3's block selection; any device);
    ``"flex"`` on any other non-CPU device (CUDA: compiled FlexAttention); on the CPU
    ``"blocked"`` for soft-capping, a per-query ``keep`` mask or a chunk rule (``by_chunk``)
    under a sliding window, else ``"regions"`` (``ropescale.attention.regions``)."""
    if dropout or (keep is not None and keep.shape[1] != 1):  # a per-head selection: the blocked kernel only
        return "blocked"
    if device_type != "cpu":
        return "flex"
    if softcap or (keep is not None and keep.shape[-2] != 1) or (by_chunk and sliding_window):
        return "blocked"
    return "regions"


def slot_offsets(q_pos: torch.Tensor, s_k: int) -> torch.Tensor:
    """Position of key slot 0 per batch row ``[b]`` (positions are contiguous per row: the last
    query, slot s_k − 1, is at ``q_pos[:, -1]``); negative with left padding."""
    return q_pos[:, -1] - (s_k - 1)


def fused_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *, keep=None,
                    scale: float, softcap: float | None = None, sliding_window: int | None = None,
                    interleaved: bool = False, dropout: float = 0.0, block: int = 512,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The rule's regions in fused CPU flash kernels (``ropescale.attention.regions``), with backward.
    Where that kernel cannot follow (``fused_route`` other than ``"regions"``: soft-capping,
    attention dropout, a per-query ``keep`` mask, a chunk rule under a sliding window, or a device
    other than the CPU), ``blocked_attention``. The ``"fused"`` attention path
    (``ropescale.attention.interface``) sends other devices to FlexAttention (``ropescale.attention.flex``)
    before this. Chunk rules read each row's position offset (a CPU tensor: no device wait) and
    plan rows with different offsets (left padding) apart. A prefill's extra regions
    (``RelativeRule.for_call``) are regions of their own here, merged like the others."""
    rule = rule.for_call(q.shape[2], k.shape[2])
    route = fused_route(q.device.type, softcap=softcap, dropout=dropout, keep=keep, by_chunk=rule.by_chunk,
                        sliding_window=sliding_window)
    if route != "regions":
        return blocked_attention(q, k, v, q_pos, k_pos, rule, inv_freq, scaling, keep=keep, scale=scale,
                                 softcap=softcap, sliding_window=sliding_window, interleaved=interleaved,
                                 dropout=dropout, block=block, sinks=sinks)
    s_q, s_k = q.shape[2], k.shape[2]
    if keep is not None:  # one row per batch row: the kernels index keep by batch row
        keep = keep.expand(q.shape[0], 1, keep.shape[-2], s_k)
    if not rule.by_chunk:
        plan = _plan(s_q, s_k, rule, sliding_window, scale, keep)
        return RegionAttention.apply(q, k, v, _Rotations(q_pos, k_pos, rule, inv_freq, scaling, interleaved), plan,
                                     sinks)
    offsets = [round(o) for o in slot_offsets(q_pos, s_k).tolist()]
    groups: dict[int, list[int]] = {}
    for row, o in enumerate(offsets):
        groups.setdefault(o, []).append(row)
    outs, order = [], []
    for o, rows in groups.items():
        sel = slice(None) if len(rows) == len(offsets) else torch.tensor(rows)
        kp = None if keep is None else keep[sel]
        plan = _plan(s_q, s_k, rule, None, scale, kp, offset=o)
        qp = q_pos[sel]
        rot = _Rotations(qp, qp if k_pos is q_pos else k_pos[sel], rule, inv_freq, scaling, interleaved)
        outs.append(RegionAttention.apply(q[sel], k[sel], v[sel], rot, plan, sinks))
        order += rows
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)[torch.argsort(torch.tensor(order))]  # rows back in batch order


def _touches(region: Region, lo: int, hi: int) -> tuple[bool, bool]:
    """(may a block pair with slot distances in [lo, hi] hold pairs of ``region``, is it all in
    it), from Python integers. For a chunk region the chunk distance g of a pair at distance d is
    within [⌈(d − c + 1)/c⌉, ⌊(d + c − 1)/c⌋] whatever the positions' offset."""
    if region.chunk:
        c = region.chunk
        lo, hi = -(-(lo - c + 1) // c), (hi + c - 1) // c  # the chunk distances the block can hold
    top = region.hi if region.hi is not None else float("inf")
    return hi >= region.lo and lo < top, lo >= region.lo and hi < top


def _block_scores(rule: RelativeRule, n_part: int, qs_r: list, ks_r: list, pair: tuple[int, ...],
                  dist: torch.Tensor, at, extra: list) -> torch.Tensor:
    """``blocked_attention``'s raw scores q·k of one block pair, [b, n_kv, g, Bq, Bk]: each pair's
    score in the partition region holding it (a region holding the whole block pair is taken as it
    is); a prefill's extra regions (index ``>= n_part``) go to ``extra`` as (scores, inside),
    counted again. ``pair`` = (qs, qe, ks, ke, lo, hi): query slots qs:qe, key slots ks:ke and the
    least and largest slot distance in the pair (Python integers: which regions it touches needs no
    host sync); ``dist`` [Bq, Bk] slot distances; ``at``: a chunk rule's query and key positions
    ([b, 1, 1, s_q, 1], [b, 1, 1, 1, s_k]), else None."""
    qs, qe, ks, ke, lo, hi = pair
    s = None
    for r, region in enumerate(rule.regions):  # the partition first, then a prefill's extra regions
        maybe, whole = _touches(region, lo, hi)
        if not maybe:
            continue
        part = qs_r[r][..., qs:qe, :] @ ks_r[r][..., ks:ke, :].transpose(-1, -2)  # [b, n_kv, g, Bq, Bk]
        if whole and r < n_part:
            s = part
            if n_part == len(rule.regions):
                break
            continue
        if region.chunk:
            inside = region.contains(at[0][..., qs:qe, :], at[1][..., ks:ke])  # [b, 1, 1, Bq, Bk]
        else:
            inside = (dist >= region.lo) & (dist < region.hi) if region.hi is not None else dist >= region.lo
        if r < n_part:
            s = torch.where(inside, part, torch.zeros_like(part) if s is None else s)
        else:  # counted again: more columns of scores, over the same values
            extra.append((part, inside))
    return s


def _block_visibility(dist: torch.Tensor, sliding_window: int | None, keep, span: tuple[int, int, int, int],
                      n_kv: int = 1):
    """Which pairs of the block pair ``span`` = (qs, qe, ks, ke) a query may attend: causal (``dist``
    [Bq, Bk] >= 0), inside the sliding window, and kept by ``keep`` ([b, 1 or n_h, s_q or 1, s_k]: padding,
    an indexer's per-query or per-head selection) → [Bq, Bk], or [b, 1 or n_kv, 1 or g, Bq, Bk] with ``keep``
    (a per-head mask grouped as the scores: n_h = n_kv · g)."""
    qs, qe, ks, ke = span
    vis = (dist >= 0) & (dist < sliding_window) if sliding_window else dist >= 0
    if keep is not None:
        blk = keep[..., ks:ke] if keep.shape[-2] == 1 else keep[..., qs:qe, ks:ke]  # [b, 1 or n_h, Bq or 1, Bk]
        if blk.shape[1] == 1:
            return vis & blk[:, :, None]  # [b, 1, 1, Bq, Bk]
        return vis & blk.reshape(blk.shape[0], n_kv, -1, *blk.shape[-2:])  # [b, n_kv, g, Bq, Bk]
    return vis


def _online_softmax_step(m, l, acc, s, vb, dropout: float):
    """One key block of the online softmax (flash attention's recurrence, arXiv:2205.14135): running
    row maxima ``m`` and normalisers ``l`` [..., Bq, 1], the weighted sum ``acc`` [..., Bq, h_v],
    with scores ``s`` [..., Bq, Bk] over values ``vb`` [..., Bk, h_v] → the new (m, l, acc)."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    p = (s - m_new).exp()
    alpha = (m - m_new).exp()
    l = l * alpha + p.sum(-1, keepdim=True)
    if dropout:  # on the weights, not the normaliser: softmax first, then dropout
        p = torch.nn.functional.dropout(p, dropout)
    acc = acc * alpha + p @ vb
    return m_new, l, acc


def blocked_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *,
                      keep=None, scale: float, softcap: float | None = None,
                      sliding_window: int | None = None, interleaved: bool = False, dropout: float = 0.0,
                      block: int = 512, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A relative-position rule's attention over query blocks × key blocks of ``block`` slots with an
    online softmax: O(block²) scores at a time, each pair scored in its region (``_block_scores``),
    where the region kernels cannot follow (``fused_route``: attention dropout, soft-capping, a
    per-query ``keep`` mask, a chunk rule under a sliding window). Shapes: q [b, n_h,
    s_q, h_d], k [b, n_kv, s_k, h_d], v [b, n_kv, s_k, h_v] → [b, n_h, s_q, h_v]; the arguments as
    ``fused_attention``'s, ``dropout`` on the softmax weights, ``sinks`` [n_h] one extra logit per
    head in every row's normaliser."""
    b, n_h, s_q, h_d = q.shape
    h_v = v.shape[-1]
    n_kv, s_k = k.shape[1], k.shape[2]
    g, c0 = n_h // n_kv, s_k - s_q
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64
    rule = rule.for_call(s_q, s_k)
    n_part = len(rule.partition)  # regions from here are a prefill's pairs counted again
    extra = []  # (scores, inside) of those regions in one block pair

    def grouped(x):  # [b, n_h, s, h_d] → [b, n_kv, g, s, h_d]
        return x.view(b, n_kv, g, x.shape[2], h_d)

    rot = _Rotations(q_pos, k_pos, rule, inv_freq, scaling, interleaved)
    qs_r = [grouped(rot(q, "q", r)) for r in range(len(rule.regions))]
    ks_r = [rot(k, "k", r)[:, :, None] for r in range(len(rule.regions))]  # [b, n_kv, 1, s_k, h_d]
    v = v[:, :, None]
    q_slot = torch.arange(c0, s_k, device=q.device)
    k_slot = torch.arange(s_k, device=q.device)
    at = None
    if rule.by_chunk:  # positions by slot from each row's offset: [b, 1, 1, s, 1] and [b, 1, 1, 1, s]
        o = slot_offsets(q_pos, s_k)[:, None]
        at = ((q_slot[None].float() + o)[:, None, None, :, None], (k_slot[None].float() + o)[:, None, None, None, :])
    rows = []
    for qs in range(0, s_q, block):
        qe = min(qs + block, s_q)
        m = torch.full((b, n_kv, g, qe - qs, 1), _NEG, dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)
        if sinks is not None:  # the sink: one more logit in every row's normaliser, with no value
            m = sinks.to(acc_dtype).view(1, n_kv, g, 1, 1).expand_as(m)
            l = torch.ones_like(m)
        acc = torch.zeros(b, n_kv, g, qe - qs, h_v, dtype=acc_dtype, device=q.device)
        first = max(0, c0 + qs - sliding_window + 1) if sliding_window else 0
        for ks in range(first // block * block, c0 + qe, block):
            ke = min(ks + block, s_k)
            # the regions a block pair touches, from slot distances: Python integers, no host sync
            lo, hi = c0 + qs - (ke - 1), c0 + qe - 1 - ks
            dist = q_slot[qs:qe, None] - k_slot[None, ks:ke]  # [Bq, Bk]
            s = _block_scores(rule, n_part, qs_r, ks_r, (qs, qe, ks, ke, lo, hi), dist, at, extra)
            s = _softcap(s.to(acc_dtype) * scale, softcap)  # [b, n_kv, g, Bq, Bk]
            vis = _block_visibility(dist, sliding_window, keep, (qs, qe, ks, ke), n_kv)  # [b, ·, ·, Bq, Bk] or [Bq, Bk]
            if lo < 0 or (sliding_window and hi >= sliding_window) or keep is not None:  # masks only where needed
                s = s.masked_fill(~vis, float("-inf"))
            vb = v[..., ks:ke, :].to(acc_dtype)
            for part, inside in extra:
                part = _softcap(part.to(acc_dtype) * scale, softcap).masked_fill(~(vis & inside), float("-inf"))
                s, vb = torch.cat((s, part), -1), torch.cat((vb, v[..., ks:ke, :].to(acc_dtype)), -2)
            extra.clear()
            m, l, acc = _online_softmax_step(m, l, acc, s, vb, dropout)
        rows.append((acc / l.clamp_min(1e-30)).to(q.dtype))  # fully masked rows → 0
    return torch.cat(rows, -2).view(b, n_h, s_q, h_v)


def naive_attention(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *,
                    keep=None, scale: float, softcap: float | None = None,
                    sliding_window: int | None = None, interleaved: bool = False, sinks: torch.Tensor | None = None,
                    **_) -> torch.Tensor:
    """The oracle: the rule's explicit matrix p(i, j) ``[b, s_q, s_k]`` and the rotation identity
    R(a)q · R(b)k = Σ_f A_f cos(p θ_f) + B_f sin(p θ_f) with p = a − b, then an eager softmax —
    computed in float64 whatever the inputs' dtype (positions, p, the angles p·θ_f, scores,
    softmax), so it is the rule's exact value for the given q, k, v to float64 precision, not
    one more float32 rounding of it; returned in q's dtype. The scores accumulate one rotary pair
    at a time: O(b·n_h·s_q·s_k) memory, O(n²·d) time. A prefill's extra regions
    (``RelativeRule.for_call``) add their pairs as further softmax entries with their own p;
    ``sinks`` ``[n_h]`` (gpt-oss) one more entry per head whose value is 0.
    Shapes and arguments as the module doc."""
    dtype = q.dtype
    n_h, s_q = q.shape[1], q.shape[2]
    n_kv, s_k = k.shape[1], k.shape[2]
    rule = rule.for_call(s_q, s_k)
    d = 2 * inv_freq.numel()
    q = q.double()
    k = k.repeat_interleave(n_h // n_kv, dim=1).double()  # [b, n_h, s_k, h_d]
    v = v.repeat_interleave(n_h // n_kv, dim=1).double()
    theta = inv_freq.double()
    q1, q2 = _pairs(q, d, interleaved)  # [b, n_h, s_q, d/2]
    k1, k2 = _pairs(k, d, interleaved)  # [b, n_h, s_k, d/2]
    plain = q[..., d:] @ k[..., d:].transpose(-1, -2)  # channels past d do not rotate: [b, n_h, s_q, s_k]

    group = pair_groups(d // 2, rule.groups).tolist()  # pair f's group (all 0 for one position per token)

    def rotary(p: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_f of pair f's score at p ``[b, s_q, s_k]`` (or per group ``[b, s_q, s_k, G]``), × ``weight``."""
        s = 0
        for f in range(d // 2):  # pair f: A_f = q1 k1 + q2 k2, B_f = q1 k2 − q2 k1, each [b, n_h, s_q, s_k]
            a1, a2 = q1[..., f, None], q2[..., f, None]  # [b, n_h, s_q, 1]
            b1, b2 = k1[..., None, :, f], k2[..., None, :, f]  # [b, n_h, 1, s_k]
            angle = (p[..., group[f]] if p.dim() == 4 else p)[:, None] * theta[f]  # [b, 1, s_q, s_k]
            s = s + ((a1 * b1 + a2 * b2) * angle.cos() + (a1 * b2 - a2 * b1) * angle.sin()) * scaling**2
        return s if weight is None else s * weight[:, None]

    def scores(p: torch.Tensor) -> torch.Tensor:  # p [b, s_q, s_k(, G)] → scaled, soft-capped scores [b, n_h, s_q, s_k]
        return _softcap((plain + rotary(p)) * scale, softcap)

    qp, kp = q_pos.double(), k_pos.double()
    vis = _visible(torch.arange(s_k - s_q, s_k, device=q.device), torch.arange(s_k, device=q.device),
                   sliding_window)  # [s_q, s_k], on the inputs' device
    if keep is not None:
        vis = vis & keep
    if rule.blends:  # interpolated logits (GALI): each region's weighted terms, summed
        s = sum(torch.where(inside[:, None], rotary(p, w), 0.0) for inside, w, p in rule.terms(qp, kp))
        parts = [_softcap((plain + s) * scale, softcap).masked_fill(~vis, float("-inf"))]
    else:
        parts = [scores(rule.relative_positions(qp, kp)).masked_fill(~vis, float("-inf"))]
    for region in rule.regions[len(rule.partition):]:  # a prefill's pairs counted again
        i, j = qp[:, :, None], kp[:, None, :]
        p = ((qp if region.q_at is None else region.q_at(qp))[:, :, None]
             - (kp if region.k_at is None else region.k_at(kp))[:, None, :])  # [b, s_q, s_k]
        inside = (region.contains(i, j) & (j <= i))[:, None]  # [b, 1, s_q, s_k]
        parts.append(scores(p).masked_fill(~(vis & inside), float("-inf")))
    s = torch.cat(parts, -1)  # [b, n_h, s_q, s_k · (1 + extra)]
    v = torch.cat([v] * len(parts), -2)
    if sinks is not None:  # attention sinks (gpt-oss): one more logit per head, whose value is 0
        sink = sinks.double().view(1, n_h, 1, 1).expand(s.shape[0], n_h, s_q, 1)
        return (torch.softmax(torch.cat((s, sink), -1), -1)[..., :-1] @ v).to(dtype)
    return (torch.nan_to_num(torch.softmax(s, -1)) @ v).to(dtype)  # fully masked rows → 0

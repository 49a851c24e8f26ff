"""Relative-position rules as k fused kernel regions, merged by log-sum-exp; with backward.

A rule (``ropescale.strategies.relative``) is a list of regions partitioning the causal
triangle; in region r the queries are rotated to q_at_r(i) and the keys to k_at_r(j). Each region
is cut into a few *calls* of PyTorch's fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``), each an ordinary attention over a
structured key set, which also returns the log-sum-exp (LSE) of its rows; partial results are
merged exactly (the merge of online softmax):

    lse = logaddexp(lse_1, lse_2),   out = out_1·exp(lse_1 − lse) + out_2·exp(lse_2 − lse).

Calls by region shape (every decision from Python integers, so the host never waits):

* distance region lo ≤ i − j (unbounded): a causal attention shifted by lo, one call (two when
  every query also sees a prefix of keys: s_k − s_q > lo) — ``causal_calls``;
* distance band lo ≤ i − j < hi: queries in blocks of B, each over the B + hi − lo − 1 keys it
  can see, read through a strided *view* of the keys (no copy) with one shared band mask; the
  first rows and the last partial block are separate small masked calls — ``band_calls``;
* chunk region lo ≤ ⌊p_i/c⌋ − ⌊p_j/c⌋ < hi (p = position = slot + o): the whole query chunks
  in one call with chunks as the kernel's batch (keys a strided view, one shared mask), partial
  chunks apart; an unbounded one as a causal attention shifted by lo·c plus the staircase of
  chunk m − lo — ``chunk_calls``; o is a Python integer per batch row, so rows with different
  left padding are planned apart (``ropescale.attention.relative``);
* a sliding window W bounds distance regions (hi ← min(hi, W)).

ReRoPE / Leaky ReRoPE / SelfExtend / STRING are two distance regions (near band, far causal):
the causal triangle once plus a band of about (B + w)·n scores, close to one vanilla attention.
Dual Chunk Attention is three chunk regions: the triangle once, in a handful of calls.

Backward (``RegionAttention``) calls the kernel's backward per call with the *merged* output and
LSE — the softmax gradient of each region given the global normaliser — and adds the parts;
rotations are recomputed in backward (R(θ)ᵀ = R(−θ)), so only q, k, v, the output and the LSE
are kept: O(n) memory.

Shapes: b batch, n_h query heads, n_kv key/value heads (n_h a multiple: grouped-query attention),
s_q queries, s_k keys (the last query is the last key), h_d head dim, d ≤ h_d rotary channels.
Source: the merge is flash attention's (Dao et al. 2022, arXiv:2205.14135; ring attention's
blockwise merge, Liu et al. 2023, arXiv:2310.01889); the rules are ReRoPE / Leaky ReRoPE
(github.com/bojone/rerope), SelfExtend (arXiv:2401.01325), STRING (arXiv:2410.18745) and Dual
Chunk Attention (arXiv:2402.17463, whose ChunkLlama merges its three attentions the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch._guards import detect_fake_mode

__all__ = ["Call", "RegionAttention", "band_calls", "causal_calls", "chunk_calls", "near_block"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows [t0, t1), key slots [j0, j1).

    ``causal``: query row t0 + r sees key j0 + m for m ≤ r (top-left causal). ``band``: rows see
    slot distances (c0 + t) − j in [lo, hi) only (a mask is built). ``blocks`` > 0: the rows are
    ``blocks`` blocks of B = (t1 − t0) / blocks queries, block n over keys [j0 + n·B, j0 + n·B + width)
    read as a strided view; its band mask is the same for every block.
    """

    t0: int
    t1: int
    j0: int
    j1: int
    causal: bool = False
    band: tuple[int, int] | None = None
    blocks: int = 0
    width: int = 0


def causal_calls(s_q: int, s_k: int, lo: int) -> list[Call]:
    """Calls covering i − j ≥ ``lo`` (query slot i = s_k − s_q + t, key slot j ≥ 0)."""
    c = s_k - s_q - lo  # row t sees keys j ≤ t + c
    if c == 0:  # row t sees keys [0, t]: one top-left causal call
        return [Call(0, s_q, 0, s_q, causal=True)]
    if c > 0:  # every row sees keys [0, c]; row t ≥ 1 also [c + 1, c + t]: causal below the diagonal
        calls = [Call(0, s_q, 0, c + 1)]
        if s_q > 1:
            calls.append(Call(1, s_q, c + 1, c + s_q, causal=True))
        return calls
    return [Call(-c, s_q, 0, s_q + c, causal=True)] if s_q + c > 0 else []


def band_calls(s_q: int, s_k: int, lo: int, hi: int, block: int) -> list[Call]:
    """Calls covering lo ≤ i − j < hi in blocks of ``block`` queries (see ``Call``)."""
    if hi > s_k - 1:  # no pair is that far apart: the band is the causal region from lo
        return causal_calls(s_q, s_k, lo)
    c0 = s_k - s_q
    first = max(0, lo - c0)  # rows before it see no key in the band
    body = min(s_q, max(first, hi - 1 - c0))  # rows from here see a full window of in-range keys
    calls = []
    if body > first:  # head: windows reaching below slot 0
        calls.append(Call(first, body, 0, c0 + body - lo, band=(lo, hi)))
    n = (s_q - body) // block
    width = block + hi - lo - 1
    if n:
        j0 = c0 + body - hi + 1
        calls.append(Call(body, body + n * block, j0, j0 + (n - 1) * block + width, band=(lo, hi),
                          blocks=n, width=width))
    tail = body + n * block
    if tail < s_q:
        calls.append(Call(tail, s_q, max(0, c0 + tail - hi + 1), c0 + s_q - lo, band=(lo, hi)))
    return calls


def chunk_calls(s_q: int, s_k: int, chunk: int, offset: int, lo: int, hi: int | None) -> list[Call]:
    """Calls covering lo ≤ ⌊p_i/c⌋ − ⌊p_j/c⌋ < hi (hi None: unbounded), i ≥ j, where p = slot +
    ``offset`` is a slot's position and c = ``chunk``; query slot i = s_k − s_q + t.

    Bounded regions (DCA's intra- and successive-chunk ones): each query chunk sees key chunks
    m − hi + 1 … m − lo, the same shape for every chunk, so the whole chunks are one call with
    chunks as the kernel's batch (the keys a strided view, one shared mask: causal inside the own
    chunk); partial chunks at either end are calls of their own. Unbounded (lo ≥ 1: DCA's
    inter-chunk region): every pair at distance ≥ lo·c is in it, so one shifted causal attention
    (``causal_calls``) does the bulk, and the staircase left — chunk m − lo's keys closer than
    lo·c — is again one batched call over the whole chunks plus the partial ones."""
    c0, calls = s_k - s_q, []
    first, last = (c0 + offset) // chunk, (s_k - 1 + offset) // chunk
    stair = hi is None and lo >= 1
    if stair:
        calls += causal_calls(s_q, s_k, lo * chunk)
    elif hi is None:  # lo = 0, unbounded: every pair
        return causal_calls(s_q, s_k, 0)
    back = lo if stair else hi - 1  # the key window starts `back` chunks before the query chunk
    width = chunk if stair else (hi - lo) * chunk
    top = lo * chunk if stair else hi * chunk  # band (0, top): causal inside, all of the earlier chunks

    def start(m: int) -> int:  # the slot where chunk m starts
        return m * chunk - offset

    whole = [m for m in range(first, last + 1) if start(m) >= c0 and start(m + 1) <= s_k and start(m - back) >= 0]
    if len(whole) > 1:  # contiguous: one batched call
        m0, m1 = whole[0], whole[-1] + 1
        calls.append(Call(start(m0) - c0, start(m1) - c0, start(m0 - back), start(m1 - back) - chunk + width,
                          band=(0, top), blocks=m1 - m0, width=width))
    for m in range(first, last + 1):
        if len(whole) > 1 and whole[0] <= m <= whole[-1]:
            continue
        qa, qb = max(c0, start(m)), min(s_k, start(m + 1))
        if stair:  # the staircase: chunk m − lo's keys at distance < lo·c
            ka, kb = max(0, start(m - lo)), min(s_k, start(m - lo + 1))
            rows_end = min(qb, kb - 1 + lo * chunk)  # rows from here see no key of it (a masked row would
            if kb > ka and rows_end > qa:  # get lse 0 from the kernel, not −inf)
                calls.append(Call(qa - c0, rows_end - c0, ka, kb, band=(0, lo * chunk)))
            continue
        ka = max(0, start(m - hi + 1))
        if lo == 0:  # earlier key chunks in full, then the own chunk causally
            if qa > ka:
                calls.append(Call(qa - c0, qb - c0, ka, qa))
            calls.append(Call(qa - c0, qb - c0, qa, qb, causal=True))
        else:
            kb = min(s_k, start(m - lo + 1))
            if kb > ka:
                calls.append(Call(qa - c0, qb - c0, ka, kb))
    return calls


def near_block(window: int) -> int:
    """Query block B of the near band: work per query is B + w − 1 keys for w useful, and the
    kernel wants blocks of a few dozen rows; w/4 within [16, 256] keeps the waste ≤ 1.25 + 16/w."""
    return max(16, min(256, window // 4))


def _band_mask(call: Call, c0: int) -> torch.Tensor:
    """Bool visibility ``[rows, keys]`` of a band call (for blocked calls: of block 0)."""
    lo, hi = call.band
    if call.blocks:  # block n's queries start c0 + t0 − j0 slots after its keys: the same for every block
        r = torch.arange((call.t1 - call.t0) // call.blocks)
        dist = r[:, None] + (c0 + call.t0 - call.j0) - torch.arange(call.width)[None, :]
    else:
        dist = (c0 + torch.arange(call.t0, call.t1))[:, None] - torch.arange(call.j0, call.j1)[None, :]
    return (dist >= lo) & (dist < hi)


def _windows(x: torch.Tensor, call: Call) -> torch.Tensor:
    """``[h, s_k, h_d]`` (one batch row) → strided view ``[blocks, h, width, h_d]`` of the key windows."""
    x = x.contiguous()
    block = (call.t1 - call.t0) // call.blocks
    s_h, s_s, s_d = x.stride()
    return x.as_strided((call.blocks, x.shape[0], call.width, x.shape[2]), (block * s_s, s_h, s_s, s_d),
                        x.storage_offset() + call.j0 * s_s)


def _query_blocks(x: torch.Tensor, call: Call) -> torch.Tensor:
    """``[h, s_q, ·]`` → ``[blocks, h, B, ·]`` (a view) of the call's rows."""
    return x[:, call.t0 : call.t1].unflatten(1, (call.blocks, -1)).transpose(0, 1)


def _additive(visible: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def _real_only_cache(fn):
    """``lru_cache`` that is bypassed while a FakeTensorMode is active: a mask built from fake
    tensors (a memory trace, a host-sync test) must never serve a real forward later."""
    cached = lru_cache(maxsize=64)(fn)

    def get(*args):
        return fn(*args) if detect_fake_mode() is not None else cached(*args)
    get.cache_clear = cached.cache_clear
    return get


@_real_only_cache
def _band_rows(call: Call, c0: int) -> torch.Tensor | None:
    """``[1, 1, B]`` bool: the rows of a blocked call's shared mask that see a key, or None when all
    do (a row that sees none gets lse 0 from the kernel, not −inf)."""
    lo, hi = call.band
    shift = c0 + call.t0 - call.j0  # row r sees distances r + shift − width + 1 … r + shift
    has = [r + shift >= lo and r + shift - call.width + 1 <= hi - 1 for r in range((call.t1 - call.t0) // call.blocks)]
    return None if all(has) else torch.tensor(has)[None, None]  # decided in Python: no host read


@_real_only_cache
def _band_additive(call: Call, c0: int, dtype) -> torch.Tensor:
    """The additive band mask of a call without padding: built once per shape, not per layer."""
    mask = _additive(_band_mask(call, c0), dtype)
    return mask if call.blocks else mask[None, None]


@dataclass
class RegionPlan:
    """Everything but tensors: the calls of each region (``parts``: region index, its calls) and
    how to run them."""

    parts: list[tuple[int, list[Call]]]
    c0: int
    scale: float
    keep: torch.Tensor | None  # [b, s_k] bool (padding) or None


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial outputs, LSEs and gradients are summed: float64 for float64 inputs (the
    kernel's LSE is float64 then, and its backward wants it so), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(calls: list[Call], plan: RegionPlan, q, k, v, out, lse, covered: list):
    """Forward of ``calls`` for rotated q ``[b, n_h, s_q, h_d]`` and k, v, into ``out``
    ``[b, n_h, s_q, h_d]`` and ``lse`` ``[b, n_h, s_q]`` (``_accumulate_dtype``) in place: rows no earlier call
    reached (``covered`` lists the row ranges done) are written, the others merged."""
    for call in calls:
        fresh = all(call.t1 <= t0 or call.t0 >= t1 for t0, t1 in covered)
        for (bi, ts), part, part_lse in _forward_call(call, plan, q, k, v):
            if fresh:
                out[bi, :, ts], lse[bi, :, ts] = part, part_lse
            else:
                _merge(out, lse, (bi, ts), part, part_lse)
        _cover(covered, call.t0, call.t1)


def _cover(covered: list, t0: int, t1: int) -> None:
    """Add rows [t0, t1) to ``covered``, coalescing with the last range when they touch (calls come
    in row order within a region, so the list stays a handful of ranges even for thousands of calls)."""
    if covered and t0 <= covered[-1][1] and t1 >= covered[-1][0]:
        covered[-1] = (min(t0, covered[-1][0]), max(t1, covered[-1][1]))
    else:
        covered.append((t0, t1))


def _forward_call(call: Call, plan: RegionPlan, q, k, v):
    """Yields (row selector, out ``[b', n_h, rows, h_d]``, lse) for one call."""
    keep, dtype = plan.keep, q.dtype
    if call.blocks:
        for bi in range(q.shape[0]):  # one batch row at a time: blocks are the kernel's batch
            mask, has = _band_additive(call, plan.c0, dtype), _band_rows(call, plan.c0)
            if keep is not None:
                # [n, B, width]
                vis = _band_mask(call, plan.c0)[None] & _windows(keep[bi][None, :, None], call)[:, 0, :, 0][:, None, :]
                mask, has = _additive(vis[:, None], dtype), vis.any(-1)[:, None]  # [n, 1, B, width], [n, 1, B]
            o, l = _flash(_query_blocks(q[bi], call), _windows(k[bi], call), _windows(v[bi], call), 0.0, False,
                          attn_mask=mask, scale=plan.scale)  # [n, n_h, B, h_d], [n, n_h, B]
            if has is not None:
                l = l.masked_fill(~has, float("-inf"))
            yield (bi, slice(call.t0, call.t1)), o.transpose(0, 1).flatten(1, 2), l.transpose(0, 1).flatten(1)
        return
    qs, ks, vs = q[:, :, call.t0 : call.t1], k[:, :, call.j0 : call.j1], v[:, :, call.j0 : call.j1]
    mask = _band_additive(call, plan.c0, dtype) if call.band and keep is None else None
    if keep is not None:
        vis = _band_mask(call, plan.c0)[None, None] if call.band else None  # [1, 1, rows, keys]
        kv = keep[:, None, None, call.j0 : call.j1]  # [b, 1, 1, keys]
        vis = kv if vis is None else vis & kv
        mask = _additive(vis, dtype)
    o, l = _flash(qs, ks, vs, 0.0, call.causal, attn_mask=mask, scale=plan.scale)
    if keep is not None:  # rows with no visible key: the kernel reports lse 0, not −inf
        has = (vis.cumsum(-1) > 0)[..., 0, : call.t1 - call.t0] if call.causal else vis.any(-1)  # [b, 1, rows]
        l = l.masked_fill(~has.expand_as(l), float("-inf"))
    yield (slice(None), slice(call.t0, call.t1)), o, l


def _merge(out, lse, rows, part, part_lse):
    """out ← (out·e^lse + part·e^part_lse) / e^new with new = logaddexp(lse, part_lse), in place."""
    bi, ts = rows
    o, l = out[bi, :, ts], lse[bi, :, ts]
    new = torch.logaddexp(l, part_lse)
    new_safe = new.nan_to_num(neginf=0.0)  # rows with no key in either: weights 0, not NaN
    o.mul_((l - new_safe).exp_()[..., None]).add_(part * (part_lse - new_safe).exp_()[..., None])
    l.copy_(new)


def _backward_call(call: Call, plan: RegionPlan, g, q, k, v, out, lse, dq, dk, dv):
    """Adds one call's gradients to ``dq``, ``dk``, ``dv`` (``_accumulate_dtype``, shapes of q, k, v), given the
    merged ``out`` and ``lse`` (with +inf on rows that saw no key, so their weights are 0)."""
    keep, dtype = plan.keep, q.dtype
    if call.blocks:
        block = (call.t1 - call.t0) // call.blocks
        idx = call.j0 + (torch.arange(call.blocks)[:, None] * block + torch.arange(call.width)).flatten()
        for bi in range(q.shape[0]):
            mask = _band_additive(call, plan.c0, dtype) if keep is None else _additive(
                (_band_mask(call, plan.c0)[None]
                 & _windows(keep[bi][None, :, None], call)[:, 0, :, 0][:, None, :])[:, None], dtype)
            gq, gk, gv = _flash_backward(
                _query_blocks(g[bi], call), _query_blocks(q[bi], call), _windows(k[bi], call), _windows(v[bi], call),
                _query_blocks(out[bi], call), _query_blocks(lse[bi], call).contiguous(), 0.0, False,
                attn_mask=mask, scale=plan.scale)
            dq[bi, :, call.t0 : call.t1] += gq.transpose(0, 1).flatten(1, 2)  # [n_h, rows, h_d]
            dk[bi].index_add_(1, idx, gk.transpose(0, 1).flatten(1, 2).to(dk.dtype))  # windows overlap: add
            dv[bi].index_add_(1, idx, gv.transpose(0, 1).flatten(1, 2).to(dv.dtype))
        return
    rows, keys = slice(call.t0, call.t1), slice(call.j0, call.j1)
    mask = _band_additive(call, plan.c0, dtype) if call.band and keep is None else None
    if keep is not None:
        vis = _band_mask(call, plan.c0)[None, None] if call.band else None
        kv = keep[:, None, None, keys]
        vis = kv if vis is None else vis & kv
        mask = _additive(vis, dtype)
    gq, gk, gv = _flash_backward(g[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                 lse[:, :, rows].contiguous(), 0.0, call.causal, attn_mask=mask, scale=plan.scale)
    dq[:, :, rows] += gq
    dk[:, :, keys] += gk
    dv[:, :, keys] += gv


class RegionAttention(torch.autograd.Function):
    """out = softmax over all regions, from un-rotated q ``[b, n_h, s_q, h_d]``, k ``[b, n_kv, s_k, h_d]``,
    v ``[b, n_kv, s_k, h_v]``; ``rot(x, side, region, inverse=False)`` rotates x ``[b, h, s, h_d]``
    as region ``region`` places its queries (``side`` "q") or keys ("k"), or applies the inverse
    rotation. ``sinks`` ``[n_h]`` (or None): attention sinks (gpt-oss), one more logit per head in every
    row's normaliser, with no value — merged like one more region (out 0, LSE = the sink), so the
    backward's global normaliser includes it; its gradient is −Σ_rows e^(sink − lse)·(g · out).
    Returns ``[b, n_h, s_q, h_v]`` in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, rot, plan: RegionPlan, sinks=None):
        b, n_h, s_q, _ = q.shape
        acc = _accumulate_dtype(q.dtype)
        out = torch.zeros(b, n_h, s_q, v.shape[-1], dtype=acc, device=q.device)  # rows no call reaches: 0
        lse = torch.full((b, n_h, s_q), float("-inf"), dtype=acc, device=q.device)
        covered = []
        for region, calls in plan.parts:  # rotated copies live one region at a time
            if calls:
                _run(calls, plan, rot(q, "q", region), rot(k, "k", region), v, out, lse, covered)
        if sinks is not None:
            sink = sinks.to(acc).view(1, n_h, 1).expand_as(lse)
            new = torch.logaddexp(lse, sink)
            out.mul_((lse - new).exp_()[..., None])
            lse = new
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.rot, ctx.plan = rot, plan
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        rot, plan = ctx.rot, ctx.plan
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # no key: probabilities exp(s − ∞) = 0
        g = g.contiguous()
        acc = _accumulate_dtype(q.dtype)
        dq, dk = torch.zeros(q.shape, dtype=acc, device=q.device), torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for region, calls in plan.parts:
            if not calls:
                continue
            dq_r, dk_r = torch.zeros_like(dq), torch.zeros_like(dk)
            qr, kr = rot(q, "q", region), rot(k, "k", region)
            for call in calls:
                _backward_call(call, plan, g, qr, kr, v, out, lse, dq_r, dk_r, dv)
            dq += rot(dq_r, "q", region, inverse=True)  # the gradient of a rotation is the inverse rotation
            dk += rot(dk_r, "k", region, inverse=True)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            p_sink = (sinks.to(acc).view(1, -1, 1) - lse).exp()  # [b, n_h, s_q]
            dsinks = -(p_sink * (g.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks

"""Relative-position-rule attention as one FlexAttention call per region, merged by log-sum-exp:
the GPU path.

A rule (``ropescale.strategies.relative``) is a list of regions partitioning the causal
triangle — by slot distance lo ≤ i − j < hi (ReRoPE, Leaky, SelfExtend, STRING) or by chunk
distance lo ≤ ⌊p_i/c⌋ − ⌊p_j/c⌋ < hi (Dual Chunk Attention; p = slot + the row's offset, read
inside the mask from a ``[b]`` tensor: no host wait) — with queries rotated to q_at(i) and keys
to k_at(j) in each. Each region is one ``flex_attention`` call over a block-sparse mask (its
predicate ∧ i − j < W, W the sliding window when there is one, ∧ the padding ``keep`` mask),
returning its output and its rows' log-sum-exp (LSE). They are merged exactly, in float32
(float64 for float64 inputs):

    m = max_r lse_r  (0 on rows with no visible key; m cancels, so it is detached)
    out = Σ_r out_r·e^(lse_r − m) / Σ_r e^(lse_r − m)

The denominator is in [1, k] on rows with a visible key and 0 on rows with none, whose output is
0 (no NaN, forward or backward). Soft-capping tanh(s/c)·c is a ``score_mod``. Backward is
FlexAttention's own autograd: its backward takes the gradient of the LSE (``grad_logsumexp``, in
the dense reference and the Triton kernel alike; only the experimental ``BACKEND="FLASH"``
refuses it, and we never select it), so gradients through the merge are exact.

Where it runs: on CUDA through ``torch.compile(flex_attention)`` (compiled once, lazily), the
fused block-sparse kernel; this is what ``fused_attention`` dispatches to on any non-CPU device.
Inputs of at most ``EAGER_SCORES`` scores (b·n_h·s_q·s_k: the patch's 2-token routing check,
one-token decoding steps) run eagerly there too: each such shape would otherwise be a compilation
and a dynamo cache entry of its own (dynamo specialises sizes 1 and single blocks).
On the CPU ``flex_attention`` runs eagerly and unfused (it materialises each call's scores:
for tests and short inputs). torch refuses FlexAttention backward on the CPU
("FlexAttention does not support backward on CPU. Please set the input requires_grad to False or
use another device."), so when gradients are needed on the CPU this path hands over to ``fused_attention`` (the CPU
flash kernels, with backward), on MPS to ``blocked_attention``. Attention dropout goes to
``blocked_attention``. Every decision is made from Python integers and device types: no host
reads of tensor values.

Shapes (as ``fused_attention``): q ``[b, n_h, s_q, h_d]`` un-rotated, k, v ``[b, n_kv, s_k, h_d]``
(n_h a multiple of n_kv: grouped-query attention), ``q_pos`` ``[b, s_q]`` and ``k_pos`` ``[b, s_k]``
float positions [tokens], ``inv_freq`` ``[d/2]`` [rad/token] with d ≤ h_d rotary channels,
``keep`` None or bool broadcastable to ``[b, 1, s_q, s_k]``; query row t is key slot
s_k − s_q + t. Legend: b batch, n_h query heads, n_kv key/value heads, s_q queries, s_k keys
(cached ones included), h_d head dim, w the rule's window, W the sliding window.

Sources: FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating
Optimized Attention Kernels", arXiv:2412.05496); the LSE merge is flash attention's (Dao et al.
2022, arXiv:2205.14135); the rules are ReRoPE / Leaky ReRoPE (github.com/bojone/rerope),
SelfExtend (Jin et al. 2024, arXiv:2401.01325), STRING (An et al. 2024, arXiv:2410.18745) and
Dual Chunk Attention (An et al. 2024, arXiv:2402.17463).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from functools import cache, lru_cache

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from ropescale.attention.relative import blocked_attention, fused_attention, rotate, slot_offsets
from ropescale.strategies.relative import Region, RelativeRule

__all__ = ["NO_FLEX_BACKWARD", "BlockMaskCache", "flex_attention_path", "region_block_masks"]

NO_FLEX_BACKWARD = {"cpu", "mps"}  # device types where torch refuses FlexAttention backward
EAGER_SCORES = 1 << 24  # b·n_h·s_q·s_k up to which CUDA runs the eager functions (≤ 64 MB of float32 scores)


@cache
def _compiled(fn, backend="inductor"):
    """``torch.compile(fn, backend=backend)``, once per process: a cache of compiled *functions*
    (no data), shared by every model as torch's own compile cache is, so it lives here rather than
    on a patch. (The tests pass a counting backend to see how often dynamo compiles.)"""
    return torch.compile(fn, backend=backend)


def _compiles(device: torch.device, scores: int | None) -> bool:
    """Whether the compiled functions run: on CUDA, for more than ``EAGER_SCORES`` scores (None: any)."""
    return device.type == "cuda" and (scores is None or scores > EAGER_SCORES)


def _flex_for(device: torch.device, scores: int | None = None):
    """The compiled kernel on CUDA (compiled once per process) for inputs of more than
    ``EAGER_SCORES`` scores; the eager function elsewhere and for smaller inputs."""
    return _compiled(flex_attention) if _compiles(device, scores) else flex_attention


def _mask_builder(device: torch.device, scores: int | None = None):
    """``create_block_mask`` compiled on CUDA (as ``_flex_for`` decides): eagerly it evaluates the
    mask over all s_q × s_k pairs at once (16 G booleans at 128k tokens); compiled, the evaluation
    is fused into the per-block reduction (torch's advice since 2.6). Eager elsewhere (tests, short
    inputs)."""
    return _compiled(create_block_mask) if _compiles(device, scores) else create_block_mask


@contextmanager
def _quiet_eager():
    """Around an eager FlexAttention call made on purpose: without torch's "called without
    torch.compile" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def _keep3(keep: torch.Tensor | None, b: int, s_q: int, s_k: int) -> torch.Tensor | None:
    """bool keep broadcastable to ``[b, 1, s_q, s_k]`` → ``[b, 1 or s_q, s_k]`` (a view)."""
    if keep is None:
        return None
    if keep.dim() != 4 or keep.shape[1] != 1 or keep.shape[-1] != s_k or keep.shape[-2] not in (1, s_q):
        raise ValueError(f"keep must broadcast to [b, 1, s_q, s_k] = [{b}, 1, {s_q}, {s_k}]; got {list(keep.shape)}")
    return keep.expand(b, 1, keep.shape[-2], s_k)[:, 0]  # [b, 1 or s_q, s_k]


def _region_mask_mod(c0: int, region: Region, sliding_window: int | None, keep3: torch.Tensor | None,
                     offsets: torch.Tensor | None, device):
    """mask_mod(b, h, t, j): (c0 + t, j) in ``region`` (chunks from ``offsets[b]``, the position of
    slot 0), i − j ≥ 0 and < the sliding window, and keep3[b, t or 0, j].

    Every number is a 0-d int64 tensor on ``device``, not a Python int: the compiled
    ``create_block_mask`` and the compiled kernel (which evaluates the mask on its partial blocks)
    take captured tensors as inputs, whereas a Python number in the closure is a guard — one
    compilation per region, per rule's window, per cache offset c0, and past dynamo's
    ``recompile_limit`` (8 per function) torch runs the function eagerly: the unfused kernel, which
    materialises the scores. So all distance regions share one compiled graph, all chunk regions
    another (times the ``keep`` kind, dtype and grad mode: ``tests/attention/test_flex.py`` counts them)."""
    def number(x: int) -> torch.Tensor:  # a fill kernel on the device: no host-to-device copy
        return torch.full((), x, dtype=torch.int64, device=device)

    never = 2**62  # an unbounded region or no sliding window: a bound no pair reaches
    start, lo = number(c0), number(region.lo)
    hi, window = number(never if region.hi is None else region.hi), number(sliding_window or never)

    if region.chunk:
        chunk = number(region.chunk)

        def g(b, t, j):  # chunk distance, from the row's positions
            o = offsets[b]
            return (torch.div(t + start + o, chunk, rounding_mode="floor")
                    - torch.div(j + o, chunk, rounding_mode="floor"))
    else:
        def g(b, t, j):  # slot distance
            return t + start - j

    def inside(b, h, t, j):
        dist = t + start - j
        rel = g(b, t, j)
        return (dist >= 0) & (dist < window) & (rel >= lo) & (rel < hi)

    if keep3 is None:
        return inside
    if keep3.shape[1] == 1:  # a key (padding) mask: the same for every query row
        keys = keep3[:, 0]  # [b, s_k]
        return lambda b, h, t, j: inside(b, h, t, j) & keys[b, j]
    return lambda b, h, t, j: inside(b, h, t, j) & keep3[b, t, j]


class BlockMaskCache:
    """The block masks of the last call, owned by one patched model (``ropescale.attention`` keeps
    one on its truncation state). Every layer of one forward passes the same lengths, the same
    ``keep`` tensor and the same ``position_ids``, so the masks are built once per forward, not once
    per layer (``create_block_mask`` evaluates the mask over all s_q × s_k pairs); masks that depend
    on shapes alone (distance rules, and chunk rules' offset-free block lists, ``structure``) are kept
    across forwards, so a steady-state forward without padding builds none (``builds`` counts). Holds
    the last masks only (weak references to the tensors they were built from, with their versions),
    so it never pins a forward's tensors beyond the next one."""

    def __init__(self):
        self.key, self.refs, self.masks = None, (), None
        self.lists_key, self.lists = None, None  # chunk rules' offset-free block structure (``_chunk_structure``)
        self.builds = 0  # masks built (``create_block_mask`` or block lists): a steady state adds none

    @staticmethod
    def _refs(tensors: tuple) -> tuple:
        return tuple(None if t is None else (weakref.ref(t), t._version) for t in tensors)

    def _same(self, tensors: tuple) -> bool:
        if len(tensors) != len(self.refs):
            return False
        for t, ref in zip(tensors, self.refs, strict=True):
            if (t is None) != (ref is None) or (t is not None and (ref[0]() is not t or t._version != ref[1])):
                return False
        return True

    def get(self, key: tuple, keep: torch.Tensor | None, build, positions: torch.Tensor | None = None):
        """The masks for ``key`` built from ``keep`` (and ``positions``, for masks that depend on
        them): the cached ones when all are the same objects, unchanged; else ``build()``."""
        tensors = (keep, positions)
        if key != self.key or not self._same(tensors):
            self.masks = build()
            self.builds += 1
            self.key, self.refs = key, self._refs(tensors)
        return self.masks

    def structure(self, key: tuple, build):
        """The block structure for ``key`` (lengths, rule, window, device): built once, whatever the
        positions (``_chunk_structure``)."""
        if key != self.lists_key:
            self.lists = build()
            self.builds += 1
            self.lists_key = key
        return self.lists


def _region_empty(region: Region, s_k: int, sliding_window: int | None) -> bool:
    """True when no pair of a distance region exists (from Python integers); chunk regions are
    decided by their masks."""
    if region.chunk:
        return False
    top = s_k - 1 if not sliding_window else min(s_k - 1, sliding_window - 1)
    return region.lo > top


def region_block_masks(b: int, s_q: int, s_k: int, rule: RelativeRule, sliding_window: int | None,
                       keep: torch.Tensor | None, device, tensor_type: type = torch.Tensor,
                       cache: BlockMaskCache | None = None, offsets: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None, scores: int | None = None) -> list:
    """One ``BlockMask`` per region of ``rule`` for queries at slots s_k − s_q + t, None for a
    distance region no pair reaches (or that the sliding window ends first). ``keep``: as the
    path's; ``offsets`` ``[b]``: the position of key slot 0 per row (chunk rules' masks depend on
    it); ``positions``: the tensor the offsets come from (the model's ``position_ids``, the same
    object in every layer of a forward) — chunk rules' masks are cached only with it. ``cache``:
    reuse the masks of the previous call when nothing changed (None: build them).
    ``tensor_type`` (the queries' class) is part of the cache key, so masks built from fake
    tensors (FakeTensorMode) never serve real ones. ``scores``: b·n_h·s_q·s_k of the attention the
    masks serve (``_mask_builder``: compiled or eager on CUDA; None: compiled there)."""
    def build():
        keep3 = _keep3(keep, b, s_q, s_k)
        batch = None if keep3 is None and not rule.by_chunk else b
        build_mask = _mask_builder(torch.device(device), scores)
        with torch.no_grad():  # masks are never differentiated: one compiled builder for both grad modes
            return [None if _region_empty(r, s_k, sliding_window) else
                    build_mask(_region_mask_mod(s_k - s_q, r, sliding_window, keep3, offsets, device), batch, None,
                               s_q, s_k, device=device)
                    for r in rule.regions]

    key = (b, s_q, s_k, rule, sliding_window, str(device), tensor_type, scores)
    if cache is not None and rule.by_chunk and keep is None and offsets is not None:
        # the block structure bounds each chunk region over every offset, so it is built once per key;
        # each call gives it a mask_mod reading this call's offsets (exact on its partial blocks)
        structure = cache.structure(key, lambda: _chunk_structure(s_q, s_k, rule, sliding_window, device, scores))
        return [None if m is None else _with_mask_mod(m, _region_mask_mod(s_k - s_q, r, sliding_window, None,
                                                                          offsets, device))
                for r, m in zip(rule.regions, structure, strict=True)]
    if cache is None or (rule.by_chunk and positions is None):
        return build()
    return cache.get(key, keep, build, positions if rule.by_chunk else None)


def _with_mask_mod(mask, mask_mod):
    """``mask`` (a ``BlockMask``) with another ``mask_mod``: the same block lists, no build."""
    out = copy.copy(mask)
    out.mask_mod = mask_mod
    return out


def _chunk_structure(s_q: int, s_k: int, rule: RelativeRule, sliding_window: int | None, device,
                     scores: int | None, block: int = 128) -> list:
    """One ``BlockMask`` per region whose block lists hold for every row offset o: a chunk region's
    pairs (slot distance d = c0 + t − j ≥ 0) have chunk distance ⌊(t + c0 + o)/c⌋ − ⌊(j + o)/c⌋, which
    over all o is ⌊d/c⌋ or ⌈d/c⌉. So a block whose d range is [d₀, d₁] is full for every o when
    lo ≤ ⌊d₀/c⌋ and ⌈d₁/c⌉ < hi (and 0 ≤ d₀, d₁ < W), and can hold a visible pair only when
    ⌈d₁/c⌉ ≥ lo and ⌊max(d₀, 0)/c⌋ < hi (and d₁ ≥ 0, d₀ < W); blocks in between, and those cut by the
    sequence's end, are partial, where the kernel evaluates the call's own mask_mod. Built from
    O((s_q/B)·(s_k/B)) integers on the device (no host read), once per lengths, rule and window; distance
    regions are built as ``region_block_masks`` builds them. Chunk regions' masks carry no mask_mod yet:
    the caller sets the call's own (``_with_mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask

    c0 = s_k - s_q
    n_q, n_k = -(-s_q // block), -(-s_k // block)
    never = 2**62
    window = sliding_window or never
    t0 = torch.arange(n_q, device=device) * block  # first query row of each block
    t1 = torch.clamp(t0 + block, max=s_q) - 1
    j0 = torch.arange(n_k, device=device) * block
    j1 = torch.clamp(j0 + block, max=s_k) - 1
    d0 = (t0[:, None] + c0) - j1[None, :]  # [n_q, n_k]: the block's smallest slot distance
    d1 = (t1[:, None] + c0) - j0[None, :]  # its largest
    cut = ((t1 - t0 + 1) < block)[:, None] | ((j1 - j0 + 1) < block)[None, :]  # blocks the sequence's end cuts
    out = []
    for r in rule.regions:
        if not r.chunk:
            out.append(None if _region_empty(r, s_k, sliding_window) else
                       _mask_builder(torch.device(device), scores)(
                           _region_mask_mod(c0, r, sliding_window, None, None, device), None, None, s_q, s_k,
                           device=device))
            continue
        c, hi = r.chunk, never if r.hi is None else r.hi
        low = torch.div(d0.clamp(min=0), c, rounding_mode="floor")  # ⌊max(d₀, 0)/c⌋
        high = -torch.div(-d1, c, rounding_mode="floor")  # ⌈d₁/c⌉
        possible = (d1 >= 0) & (d0 < window) & (high >= r.lo) & (low < hi)
        full = possible & ~cut & (d0 >= 0) & (d1 < window) & (low >= r.lo) & (high < hi)
        partial = possible & ~full
        out.append(BlockMask.from_kv_blocks(*_kv_lists(partial), *_kv_lists(full), BLOCK_SIZE=block,
                                            seq_lengths=(s_q, s_k)))
    return out


def _kv_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[n_q, n_k]`` → ``kv_num_blocks`` ``[1, 1, n_q]`` and ``kv_indices`` ``[1, 1, n_q, n_k]`` (the
    listed blocks first, in order), as ``BlockMask`` takes them."""
    count = blocks.sum(-1, dtype=torch.int32)  # [n_q]
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # [n_q, n_k]
    return count[None, None], order[None, None]


@lru_cache(maxsize=16)
def _softcap_mod(softcap: float | None):
    """score_mod tanh(s/c)·c, one function object per c (the compiled kernel is guarded on it)."""
    if not softcap:
        return None
    return lambda score, b, h, t, j: torch.tanh(score / softcap) * softcap


def flex_attention_path(q, k, v, q_pos, k_pos, rule: RelativeRule, inv_freq, scaling: float, *, keep=None,
                        scale: float, softcap: float | None = None, sliding_window: int | None = None,
                        interleaved: bool = False, dropout: float = 0.0, block: int = 512,
                        masks: BlockMaskCache | None = None, positions: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention under ``rule`` in one FlexAttention call per region; returns ``[b, n_h, s_q, h_d]``
    in q's dtype (see the module docstring for shapes and the merge).

    ``masks``: the caller's block-mask cache (one per patched model, so the layers of a forward
    share their masks); None builds them for this call alone. ``positions``: the model's
    ``position_ids`` tensor the positions came from, which lets chunk rules share masks too.
    ``scaling`` is the rotary ``attention_scaling`` (cos and sin are multiplied by it, as
    transformers does), ``scale`` the softmax scale, ``softcap`` c of tanh(s/c)·c (None: off),
    ``sliding_window`` W: keys at i − j ≥ W are invisible. ``dropout`` > 0 is handed to
    ``blocked_attention`` (with ``block``, its block size [tokens]), as are gradients on MPS; ``sinks``
    ``[n_h]``: attention sinks (gpt-oss), one more logit per head in the merge, with no value;
    gradients on the CPU go to ``fused_attention``. Raises ``ValueError`` for a ``keep`` mask that does not broadcast to
    ``[b, 1, s_q, s_k]``.
    """
    rule = rule.for_call(q.shape[2], k.shape[2])  # a prefill's extra regions: calls of their own, merged
    args = (q, k, v, q_pos, k_pos, rule, inv_freq, scaling)
    kw = {"keep": keep, "scale": scale, "softcap": softcap, "sliding_window": sliding_window,
          "interleaved": interleaved, "dropout": dropout, "block": block, "sinks": sinks}
    if dropout:
        return blocked_attention(*args, **kw)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad and q.device.type in NO_FLEX_BACKWARD:  # fused_attention would send MPS back here
        return (fused_attention if q.device.type == "cpu" else blocked_attention)(*args, **kw)
    b, s_q, s_k = q.shape[0], q.shape[2], k.shape[2]
    offsets = slot_offsets(q_pos, s_k).long() if rule.by_chunk else None
    scores = b * q.shape[1] * s_q * s_k
    masks = region_block_masks(b, s_q, s_k, rule, sliding_window, keep, q.device, type(q), cache=masks,
                               offsets=offsets, positions=positions, scores=scores)
    flex, score_mod = _flex_for(q.device, scores), _softcap_mod(softcap)
    aux = AuxRequest(lse=True)
    # eager by choice where the device compiles (a few scores): torch's warning that the eager
    # function materialises the scores is about exactly what was chosen, so it is not shown
    quiet = _quiet_eager if flex is flex_attention and _compiles(q.device, None) else nullcontext

    def region(r: Region, mask):  # rotated q [b, n_h, s_q, h_d], k [b, n_kv, s_k, h_d]
        q_at = q_pos if r.q_at is None else r.q_at(q_pos)
        k_at = k_pos if r.k_at is None else r.k_at(k_pos)
        with quiet():
            out, stats = flex(rotate(q, q_at, inv_freq, scaling, interleaved),
                              rotate(k, k_at, inv_freq, scaling, interleaved),
                              v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=True, return_aux=aux)
        return out, stats.lse  # [b, n_h, s_q, h_d], [b, n_h, s_q]

    parts = [region(r, mask) for r, mask in zip(rule.regions, masks, strict=True) if mask is not None]
    if len(parts) == 1 and sinks is None:  # flex already gives 0 on rows with no visible key
        return parts[0][0]
    acc = torch.promote_types(q.dtype, torch.float32)
    if sinks is not None:  # one more part: the sink's logit, with a zero value
        lse0 = parts[0][1]
        parts = [*parts, (torch.zeros_like(parts[0][0]), sinks.to(lse0.dtype).view(1, -1, 1).expand_as(lse0))]
    lses = torch.stack([lse.to(acc) for _, lse in parts])  # [k, b, n_h, s_q]
    m = lses.amax(0).detach()  # the merge does not depend on m: no gradient needed
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no key: e^(−inf − 0) = 0
    e = (lses - m).exp()[..., None]  # [k, b, n_h, s_q, 1]
    den = e.sum(0)  # in [1, k] where a key is visible, 0 where none
    den = torch.where(den > 0, den, torch.ones_like(den))
    out = sum(o.to(acc) * e_r for (o, _), e_r in zip(parts, e, strict=True)) / den  # [b, n_h, s_q, h_d]
    return out.to(q.dtype)

"""Relative-position rules: change the relative position attention sees, not the frequencies.

Each rule is a relative-position function p(i, j) of query position i and key position j ≤ i,
given as a list of *regions* that partition the causal triangle. In each region p(i, j) =
q_at(i) − k_at(j): attention there is ordinary RoPE attention with the queries rotated to q_at(i)
and the keys to k_at(j), which is what lets ``ropescale.attention.regions`` compute every rule exactly
in O(n) memory (one fused kernel call per region piece, merged by log-sum-exp).

A region is selected either by *distance* (lo ≤ i − j < hi: ReRoPE, Leaky ReRoPE, SelfExtend,
STRING) or by *chunk distance* (lo ≤ ⌊i/c⌋ − ⌊j/c⌋ < hi for chunks of c positions: Dual Chunk
Attention). hi = None is unbounded.

Positions are in tokens; q_at, k_at map ``[b, s]`` float positions to ``[b, s]`` float positions
(None: the identity), or to one position per *pair group* ``[b, s, G]`` (DPE: rotary pair f of P
sits at the position of group ⌊f·G/P⌋, ``pair_groups``; rotation is elementwise per pair, so the
kernels turn each pair by its own angle), or to a ``Blend`` of two rotations (GALI: logits
interpolated between two integer distances, which is linear in the key).
Legend: b batch, s positions, w/W windows, c chunk
length [tokens], G pair groups, P = d/2 rotary pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register

__all__ = ["Blend", "Pieces", "Region", "RelativeRule", "dca", "leaky_rerope", "pair_groups", "per_pair", "rerope",
           "self_extend", "string"]


class Blend(NamedTuple):
    """A side rotated by the blend (1 − w)·R(a) + w·R(b) of two rotations (per rotary pair the complex
    factor (1 − w)·e^{i·a·θ} + w·e^{i·b·θ}, not of modulus 1): a key so placed gives the logit
    (1 − w)·A(i − a) + w·A(i − b), a linear interpolation of two ordinary RoPE logits (GALI).
    ``a``, ``b``: positions ``[b, s]`` [tokens]; ``w``: weights ``[b, s]`` in [0, 1]."""

    a: torch.Tensor
    b: torch.Tensor
    w: torch.Tensor

    def centre(self) -> torch.Tensor:
        """(1 − w)·a + w·b: the fractional position the blend stands for ``[b, s]`` [tokens]."""
        return self.a * (1 - self.w) + self.b * self.w


PositionMap = Callable[[torch.Tensor], "torch.Tensor | Blend"]


def pair_groups(n_pairs: int, n_groups: int, device=None) -> torch.Tensor:
    """The pair group of each rotary pair ``[n_pairs]`` int64: pair f is in group ⌊f·G/P⌋ (P =
    ``n_pairs``, G = ``n_groups``): G equal contiguous groups when G divides P (DPE's 8 groups of 8 of a
    128-dim head), fastest pairs first."""
    return torch.arange(n_pairs, device=device) * n_groups // n_pairs


def per_pair(pos: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """A position map's output ``[b, s]`` or ``[b, s, G]`` → positions broadcastable per rotary pair:
    ``[b, s, 1]`` (one per token) or ``[b, s, P]`` (each pair its group's, ``pair_groups``) [tokens]."""
    if pos.dim() == 3:
        return pos[..., pair_groups(n_pairs, pos.shape[-1], pos.device)]
    return pos[..., None]


@dataclass(frozen=True)
class Region:
    """Pairs with lo ≤ g(i, j) < hi (hi None: no bound), g = i − j, or ⌊i/chunk⌋ − ⌊j/chunk⌋ when
    ``chunk`` is set; there queries sit at ``q_at(i)`` and keys at ``k_at(j)`` (None: identity)."""

    lo: int
    hi: int | None
    q_at: PositionMap | None = None
    k_at: PositionMap | None = None
    chunk: int | None = None

    def contains(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Membership of (i, j) for broadcastable position tensors (bool, their broadcast shape)."""
        g = (torch.floor(q_pos / self.chunk) - torch.floor(k_pos / self.chunk)) if self.chunk else q_pos - k_pos
        inside = g >= self.lo
        return inside & (g < self.hi) if self.hi is not None else inside


def _at(f: PositionMap | None, pos: torch.Tensor) -> torch.Tensor:
    return pos if f is None else f(pos)


@dataclass(frozen=True)
class Pieces:
    """A rule whose map depends on how many tokens have been seen (GALI's chunked prefill): the queries of a
    call are cut where the tokens seen reach ``first``, ``first + every``, ``first + 2·every``, …, and a piece
    ending when e tokens have been seen applies ``at(e)`` to its queries and every key before them. e counts
    tokens (the last query's position + 1), not cache slots, so a sliding-window layer's short cache maps as
    a full one does. One token a call (decoding) rebuilds the map for every token; one forward of N tokens
    equals the same tokens fed through a KV cache in calls cut at those counts."""

    first: int
    every: int
    at: Callable[[int], RelativeRule]

    def split(self, s_q: int, seen: int) -> list[tuple[int, int, RelativeRule]]:
        """(a, b, rule) for each piece of a call of ``s_q`` queries that ends when ``seen`` tokens have been
        seen: queries [a, b) of the call (0 ≤ a < b ≤ s_q), which apply ``rule`` to the keys before them."""
        start = seen - s_q  # tokens seen before the call's first query
        k = max(0, -(-(start + 1 - self.first) // self.every))  # the first cut past the call's first query
        cuts = [c - start for c in range(self.first + k * self.every, seen, self.every)]
        bounds = [0, *cuts, s_q]
        return [(a, b, self.at(start + b)) for a, b in zip(bounds, bounds[1:])]

    def end(self, position: int, seen: int) -> int:
        """In a forward of ``seen`` tokens, the tokens seen when the piece holding the token at ``position`` ends."""
        if position < self.first:
            return min(self.first, seen)
        return min(self.first + ((position - self.first) // self.every + 1) * self.every, seen)

    def reusable(self, n: int) -> int:
        """Of a prefix of n tokens cached by one prompt, how many a longer prompt computes alike: up to the
        last cut at or before n (0 before ``first``): the pieces ending there are whole in both."""
        if n < self.first:
            return 0
        return self.first + (n - self.first) // self.every * self.every


@dataclass(frozen=True)
class RelativeRule:
    """p(i, j) = q_at(i) − k_at(j) of the region holding (i, j); the regions partition j ≤ i.

    ``attention_factor`` multiplies cos and sin in every region (attention logits × its square),
    as YaRN's does; 1 for most rules.

    ``prefill_extra``: regions whose pairs are counted *again*, on top of the partition, in a
    prefill — an attention call whose keys are exactly its queries (s_q = s_k) — and not when
    keys come from a cache: the key enters the softmax twice, once with each region's p (the
    authors' STRING prefill, ``string(prefill="authors")``). ``for_call`` gives the rule one call
    applies: there the extra regions are the last ``extra`` of ``regions``.

    ``pieces``: when set, the rule of a call's queries depends on the keys seen so far (``Pieces``):
    the attention cuts each call into its pieces, and ``regions`` is the rule of a call within the first
    piece (plain RoPE for GALI).
    """

    regions: tuple[Region, ...]
    attention_factor: float = 1.0
    prefill_extra: tuple[Region, ...] = ()
    extra: int = 0
    pieces: Pieces | None = None

    def split(self, s_q: int, seen: int) -> list[tuple[int, int, RelativeRule]]:
        """(a, b, rule) for each piece of an attention call of ``s_q`` queries ending when ``seen`` tokens have
        been seen: queries [a, b) apply ``rule`` to the keys before them (``Pieces``); one piece, this rule,
        without."""
        return [(0, s_q, self)] if self.pieces is None else self.pieces.split(s_q, seen)

    @property
    def partition(self) -> tuple[Region, ...]:
        """The regions that partition j ≤ i (all but the last ``extra``)."""
        return self.regions[: len(self.regions) - self.extra]

    def for_call(self, s_q: int, s_k: int) -> RelativeRule:
        """The rule an attention call of ``s_q`` queries over ``s_k`` keys applies: in a prefill
        (s_q = s_k) with ``prefill_extra``, the partition followed by those regions (``extra`` of
        them, counted on top); otherwise this rule. The same object for every prefill call. A rule with
        ``pieces``: the rule of the call's one piece (``InvalidInput`` for a call of several: the attention
        interface cuts calls into pieces, ``split``)."""
        if self.pieces is not None:  # a kernel called directly: the call's keys are every token seen
            (_, _, rule), *more = self.pieces.split(s_q, s_k)
            if more:
                raise InvalidInput(f"a call of {s_q} queries over {s_k} keys spans {len(more) + 1} pieces of a rule "
                                   "whose map grows with the keys seen: cut it with RelativeRule.split")
            return rule.for_call(s_q, s_k)
        if not self.prefill_extra or s_q != s_k:
            return self
        return self._prefill

    @cached_property
    def _prefill(self) -> RelativeRule:
        return RelativeRule(self.regions + self.prefill_extra, self.attention_factor, (), len(self.prefill_extra))

    @property
    def window(self) -> int | None:
        """The neighbour window: the first region's bound when it is the ordinary distance
        band 0 ≤ i − j < w (ReRoPE, Leaky, SelfExtend, STRING), else None."""
        first = self.regions[0]
        plain = first.chunk is None and first.lo == 0 and first.q_at is None and first.k_at is None
        return first.hi if plain else None

    @property
    def by_chunk(self) -> bool:
        """True when a region is selected by chunk (its pieces depend on absolute positions)."""
        return any(r.chunk for r in self.regions + self.prefill_extra)

    @cached_property
    def groups(self) -> int:
        """G, the pair groups of the rule's position maps (1: one position per token); read from the
        maps' output on two positions, so a rule declares nothing."""
        probe = torch.zeros(1, 2)
        sizes = {1}
        for r in self.regions:
            for f in (r.q_at, r.k_at):
                out = None if f is None else f(probe)
                out = out.a if isinstance(out, Blend) else out
                if out is not None and out.dim() == 3:
                    sizes.add(out.shape[-1])
        return max(sizes)

    @cached_property
    def blends(self) -> bool:
        """True when a region places a side by a ``Blend`` (GALI's interpolated logits)."""
        probe = torch.zeros(1, 2)
        return any(isinstance(f(probe), Blend) for r in self.regions for f in (r.q_at, r.k_at) if f is not None)

    def terms(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The partition as weighted RoPE logits, for the naive reference path: (inside ``[b, s_q, s_k]``
        bool, weight ``[b, s_q, s_k]``, p ``[b, s_q, s_k]``) — the logit of (i, j) is the sum over the terms
        whose region holds it of weight · A(p), A the ordinary RoPE logit at distance p. One term per
        region, two per ``Blend`` side (four for two blended sides: (Σ w_a R(a) q)·(Σ w_b R(b) k) =
        Σ w_a w_b A(a − b)). One position per token only (a grouped rule has no blends)."""
        i, j = q_pos[:, :, None], k_pos[:, None, :]
        out = []
        for r in self.partition:
            inside = r.contains(i, j) & (j <= i)
            for wq, aq in _sides(_at(r.q_at, q_pos)):
                for wk, ak in _sides(_at(r.k_at, k_pos)):
                    out.append((inside, wq[:, :, None] * wk[:, None, :], aq[:, :, None] - ak[:, None, :]))
        return out

    def relative_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The explicit matrix p ``[b, s_q, s_k]`` of the partition (for the naive reference
        path, inspection and tests), ``[b, s_q, s_k, G]`` per pair group for a grouped rule (DPE);
        pairs with j > i get i − j. A ``Blend`` side counts at its centre (GALI's fractional
        distance, the one its interpolated logit stands for). With ``pieces``, each query's piece's rule, as
        one call of these queries over these keys applies them."""
        if self.pieces is not None:  # each query under its piece's rule, its piece read from its position
            seen = int(k_pos.max()) + 1
            ends = torch.tensor([self.pieces.end(int(p), seen) for p in q_pos[0].tolist()])  # [s_q]
            out = torch.empty(0)
            for e in ends.unique().tolist():
                rows = (ends == e).nonzero()[:, 0]  # the queries of the piece ending at e
                part = self.pieces.at(e).relative_positions(q_pos[:, rows], k_pos)
                if not out.numel():
                    out = part.new_empty(part.shape[:1] + (len(ends),) + part.shape[2:])
                out[:, rows] = part
            return out
        i, j = q_pos[:, :, None], k_pos[:, None, :]
        p = i - j
        groups = self.groups
        if groups > 1:
            p = p[..., None].expand(*p.shape, groups)
        for r in self.partition:
            q_at, k_at = _centre(_at(r.q_at, q_pos)), _centre(_at(r.k_at, k_pos))
            if groups > 1:  # every side per group: [b, s, G]
                q_at, k_at = (x if x.dim() == 3 else x[..., None].expand(*x.shape, groups) for x in (q_at, k_at))
                here = q_at[:, :, None] - k_at[:, None, :]
                p = torch.where((r.contains(i, j) & (j <= i))[..., None], here, p)
                continue
            here = q_at[:, :, None] - k_at[:, None, :]
            p = torch.where(r.contains(i, j) & (j <= i), here, p)
        return p


def _sides(at: torch.Tensor | Blend) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight ``[b, s]``, positions ``[b, s]``) of each rotation a side is placed by: one, or a ``Blend``'s two."""
    if isinstance(at, Blend):
        return [(1 - at.w, at.a), (at.w, at.b)]
    return [(torch.ones(at.shape[:2], dtype=at.dtype, device=at.device), at)]


def _centre(at: torch.Tensor | Blend) -> torch.Tensor:
    return at.centre() if isinstance(at, Blend) else at


def _two(window: int, far_q: PositionMap, far_k: PositionMap | None, attention_factor: float = 1.0) -> RelativeRule:
    """p = i − j below ``window``, far_q(i) − far_k(j) from it on."""
    return RelativeRule((Region(0, window), Region(window, None, far_q, far_k)), attention_factor)


_WINDOW = Param("window", 512, kind=int, low=1, auto="half_train", log=True,
                help="neighbour window w [tokens]; a sweep uses T / 2")


@register("rerope", kind="attention", params=(_WINDOW,),
          source="Su 2023, ReRoPE (kexue.fm/archives/9708; github.com/bojone/rerope)")
def rerope(window: int) -> RelativeRule:
    """ReRoPE: p(i, j) = min(i − j, w): relative positions beyond the window are clipped to w."""
    return _two(window, lambda i: torch.full_like(i, float(window)), torch.zeros_like)


def _leaky_check(p: dict) -> None:
    if p["k"] is not None and p["target_length"] is not None:
        raise InvalidInput("leaky_rerope: give k or target_length, not both")


@register("leaky_rerope", kind="attention", params=(
    _WINDOW,
    Param("k", None, low=1.0, log=True, help="leak: positions beyond w advance 1/k per token (default 16)"),
    Param("target_length", None, low=2.0, auto=None,
          help="instead of k: longest sequence [tokens], mapped onto T"),
), check=_leaky_check, source="Su 2023, Leaky ReRoPE (kexue.fm/archives/9708; github.com/bojone/rerope)")
def leaky_rerope(window: int, k: float | None, target_length: float | None,
                 original_max_position_embeddings: int) -> RelativeRule:
    """Leaky ReRoPE: p(i, j) = i − j for i − j < w, else w + (i − j − w)/k.

    With ``target_length`` L, k = (L − 1 − w)/(T − 1 − w), so the largest relative position
    L − 1 lands on T − 1 (k ≥ 1). Raises ``ValueError`` when w ≥ T − 1 then.
    """
    if target_length is not None:
        room = original_max_position_embeddings - 1 - window
        if room <= 0:
            raise InvalidInput(f"leaky_rerope: window={window} leaves no room below T="
                             f"{original_max_position_embeddings} for target_length")
        k = max(1.0, (target_length - 1 - window) / room)
    k = 16.0 if k is None else k
    return _two(window, lambda i: i / k + window * (1 - 1 / k), lambda j: j / k)


@register("self_extend", kind="attention", params=(
    Param("group_size", 8, kind=int, low=1, log=True, help="G: far positions are floor(position / G)"),
    _WINDOW,
), source="Jin et al. 2024, LLM Maybe LongLM (SelfExtend), arXiv:2401.01325 (github.com/datamllab/LongLM)")
def self_extend(group_size: int, window: int) -> RelativeRule:
    """SelfExtend: p(i, j) = i − j inside the window, else ⌊i/G⌋ − ⌊j/G⌋ + w − ⌊w/G⌋.

    Far queries sit at ⌊i/G⌋ + w − ⌊w/G⌋ and far keys at ⌊j/G⌋, so grouped distances continue
    from w at the window's edge; usable length ≈ (T − w)·G + w.
    """
    shift = window - window // group_size
    return _two(window, lambda i: torch.floor(i / group_size) + shift, lambda j: torch.floor(j / group_size))


def _local_below(rule: str, outer: str, size: int, local: int, origin: str = "") -> None:
    """``local_window`` below the rule's outer size (STRING's ``shifted_offset``, DCA's ``chunk_size``) [tokens]."""
    if not 0 <= local < size:
        raise InvalidInput(f"{rule}: local_window={local} must be below {outer}={size} (both in tokens){origin}")


def _local_below_when_given(rule: str, outer: str):
    """The registry's check: ``_local_below`` when both are given (without a training window; ``resolve``
    checks the T-derived defaults)."""
    def check(p: dict) -> None:
        if p[outer] is not None and p["local_window"] is not None:
            _local_below(rule, outer, p[outer], p["local_window"])
    return check


_string_check = _local_below_when_given("string", "shifted_offset")


def _string_defaults(shifted_offset: int | None, local_window: int | None,
                     original_max_position_embeddings: int) -> tuple[int, int]:
    s = int(0.33 * original_max_position_embeddings) if shifted_offset is None else shifted_offset
    w = min(128, s // 8) if local_window is None else local_window
    _local_below("string", "shifted_offset", s, w)
    return s, w


@register("string", kind="attention", params=(
    Param("shifted_offset", None, kind=int, low=1, log=True,
          help="S: distances ≥ S are shifted down by S − W [tokens]; default int(0.33 · T), the authors'"),
    Param("local_window", None, kind=int, low=0,
          help="W: where shifted distances restart [tokens]; default min(128, S // 8) (the authors use 128)"),
    Param("attention_factor", None, low=0.0, low_open=True,
          help="cos/sin scale in every region; default 0.1·ln 2 + 1, the authors'"),
    Param("prefill", "paper", kind=str, choices=("paper", "authors"),
          help="paper: each key once; authors: a prefill counts keys at distance exactly S twice, as "
               "string_flash_forward does (RULER numbers published with STRING)"),
), check=_string_check, source="An et al. 2024, Why Does the Effective Context Length of LLMs Fall Short? (STRING), "
          "arXiv:2410.18745 (github.com/HKUNLP/STRING string_for_llama.py @ 216cc2f)")
def string(shifted_offset: int | None, local_window: int | None, attention_factor: float | None,
           original_max_position_embeddings: int, prefill: str = "paper") -> RelativeRule:
    """STRING: p(i, j) = i − j for i − j < S, else i − j − S + W: the S largest, rarely trained
    distances are dropped and the well-trained ones from W on overwrite them.

    Near queries and keys at their positions; far queries at i − S + W, keys at j. cos and sin are
    multiplied by ``attention_factor`` everywhere (the authors' 0.1·ln 2 + 1 ≈ 1.069, so logits
    × 1.143). ``prefill="paper"`` (default) counts each key once, as the paper's formula and the
    authors' decoding do. ``prefill="authors"`` follows the authors' prefill
    (``string_flash_forward``): its window ``[S, 0]`` is inclusive and its shifted triangle
    starts at S, so in a forward whose keys are its queries the key at distance exactly S enters
    the softmax twice — at p = S and at p = W (``RelativeRule.prefill_extra``) —, while cached
    decoding counts it once, as theirs; use it to reproduce RULER numbers published with STRING.
    ``local_window`` defaults to 128 as the authors', capped at S // 8 so that models with short
    windows keep W well below S. Raises ``InvalidInput`` unless 0 ≤ W < S.
    """
    s, w = _string_defaults(shifted_offset, local_window, original_max_position_embeddings)
    factor = 0.1 * math.log(2) + 1 if attention_factor is None else attention_factor
    rule = _two(s, lambda i: i - (s - w), None, factor)
    if prefill == "authors":
        return RelativeRule(rule.regions, factor, prefill_extra=(Region(s, s + 1),))
    return rule


_dca_check = _local_below_when_given("dca", "chunk_size")


def _shipped_size(dual: dict | None, key: str, param: str) -> int | None:
    """``dual_chunk_attention_config[key]`` [tokens] (None when the model has no such entry);
    ``InvalidInput`` naming the key when it is not a whole number ≥ 0."""
    value = dual.get(key) if isinstance(dual, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"dca: the model's dual_chunk_attention_config.{key}={value!r} is not a whole number of "
                           f"tokens; give {param} explicitly")
    return value


def _dca_sizes(chunk_size: int | None, local_window: int | None, original_max_position_embeddings: int,
               dual_chunk_attention_config: dict | None = None) -> tuple[int, int]:
    """(chunk_size, local_window) [tokens]: the ones given, else the model's
    ``dual_chunk_attention_config`` (``chunk_size``, ``local_size``), else ChunkLlama's 3T/4 and T/8."""
    t, shipped = original_max_position_embeddings, []
    size, local = chunk_size, local_window
    if size is None:
        size = _shipped_size(dual_chunk_attention_config, "chunk_size", "chunk_size")
        shipped += ["chunk_size"] if size is not None else []
    if local is None:
        local = _shipped_size(dual_chunk_attention_config, "local_size", "local_window")
        shipped += ["local_window"] if local is not None else []
    size = t * 3 // 4 if size is None else size
    local = t // 8 if local is None else local
    _local_below("dca", "chunk_size", size, local,
                 f" ({', '.join(shipped)} from the model's dual_chunk_attention_config)" if shipped else "")
    return size, local


@register("dca", kind="attention", params=(
    Param("chunk_size", None, kind=int, low=2, log=True,
          help="largest relative position [tokens]; default the model's dual_chunk_attention_config.chunk_size, "
               "else 3 · T // 4 (ChunkLlama's)"),
    Param("local_window", None, kind=int, low=0,
          help="chunks are chunk_size − local_window positions long [tokens]; default the model's "
               "dual_chunk_attention_config.local_size, else T // 8"),
    Param("scale", 1.0, low=1.0, auto="scale", log=True,
          help="s = L / T for the temperature; a sweep uses max(1, L / T)"),
    Param("vllm_temperature", False, kind=bool,
          help="vLLM's temperature max(1, 0.1·ln s + 1) instead of ChunkLlama's 0.05·ln s + 1"),
), check=_dca_check, source="An et al. 2024, Training-Free Long-Context Scaling of Large Language Models (Dual Chunk "
          "Attention), arXiv:2402.17463 (github.com/HKUNLP/ChunkLlama chunkllama_attn_replace.py @ 847ae71); "
          "vLLM (Qwen2.5-1M) rotary_embedding/dual_chunk_rope.py @ 07b1349 and "
          "attention/backends/dual_chunk_flash_attn.py @ cff7e05 (removed in 0.11)")
def dca(chunk_size: int | None, local_window: int | None, scale: float, vllm_temperature: bool,
        original_max_position_embeddings: int, dual_chunk_attention_config: dict | None = None) -> RelativeRule:
    """Dual Chunk Attention: positions are cut into chunks of c = chunk_size − local_window; keys
    sit at j mod c; a query at i mod c against its own chunk (intra, causal), at
    min(i mod c + c, chunk_size) against the previous chunk (successive) and at
    min(2c − 1, chunk_size) against all earlier chunks (inter). No relative position exceeds
    chunk_size; distances are exact inside a chunk and for the previous chunk
    while i mod c + c ≤ chunk_size.

    Temperature: cos and sin × 0.05·ln s + 1 (ChunkLlama's ``get_mscale``, s = ``scale``, 1 when
    s ≤ 1), or with ``vllm_temperature`` × σ = max(1, 0.1·ln s + 1), logits × σ² as vLLM's: it
    multiplies each key by σ when storing it, then the softmax scale (prefill) or the query
    (decoding) by σ — squared in both (vllm-project/vllm @ cff7e054,
    ``attention/backends/dual_chunk_flash_attn.py``); vLLM takes σ from the sequence's length at
    each step (a cached key keeps the σ it was stored with), ropescale from ``scale``.

    Defaults, each parameter on its own (one given explicitly wins): the model's
    ``dual_chunk_attention_config`` where it ships one (Qwen2.5-1M's config.json:
    ``{chunk_size: 262144, local_size: 8192, original_max_position_embeddings: 262144}``; its
    ``local_size`` is ``local_window``: vLLM's chunk length is chunk_size − local_size,
    ``rotary_embedding/dual_chunk_rope.py``), else ChunkLlama's ``replace_with_chunkllama`` at
    847ae71 (chunk_size = 3T/4, local_window = T/8; T/16 in commits before d304027). Raises
    ``InvalidInput`` unless 0 ≤ local_window < chunk_size, or for a shipped size that is not a whole
    number of tokens.
    """
    size, local = _dca_sizes(chunk_size, local_window, original_max_position_embeddings, dual_chunk_attention_config)
    c = size - local
    if vllm_temperature:
        factor = max(1.0, 0.1 * math.log(scale) + 1)
    else:
        factor = 0.05 * math.log(scale) + 1 if scale > 1 else 1.0

    def key(j):
        return torch.remainder(j, c)

    def succ(i):
        return (torch.remainder(i, c) + c).clamp(max=size)

    def inter(i):
        return torch.full_like(i, float(min(2 * c - 1, size)))

    return RelativeRule((Region(0, 1, key, key, chunk=c), Region(1, 2, succ, key, chunk=c),
                         Region(2, None, inter, key, chunk=c)), factor)

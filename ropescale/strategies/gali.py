"""GALI: greedy attention logit interpolation — positions interpolated into the training window, and
each logit at a fractional distance interpolated between the logits of the two integer distances
around it.

Notation: N the prompt length the positions are built for (``prompt_length``) [tokens], T the
training window [tokens], w the local window [tokens], i, j query and key indices (j ≤ i) [tokens].

Positions (the authors' ``construct_new_pi``): g = ⌈(N − w)/(T − w)⌉ fractional slots per early
integer position, and the smallest n ≥ 1 with T − n + g·n ≥ N early positions so split; the first
m = N − (T − n) tokens sit at f(j) = ⌊j/g⌋ + (j mod g)·(1/g), the rest at unit spacing
f(j) = n + (j − m) (so the last T − n ≥ w tokens keep exact distances and f(N − 1) = T − 1).
Logits (``attention_score_approximate``): the query sits at ⌈f(i)⌉; with d = ⌈f(i)⌉ − f(j),
n_ij = ⌊d⌋ and r = d − n_ij,

    logit(i, j) = (1 − r)·A(n_ij) + r·A(n_ij + 1),

A(p) the ordinary RoPE logit at relative distance p. ropescale writes this as the key rotated by the
blend (1 − r)·R(⌈f(j)⌉) + r·R(⌊f(j)⌋) (``Blend``): q·k is linear in the key's rotation, so every
kernel (fused, blocked, flex, naive) computes it with cos/sin tables and nothing else. N ≤ T: plain
RoPE (as their forward below the window).

Source: "A Training-Free Length Extrapolation Approach for LLMs: Greedy Attention Logit
Interpolation" (GALI), arXiv:2502.02659; reference code github.com/AcademyCityL/GALI (MIT)
``models/DPI/help_funcs.py::construct_new_pi`` and ``models/DPI/patches/Llama.py::
attention_score_approximate`` @ 5a3e947; defaults local window 128, chunk 3000 (their README; ropescale's
local window is min(128, T // 2), so that a short-window model keeps room to interpolate).
Prefill (``chunk``, their ``dpi_sample`` with ``chunk_coe``): the first T tokens with plain RoPE, then chunks of
``chunk`` tokens, each chunk's queries (and every key they see) under the map f_e of the length e it ends at,
and a map rebuilt for every decoded token (``Pieces``): one forward of N tokens gives the logits their chunked
prefill gives. ``chunk`` = 0: one map f_N for every query of an N-token forward (their
``attention_score_approximate`` on N tokens, ``prompt_length`` = N), kept at unit spacing past N, so a KV cache
gives what one forward gives. Their optional Gaussian logit noise (std (i − j)/N, unseeded) is not
implemented, nor their float ``chunk_coe`` (a chunk a fraction of the length so far).
"""

from __future__ import annotations

import functools
import math

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register
from ropescale.strategies.relative import Blend, Pieces, Region, RelativeRule

__all__ = ["gali", "gali_layout", "gali_positions"]


def gali_layout(prompt_length: int, train_length: int, local_window: int) -> tuple[int, int, int]:
    """(g, n, m): slots per early position, early positions split, tokens at fractional positions, for a
    prompt of N = ``prompt_length`` tokens, T = ``train_length`` and w = ``local_window`` [tokens]
    (``construct_new_pi``'s ``min_group_size``, its loop's final ``i`` and ``len(new_pi)`` kept).

    Raises:
        InvalidInput: w ≥ T (no room to interpolate) or N ≤ T (nothing to do).
    """
    if local_window >= train_length:
        raise InvalidInput(f"gali: local_window={local_window} must be below the training window T = {train_length}")
    if prompt_length <= train_length:
        raise InvalidInput(f"gali: prompt_length={prompt_length} is within the training window T = {train_length}")
    g = math.ceil((prompt_length - local_window) / (train_length - local_window))
    n = -(-(prompt_length - train_length) // (g - 1))  # the least n with T − n + g·n ≥ N
    return g, n, prompt_length - (train_length - n)


def gali_positions(pos: torch.Tensor, prompt_length: int, train_length: int, local_window: int) -> torch.Tensor:
    """f(j) for token indices ``pos`` ``[...]`` (float) → fractional positions ``[...]`` float64 [tokens]:
    ⌊j/g⌋ + (j mod g)·(1/g) for the first m tokens, n + (j − m) from there on (also past N)."""
    g, n, m = gali_layout(prompt_length, train_length, local_window)
    j = pos.double()
    early = torch.div(j, g, rounding_mode="floor") + torch.remainder(j, g) * (1 / g)  # i + interval·k, as theirs
    return torch.where(j < m, early, j - m + n)


@register("gali", kind="attention", params=(
    Param("prompt_length", None, kind=int, low=2, high=2**24, auto="length", log=True,
          help="N: the prompt length one map is interpolated for, read with chunk = 0 [tokens]; a sweep uses L"),
    Param("local_window", None, kind=int, low=0, high=2**24,
          help="w: sizes g = ceil((N − w)/(T − w)), so that at least the last w tokens keep unit spacing "
               "[tokens]; default min(128, T // 2) (the authors use 128)"),
    Param("chunk", 3000, kind=int, low=0, high=2**24,
          help="prefill past T in chunks of this many tokens, each under the map of the length it ends at, "
               "decoding a map per token, as the authors' dpi_sample [tokens]; 0: one map f_N for every query"),
), source="A Training-Free Length Extrapolation Approach for LLMs: Greedy Attention Logit Interpolation (GALI), "
          "arXiv:2502.02659 (github.com/AcademyCityL/GALI models/DPI/help_funcs.py::construct_new_pi and "
          "models/DPI/patches/Llama.py::attention_score_approximate, ::dpi_sample @ 5a3e947)")
def gali(prompt_length: int | None, local_window: int | None, original_max_position_embeddings: int,
         chunk: int = 3000) -> RelativeRule:
    """GALI: logit(i, j) = (1 − r)·A(⌊d⌋) + r·A(⌊d⌋ + 1), d = ⌈f(i)⌉ − f(j), f the interpolated positions.

    Queries at ⌈f(i)⌉, keys rotated by the blend (1 − r)·R(⌈f(j)⌉) + r·R(⌊f(j)⌋), r = ⌈f(j)⌉ − f(j)
    (``gali_positions``); plain RoPE when N ≤ T; w defaults to min(128, T // 2) (the authors' 128 at T = 4096
    and 8192). ``chunk`` > 0: f = f_e for the queries of the piece ending at e keys (``Pieces``: cuts at T, T +
    chunk, …); 0: f = f_N, N = ``prompt_length``. Raises ``InvalidInput`` when w ≥ T, or chunk = 0 without
    ``prompt_length``.
    """
    t = original_max_position_embeddings
    local_window = min(128, t // 2) if local_window is None else local_window
    if not chunk and prompt_length is None:
        raise InvalidInput("gali: chunk=0 maps every query for one prompt length: give prompt_length (a sweep sets "
                           "it to L)")
    if local_window >= t and (chunk or prompt_length > t):  # chunks reach past T: some map interpolates
        raise InvalidInput(f"gali: local_window={local_window} must be below the training window T = {t}")
    plain = RelativeRule((Region(0, None),))
    if chunk:
        return RelativeRule(plain.regions, pieces=Pieces(t, chunk, functools.lru_cache(maxsize=256)(
            lambda e: _one_map(e, local_window, t, plain))))
    return _one_map(prompt_length, local_window, t, plain)


def _one_map(n: int, local_window: int, t: int, plain: RelativeRule) -> RelativeRule:
    """f_N for every query: plain RoPE when N ≤ T."""
    if n <= t:
        return plain

    def f(p: torch.Tensor) -> torch.Tensor:
        return gali_positions(p, n, t, local_window).to(p.dtype)

    def q_at(i: torch.Tensor) -> torch.Tensor:  # [b, s] → [b, s]
        return torch.ceil(f(i))

    def k_at(j: torch.Tensor) -> Blend:  # [b, s] → a blend of ⌈f⌉ and ⌊f⌋, weight r = ⌈f⌉ − f
        x = f(j)
        hi = torch.ceil(x)
        return Blend(hi, torch.floor(x), hi - x)

    return RelativeRule((Region(0, None, q_at, k_at),))

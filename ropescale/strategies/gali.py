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
Departures, named: one map f_N for every query of an N-token forward (their ``attention_score_approximate``
on N tokens with ``construct_new_pi``'s positions); their ``dpi_sample`` prefills the first T tokens
with plain RoPE and the rest in chunks of 3000, each chunk's queries with the map of the length it
ends at, and re-builds the map for every decoded token, while ropescale keeps f_N past N (unit spacing),
so a KV cache gives what one forward gives. Their optional Gaussian logit noise (std (i − j)/N,
unseeded) is not implemented.
"""

from __future__ import annotations

import math

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register
from ropescale.strategies.relative import Blend, Region, RelativeRule

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
    Param("prompt_length", kind=int, low=2, high=2**24, auto="length", log=True,
          help="N: the prompt length the positions are interpolated for [tokens]; a sweep uses L"),
    Param("local_window", None, kind=int, low=0, high=2**24,
          help="w: sizes g = ceil((N − w)/(T − w)), so that at least the last w tokens keep unit spacing "
               "[tokens]; default min(128, T // 2) (the authors use 128)"),
), source="A Training-Free Length Extrapolation Approach for LLMs: Greedy Attention Logit Interpolation (GALI), "
          "arXiv:2502.02659 (github.com/AcademyCityL/GALI models/DPI/help_funcs.py::construct_new_pi and "
          "models/DPI/patches/Llama.py::attention_score_approximate @ 5a3e947)")
def gali(prompt_length: int, local_window: int | None, original_max_position_embeddings: int) -> RelativeRule:
    """GALI: logit(i, j) = (1 − r)·A(⌊d⌋) + r·A(⌊d⌋ + 1), d = ⌈f(i)⌉ − f(j), f the interpolated positions.

    Queries at ⌈f(i)⌉, keys rotated by the blend (1 − r)·R(⌈f(j)⌉) + r·R(⌊f(j)⌋), r = ⌈f(j)⌉ − f(j)
    (``gali_positions``); plain RoPE when N ≤ T; w defaults to min(128, T // 2) (the authors' 128 at T = 4096
    and 8192). Raises ``InvalidInput`` when w ≥ T < N.
    """
    t = original_max_position_embeddings
    local_window = min(128, t // 2) if local_window is None else local_window
    if prompt_length <= t:
        return RelativeRule((Region(0, None),))
    if local_window >= t:
        raise InvalidInput(f"gali: local_window={local_window} must be below the training window T = {t}")

    def f(p: torch.Tensor) -> torch.Tensor:
        return gali_positions(p, prompt_length, t, local_window).to(p.dtype)

    def q_at(i: torch.Tensor) -> torch.Tensor:  # [b, s] → [b, s]
        return torch.ceil(f(i))

    def k_at(j: torch.Tensor) -> Blend:  # [b, s] → a blend of ⌈f⌉ and ⌊f⌋, weight r = ⌈f⌉ − f
        x = f(j)
        hi = torch.ceil(x)
        return Blend(hi, torch.floor(x), hi - x)

    return RelativeRule((Region(0, None, q_at, k_at),))

"""Global frequency rules: every rotary pair rescaled or rebased the same way.

Notation: d = rotary dim, b = ``rope_theta``, i = pair index 0 … d/2−1, s = ``factor``,
L = current sequence length, T = ``original_max_position_embeddings``.
Vanilla RoPE rotates pair i of a token at position m by m·θ_i with θ_i = b^(−2i/d);
``inv_freq`` is the vector θ ``[d/2]`` in radians per token.
"""

from __future__ import annotations

import math

import torch

from ropescale.strategies.registry import Param, RopeFrequencies, register

__all__ = ["FACTOR", "dynamic_ntk", "linear", "ntk", "pi_over_2n", "rope_inv_freq", "vanilla"]

FACTOR = Param("factor", kind=float, low=1.0, auto="scale", log=True,
                help="scale s (context extension ratio); a sweep uses L / T")


def _export_vanilla(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    return {"rope_type": "default"}


def _export_linear(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    return {"rope_type": "linear", "factor": params["factor"]}


def _export_ntk(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    """NTK is vanilla RoPE with the raised base b' = b·s^(d/(d−2))."""
    d = context["dim"]
    return {"rope_type": "default", "rope_theta": context["rope_theta"] * params["factor"] ** (d / (d - 2))}


def _export_dynamic_ntk(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict | None:
    """transformers' ``dynamic`` divides L by ``max_position_embeddings``: only equivalent when
    that is the window T the patch uses."""
    if context["original_max_position_embeddings"] != max_position_embeddings:
        return None
    return {"rope_type": "dynamic", "factor": params["factor"]}


def _freeze_dynamic_ntk(params: dict, at: int, train_length: int) -> tuple[str, dict]:
    """Dynamic NTK at F: vanilla for F ≤ T, else NTK with s' = s·F/T − (s − 1), whose base b·s'^(d/(d−2)) is
    dynamic NTK's at F."""
    s = float(params["factor"])
    return ("vanilla", {}) if at <= train_length else ("ntk", {"factor": s * at / train_length - (s - 1)})


def rope_inv_freq(dim: int, rope_theta: float) -> torch.Tensor:
    """θ_i = b^(−2i/d) for i = 0 … d/2−1: ``[d/2]`` float32 [radians per token].

    Same arithmetic as transformers' ``compute_default_rope_parameters``, so it matches
    the models' own buffers bit for bit.
    """
    return 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@register("vanilla", export=_export_vanilla, source="Su et al. 2021, RoFormer, arXiv:2104.09864")
def vanilla(dim: int, rope_theta: float) -> RopeFrequencies:
    """Unscaled RoPE: θ_i = b^(−2i/d), attention factor 1."""
    return RopeFrequencies(rope_inv_freq(dim, rope_theta), 1.0)


@register("linear", params=(FACTOR,), export=_export_linear,
          source="Chen et al. 2023, Position Interpolation, arXiv:2306.15595")
def linear(dim: int, rope_theta: float, factor: float) -> RopeFrequencies:
    """Position interpolation: θ_i / s (positions squeezed by s into the trained range)."""
    return RopeFrequencies(rope_inv_freq(dim, rope_theta) / factor, 1.0)


@register("ntk", params=(FACTOR,), export=_export_ntk,
          source="bloc97 2023, NTK-aware scaled RoPE (reddit r/LocalLLaMA 14lz7j5)")
def ntk(dim: int, rope_theta: float, factor: float) -> RopeFrequencies:
    """Static NTK-aware scaling: base b' = b · s^(d/(d−2)), then θ_i = b'^(−2i/d).

    The highest frequency is unchanged and the lowest is divided by exactly s.
    """
    return RopeFrequencies(rope_inv_freq(dim, rope_theta * factor ** (dim / (dim - 2))), 1.0)


@register("dynamic_ntk",
          params=(Param("factor", 1.0, low=1.0, log=True, help="s in the base formula; 1 gives α = L/T"),),
          export=_export_dynamic_ntk, served="freeze", freeze=_freeze_dynamic_ntk,
          source="emozilla 2023, Dynamically scaled RoPE (reddit r/LocalLLaMA 14mrgpr); "
                 "transformers rope_type 'dynamic'")
def dynamic_ntk(dim: int, rope_theta: float, original_max_position_embeddings: int,
                seq_len: int, factor: float) -> RopeFrequencies:
    """Dynamic NTK: for L > T, b' = b · (s·L/T − (s − 1))^(d/(d−2)); vanilla otherwise.

    Recomputed from the current length L, so a forward up to T is exactly vanilla.
    """
    if seq_len <= original_max_position_embeddings:
        return vanilla(dim, rope_theta)
    alpha = factor * seq_len / original_max_position_embeddings - (factor - 1)
    return RopeFrequencies(rope_inv_freq(dim, rope_theta * alpha ** (dim / (dim - 2))), 1.0)


@register("pi_over_2n", params=(
    Param("n_max", kind=float, low=1.0, auto="length", log=True,
          help="maximum sequence length the angles are budgeted for; a sweep uses L"),
), source="He & Xu 2023, a linear-algebra derivation of RoPE (the π/(2·n_max) rule)")
def pi_over_2n(dim: int, rope_theta: float, n_max: float) -> RopeFrequencies:
    """θ_t = π/(2·n_max) · b^(−t/d), t = 0, 2, …, d−2: vanilla's ladder rescaled so that the
    fastest pair turns by exactly π/2 over n_max tokens.

    What it is for: every pair's rotation angle then grows monotonically with distance, up to
    at most π/2 at n_max, so no two relative positions within n_max alias (no pair wraps past
    π/2, where the cosine stops being monotone). The price is resolution: nearby positions
    differ by tiny angles. (t runs over the even dimension indices, the ``arange(0, d, 2)``
    convention of vanilla RoPE.)
    """
    return RopeFrequencies(rope_inv_freq(dim, rope_theta) * (math.pi / (2 * n_max)), 1.0)

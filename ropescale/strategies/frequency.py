"""Frequency strategies: each returns new ``inv_freq`` (and an attention factor).

Notation: d = rotary dim, b = ``rope_theta``, i = pair index 0 … d/2−1, s = ``factor``,
L = current sequence length, L_train = ``original_max_position_embeddings``.
Vanilla RoPE rotates pair i of a token at position m by m·θ_i with θ_i = b^(−2i/d);
``inv_freq`` is the vector θ ``[d/2]`` in radians per token.
"""

from __future__ import annotations

import math

import torch

from ropescale.strategies.registry import Param, RopeFrequencies, register

__all__ = ["rope_inv_freq", "vanilla", "linear", "ntk", "dynamic_ntk", "yarn"]

_FACTOR = Param("factor", kind=float, low=1.0, auto="scale",
                help="scale s (context extension ratio); a sweep uses L / L_train")


def rope_inv_freq(dim: int, rope_theta: float) -> torch.Tensor:
    """θ_i = b^(−2i/d) for i = 0 … d/2−1: ``[d/2]`` float32 [radians per token].

    Same arithmetic as transformers' ``compute_default_rope_parameters``, so it matches
    the models' own buffers bit for bit.
    """
    return 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@register("vanilla", source="Su et al. 2021, RoFormer, arXiv:2104.09864")
def vanilla(dim: int, rope_theta: float) -> RopeFrequencies:
    """Unscaled RoPE: θ_i = b^(−2i/d), attention factor 1."""
    return RopeFrequencies(rope_inv_freq(dim, rope_theta), 1.0)


@register("linear", params=(_FACTOR,),
          source="Chen et al. 2023, Position Interpolation, arXiv:2306.15595")
def linear(dim: int, rope_theta: float, factor: float) -> RopeFrequencies:
    """Position interpolation: θ_i / s (positions squeezed by s into the trained range)."""
    return RopeFrequencies(rope_inv_freq(dim, rope_theta) / factor, 1.0)


@register("ntk", params=(_FACTOR,),
          source="bloc97 2023, NTK-aware scaled RoPE (reddit r/LocalLLaMA 14lz7j5)")
def ntk(dim: int, rope_theta: float, factor: float) -> RopeFrequencies:
    """Static NTK-aware scaling: base b' = b · s^(d/(d−2)), then θ_i = b'^(−2i/d).

    The highest frequency is unchanged and the lowest is divided by exactly s.
    """
    return RopeFrequencies(rope_inv_freq(dim, rope_theta * factor ** (dim / (dim - 2))), 1.0)


@register("dynamic_ntk",
          params=(Param("factor", 1.0, low=1.0, help="s in the base formula; 1 gives α = L/L_train"),),
          source="emozilla 2023, Dynamically scaled RoPE (reddit r/LocalLLaMA 14mrgpr); "
                 "transformers rope_type 'dynamic'")
def dynamic_ntk(dim: int, rope_theta: float, original_max_position_embeddings: int,
                seq_len: int, factor: float) -> RopeFrequencies:
    """Dynamic NTK: for L > L_train, b' = b · (s·L/L_train − (s − 1))^(d/(d−2)); vanilla otherwise.

    Recomputed from the current length L, so a forward up to L_train is exactly vanilla.
    """
    if seq_len <= original_max_position_embeddings:
        return vanilla(dim, rope_theta)
    alpha = factor * seq_len / original_max_position_embeddings - (factor - 1)
    return RopeFrequencies(rope_inv_freq(dim, rope_theta * alpha ** (dim / (dim - 2))), 1.0)


def _yarn_check(p: dict) -> None:
    if p["beta_fast"] <= p["beta_slow"]:
        raise ValueError(f"yarn: beta_fast={p['beta_fast']} must be greater than beta_slow={p['beta_slow']}")


@register("yarn", params=(
    _FACTOR,
    Param("beta_fast", 32.0, low=0.0, low_open=True,
          help="pairs with more than beta_fast rotations in L_train are not interpolated"),
    Param("beta_slow", 1.0, low=0.0, low_open=True,
          help="pairs with fewer than beta_slow rotations in L_train are fully interpolated"),
    Param("attention_factor", None, low=0.0, low_open=True,
          help="override for the cos/sin scale; default 0.1·ln(s) + 1"),
), check=_yarn_check, source="Peng et al. 2023, YaRN, arXiv:2309.00071 (github.com/jquesnelle/yarn)")
def yarn(dim: int, rope_theta: float, original_max_position_embeddings: int, factor: float,
         beta_fast: float, beta_slow: float, attention_factor: float | None) -> RopeFrequencies:
    """YaRN: NTK-by-parts interpolation ramp plus attention temperature 0.1·ln(s) + 1.

    Pair i makes r_i = L_train·θ_i / 2π rotations over the training window. With the
    correction dim fcd(r) = d·ln(L_train / (2π·r)) / (2·ln b), low = ⌊fcd(beta_fast)⌋ and
    high = ⌈fcd(beta_slow)⌉ clamped to [0, d−1], ramp_i = clamp((i − low)/(high − low), 0, 1)
    and θ'_i = θ_i·(1 − ramp_i) + (θ_i/s)·ramp_i: fast pairs extrapolate, slow pairs
    interpolate. cos and sin are multiplied by the attention factor (1 when s ≤ 1).
    """
    theta = rope_inv_freq(dim, rope_theta)

    def fcd(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low = max(math.floor(fcd(beta_fast)), 0)
    high = min(math.ceil(fcd(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp (as the reference code does)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (theta / factor) * ramp + theta * (1 - ramp)
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return RopeFrequencies(inv_freq, float(attention_factor))

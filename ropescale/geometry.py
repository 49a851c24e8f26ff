"""The rotary geometry a strategy produces, as closed forms on ``inv_freq``.

Notation: d = rotary dim, pair i = 0 … d/2−1 with angular frequency θ_i [radians per token]
(``inv_freq`` ``[d/2]``), λ_i = 2π/θ_i its wavelength [tokens], T = training window
(``original_max_position_embeddings``), L = target length, r = relative distance [tokens].

- **Wavelengths and pair classes** (the RoPE-properties view): a pair whose λ_i ≤ T completed a
  turn in training, so every angle it shows at any length was seen; a pair with λ_i > T only
  saw the range T·θ_i of T positions. After a strategy, a pair is *truncated* (θ' = 0),
  *extrapolated* (its range at L, L·θ'_i, exceeds the trained one), *unchanged* (θ' = θ) or
  *interpolated* (θ' ≠ θ, within the trained range; so position interpolation with s = L/T,
  whose L·θ/s equals T·θ, interpolates every pair).
- **Aliasing** (He & Xu, the linear-algebra derivation of RoPE, Figs. 1–2): the angle r·θ mod
  2π of a pair stops growing with r at the first wrap; the first such r is
  ``alias_distance`` (7 for θ = 1). θ = π/(2·n_max) keeps every angle ≤ π/2 up to n_max.
- **Long-range decay**: C(r) = (2/d)·Σ_i cos(r·θ_i) (the mean cosine over pairs, 1 at r = 0), and
  the RoFormer bound on relative attention (Su et al., arXiv:2104.09864 §3.4.3):
  (2/d)·Σ_{j=1}^{d/2} |S_j(r)|, S_j(r) = Σ_{k<j} e^{i·r·θ_k}.
- **Base bound** (Men et al. 2024, arXiv:2405.14591): B(m) = Σ_i cos(m·θ_i) must stay ≥ 0 for
  all m < L for the model to tell similar tokens from random ones at distance m; for vanilla
  θ_i = b^(−2i/d) that bounds the base from below: ``smallest_base``.

All curves are float64 ``[L]`` tensors over r (or m) = 0 … L − 1.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PAIR_CLASSES", "wavelengths", "classify_pairs", "rotation_angles", "alias_distance", "decay_curve",
           "roformer_bound", "base_bound_curve", "first_negative", "smallest_base"]

PAIR_CLASSES = ("unchanged", "interpolated", "extrapolated", "truncated")
TWO_PI = 2 * math.pi


def wavelengths(inv_freq: torch.Tensor) -> torch.Tensor:
    """λ_i = 2π/θ_i ``[d/2]`` float64 [tokens]; ``inf`` for a zero frequency."""
    theta = inv_freq.double()
    return torch.where(theta > 0, TWO_PI / theta.clamp_min(1e-300), torch.full_like(theta, math.inf))


def classify_pairs(before: torch.Tensor, after: torch.Tensor, train_length: int, length: int) -> list[str]:
    """One of ``PAIR_CLASSES`` per pair, comparing a strategy's frequencies ``after`` with the
    model's ``before`` (both ``[d/2]``) for a target ``length``."""
    out = []
    for t0, t1 in zip(before.double().tolist(), after.double().tolist()):
        seen = math.inf if train_length * t0 >= TWO_PI else train_length * t0  # angle range of T positions
        if t1 == 0:
            out.append("truncated")
        elif length * t1 > seen * (1 + 1e-9):
            out.append("extrapolated")
        elif math.isclose(t0, t1, rel_tol=1e-6):
            out.append("unchanged")
        else:
            out.append("interpolated")
    return out


def rotation_angles(theta: float, length: int) -> torch.Tensor:
    """r·θ mod 2π for r = 0 … length − 1: ``[length]`` float64 [radians]."""
    return torch.remainder(torch.arange(length, dtype=torch.float64) * theta, TWO_PI)


def alias_distance(theta: float, length: int) -> int | None:
    """The first distance r ≤ length − 1 whose angle r·θ (mod 2π) is smaller than at r − 1 (so
    smaller than at some shorter distance), or None when angles grow monotonically up to there."""
    if theta <= 0:
        return None
    angles = rotation_angles(theta, length)
    drop = (angles[1:] < angles[:-1]).nonzero()
    return int(drop[0]) + 1 if drop.numel() else None


def decay_curve(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """C(r) = (2/d)·Σ_i cos(r·θ_i), r = 0 … length − 1."""
    r = torch.arange(length, dtype=torch.float64)[:, None]
    return torch.cos(r * inv_freq.double()[None]).mean(-1)


def roformer_bound(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """RoFormer's relative upper bound (2/d)·Σ_j |S_j(r)|, S_j(r) = Σ_{k<j} e^{i r θ_k} (Su et al.
    §3.4.3; the attention logit is bounded by this times max_j |h_{j+1} − h_j|)."""
    r = torch.arange(length, dtype=torch.float64)[:, None]
    angle = r * inv_freq.double()[None]  # [L, d/2]
    partial = torch.complex(torch.cos(angle), torch.sin(angle)).cumsum(-1)  # S_1 … S_{d/2}
    return partial.abs().mean(-1)


def base_bound_curve(inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """B(m) = Σ_i cos(m·θ_i), m = 0 … length − 1."""
    return decay_curve(inv_freq, length) * inv_freq.numel()


def first_negative(curve: torch.Tensor) -> int | None:
    """The first index where ``curve`` < 0, or None."""
    neg = (curve < 0).nonzero()
    return int(neg[0]) if neg.numel() else None


def _vanilla(dim: int, base: float) -> torch.Tensor:
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def smallest_base(dim: int, length: int, *, low: float = 2.0, high: float = 1e12, per_decade: int = 100,
                  rel_tol: float = 1e-4) -> float:
    """The smallest base b for which vanilla B(m) = Σ_i cos(m·b^(−2i/d)) ≥ 0 for every m < length.

    Whether B stays non-negative is not monotone in b (at d = 128, L = 4096 bases from 2.9e4
    pass, some near 3.5e4 fail again, all from 4.6e4 pass), so bisection alone would overshoot:
    scan a geometric grid (``per_decade`` points per factor 10) for the first passing base, then
    bisect between it and the grid point before it, to ``rel_tol``. Raises ``ValueError`` when
    no base up to ``high`` passes.
    """

    def ok(b: float) -> bool:
        return first_negative(base_bound_curve(_vanilla(dim, b), length)) is None

    steps = int(math.ceil(math.log10(high / low) * per_decade))
    grid = [low * (high / low) ** (k / steps) for k in range(steps + 1)]
    first = next((k for k, b in enumerate(grid) if ok(b)), None)
    if first is None:
        raise ValueError(f"no base up to {high:g} keeps B(m) >= 0 for m < {length} at d = {dim}")
    if first == 0:
        return low
    lo, hi = math.log(grid[first - 1]), math.log(grid[first])
    while hi - lo > rel_tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(math.exp(mid)) else (mid, hi)
    return math.exp(hi)

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
  θ_i = b^(−2i/d) that bounds the base from below: ``smallest_base`` (a certified walk over b,
  since the passing bases do not form one interval).

All curves are float64 ``[L]`` tensors over r (or m) = 0 … L − 1.
"""

from __future__ import annotations

import math

import torch

from ropescale.errors import InvalidInput

__all__ = [
    "PAIR_CLASSES",
    "alias_distance",
    "base_bound_curve",
    "classify_pairs",
    "decay_curve",
    "first_negative",
    "roformer_bound",
    "rotation_angles",
    "smallest_base",
    "wavelengths",
]

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


_SAMPLE = 4096  # m evaluated per step of the walk before all L of them


def _failure_steps(dim: int, length: int, log_base: float,
                   bounds_at: float | None = None) -> tuple[float, float] | None:
    """How far (in ln b) from ``b = e^log_base`` vanilla B is certified to stay negative somewhere
    below ``length``, upward and downward: ``(up, down)``, or ``None`` when B(m) ≥ 0 for every
    m < length at b (b passes). ``down`` holds only down to ``bounds_at`` (default: b itself,
    so ``down`` is 0), where the derivative bounds are evaluated (they shrink as b grows).

    See ``smallest_base`` for the bounds. Each is the largest certificate over the failing m.
    """
    w = torch.arange(0, dim, 2, dtype=torch.float64) / dim  # w_i = 2i/d: θ_i = e^(−w_i·u), u = ln b
    theta = torch.exp(-w * log_base)  # [d/2]
    # every failing m certifies a step: a strided sample of the m first (a few thousand), all of them
    # only when no sampled m fails (a pass must be checked at every m < L)
    for stride in dict.fromkeys((max(1, length // _SAMPLE), 1)):
        m = torch.arange(0, length, stride, dtype=torch.float64)[:, None]
        a = m * theta  # [L / stride, d/2]: m·θ_i
        curve = torch.cos(a).sum(-1)  # B(m)
        neg = curve < 0
        if bool(neg.any()):
            break
    else:
        return None
    m, a, b = m[neg], a[neg], curve[neg]
    slope = (torch.sin(a) * a * w).sum(-1)  # dB/du

    def reach(a_bound: torch.Tensor, towards: torch.Tensor) -> float:
        k = (a_bound * w).sum(-1)  # K(m) ≥ |dB/du| from here on
        m2 = ((a_bound * a_bound + a_bound) * w * w).sum(-1)  # ≥ |d²B/du²|
        first = -b / k
        second = (-towards + torch.sqrt(towards * towards - 2 * m2 * b)) / m2
        return float(torch.maximum(first, second).max())

    up = reach(a, slope)
    if bounds_at is None or bounds_at >= log_base:
        return up, 0.0
    return up, min(reach(m * torch.exp(-w * bounds_at), -slope), log_base - bounds_at)


def _failure_step(dim: int, length: int, log_base: float) -> float | None:
    """The upward certificate of ``_failure_steps``: every base in [b, b·e^step) fails."""
    steps = _failure_steps(dim, length, log_base)
    return None if steps is None else steps[0]


def _passing_in(dim: int, length: int, lo: float, hi: float, floor: float) -> float | None:
    """A passing ln b in [lo, hi], or None once certificates cover all of it but gaps narrower
    than ``floor``: probes the middle of each uncovered piece, and splits what its certificates
    (up and down) leave uncovered."""
    gaps = [(lo, hi)]
    while gaps:
        g0, g1 = gaps.pop()
        c = g1 if g1 - g0 <= floor else (g0 + g1) / 2
        steps = _failure_steps(dim, length, c, bounds_at=g0)
        if steps is None:
            return c
        up, down = (x * (1 - 1e-9) for x in steps)
        if c - down - g0 > floor:
            gaps.append((g0, c - down))
        if g1 - c - up > floor:
            gaps.append((c + up, g1))
    return None


def smallest_base(dim: int, length: int, *, low: float = 2.0, high: float = 1e12, rel_tol: float = 1e-4) -> float:
    """The smallest base b ≥ ``low`` for which vanilla B(m) = Σ_i cos(m·b^(−2i/d)) ≥ 0 for every
    m < ``length``, to within ``rel_tol``: the returned base passes, and every base below
    returned/(1 + ``rel_tol``) fails. Raises ``ValueError`` when no base up to ``high`` passes.

    Whether B stays non-negative is not monotone in b, and the passing windows below the last
    one can be narrow (d = 16, L = 256: bases 8570–8645 pass, 0.9% wide, then none until
    1.2·10⁴), so any grid can step over one. Instead a *certified walk* in u = ln b, which
    never steps over a passing base:

    With θ_i = e^(−w_i·u), w_i = 2i/d, and a_i = m·θ_i (so da_i/du = −w_i·a_i):

    - B(m) = Σ_i cos a_i,
    - dB/du = Σ_i w_i·a_i·sin a_i, so |dB/du| ≤ K(m) = Σ_i w_i·a_i = m·Σ_i θ_i·2i/d,
    - d²B/du² = −Σ_i w_i²·a_i·(sin a_i + a_i·cos a_i), so |d²B/du²| ≤ M(m) = Σ_i w_i²·(a_i + a_i²).

    K and M only shrink as u grows (every a_i does), so their values at u bound the derivatives
    on all of [u, ∞). At a failing base, pick an m with B(m) < 0; for Δ ≥ 0, by the mean-value
    theorem B(m; u + Δ) ≤ B + K·Δ < 0 while Δ < −B/K: every base in [b, b·e^(−B/K)) fails.
    Taylor's theorem with the second-order bound gives B(m; u + Δ) ≤ B + B'·Δ + M·Δ²/2, negative
    up to its positive root (−B' + √(B'² − 2·M·B))/M — longer steps where B crosses zero
    steeply. The walk starts at ``low``, evaluates B for every m < L, and moves to the end of the
    longest certificate over the failing m (shortened by 1e-9 against rounding); the first base
    where no m fails is the answer. Where certificates shrink below ``rel_tol`` (B about to
    cross zero: steps toward a root only approach it), it settles [u, u + ``rel_tol``] at once:
    it probes the right end and splits whatever the certificates leave uncovered, the same
    bounds also certifying downward from a failing probe (with K and M taken at the left end of
    the piece, where they are largest). Any base it finds passing there is within ``rel_tol``
    of the failing ones below; only pieces narrower than 1e-12 in ln b (below what float64
    resolves of B) are left unsettled. One evaluation of B (L·d/2 cosines) per step: from tens
    of steps (L = 128) to thousands (d = 32, L = 32768).
    """
    u, top = math.log(low), math.log(high)
    while u <= top:
        step = _failure_step(dim, length, u)
        if step is None:
            return math.exp(u)
        step *= 1 - 1e-9
        if step < rel_tol:  # about to cross zero: settle [u, u + rel_tol] at once
            found = _passing_in(dim, length, u + step, u + rel_tol, floor=1e-12)
            if found is not None:
                return math.exp(found)
            step = rel_tol
        u += step
    raise InvalidInput(f"no base up to {high:g} keeps B(m) >= 0 for m < {length} at d = {dim}")

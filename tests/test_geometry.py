"""Rotary geometry against closed forms written out by hand."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ropescale import geometry as geo
from ropescale.strategies import get_strategy


def freqs(name, dim=32, theta=10000.0, train=128, length=1024, **params):
    ctx = {"dim": dim, "rope_theta": theta, "original_max_position_embeddings": train, "seq_len": length}
    return get_strategy(name).compute(ctx, get_strategy(name).validate(params)).inv_freq.double()


def test_vanilla_wavelengths_are_two_pi_b_to_the_2i_over_d():
    lam = geo.wavelengths(freqs("vanilla"))
    expected = [2 * math.pi * 10000.0 ** (2 * i / 32) for i in range(16)]
    assert lam.tolist() == pytest.approx(expected, rel=1e-6)
    assert geo.wavelengths(torch.tensor([0.0, 1.0]))[0] == math.inf


def test_linear_divides_every_frequency_and_ntk_keeps_the_fastest():
    v = freqs("vanilla")
    assert (freqs("linear", factor=4) / v).tolist() == pytest.approx([0.25] * 16, rel=1e-6)
    ntk = freqs("ntk", factor=8)
    assert ntk[0] == v[0] and float(v[-1] / ntk[-1]) == pytest.approx(8.0, rel=1e-5)


def test_pair_classes():
    v = freqs("vanilla")
    # at L = T nothing is extrapolated; past it, exactly the pairs that never turned once in T
    assert geo.classify_pairs(v, v, 128, 128) == ["unchanged"] * 16
    slow = [2 * math.pi / float(t) > 128 for t in v]
    assert geo.classify_pairs(v, v, 128, 1024) == ["extrapolated" if s else "unchanged" for s in slow]
    assert geo.classify_pairs(v, freqs("linear", factor=8), 128, 1024) == ["interpolated"] * 16
    trunc = freqs("base_truncation", truncation_length=128)
    assert geo.classify_pairs(v, trunc, 128, 1024).count("truncated") == int((trunc == 0).sum()) > 0


@pytest.mark.parametrize("theta,expected", [(1.0, 7), (2.0, 4), (0.5, 13), (math.pi / 2, 4)])
def test_alias_distance_by_hand(theta, expected):
    # θ = 1 is the paper's example: angle 6 at distance 6, 7 − 2π ≈ 0.72 at distance 7
    assert geo.alias_distance(theta, 100) == expected


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0.01, max_value=3.0))
def test_alias_distance_is_the_first_wrap(theta):
    turns = 2 * math.pi / theta
    assume(abs(turns - round(turns)) > 1e-6)  # exact multiples land on 0 or just below 2π by rounding
    wrap = math.ceil(turns)  # the first distance whose angle reaches a full turn
    assert geo.alias_distance(theta, 2000) == wrap


def test_pi_over_2n_fastest_angle_at_n_max_is_a_right_angle_and_never_aliases():
    f = freqs("pi_over_2n", n_max=2048)
    assert float(f[0]) * 2048 == pytest.approx(math.pi / 2, rel=1e-6)
    assert geo.alias_distance(float(f[0]), 2049) is None
    assert geo.alias_distance(1.0, 2049) == 7  # vanilla's fastest pair, θ_0 = b^0 = 1


def test_base_bound_and_decay_by_hand():
    theta = torch.tensor([1.0, 0.1], dtype=torch.float64)  # d = 4, b = 100
    b = geo.base_bound_curve(theta, 40)
    for m in (0, 3, 17, 39):
        assert float(b[m]) == pytest.approx(math.cos(m) + math.cos(0.1 * m), abs=1e-12)
    first = next(m for m in range(40) if math.cos(m) + math.cos(0.1 * m) < 0)
    assert geo.first_negative(b) == first
    assert geo.decay_curve(theta, 5).tolist() == pytest.approx(
        [(math.cos(r) + math.cos(0.1 * r)) / 2 for r in range(5)])
    # RoFormer's bound at r = 0: mean of |S_j| = j over j = 1 … d/2
    assert float(geo.roformer_bound(theta, 1)[0]) == pytest.approx(1.5)
    r = 5
    e0, e1 = complex(math.cos(r * 1.0), math.sin(r * 1.0)), complex(math.cos(r * 0.1), math.sin(r * 0.1))
    s1, s2 = e0, e0 + e1  # S_1, S_2 at distance 5
    assert float(geo.roformer_bound(theta, 6)[r]) == pytest.approx((abs(s1) + abs(s2)) / 2)


def passing(dim, length, bases):
    """Brute force: for each base, whether Σ_i cos(m·b^(−2i/d)) ≥ 0 for every m < length."""
    b = torch.tensor(bases, dtype=torch.float64)[:, None, None]
    theta = b ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [n, 1, d/2]
    m = torch.arange(length, dtype=torch.float64)[None, :, None]
    return (torch.cos(m * theta).sum(-1) >= 0).all(-1).tolist()


PER_DECADE = 4000  # the brute-force scan: 0.058% steps


# (16, 256) and (32, 300): the first passing window is narrower than a 100-per-decade grid's step
# (8570–8645 and 4242–4268), which that grid stepped over (1.2e4 and 5.5e3)
@pytest.mark.parametrize("dim,length,window", [(16, 256, (8565, 8645)), (32, 300, (4240, 4269)),
                                               (16, 300, (14860, 15722)), (8, 64, None)])
def test_smallest_base_against_a_brute_force_scan(dim, length, window):
    rel_tol = 1e-5
    found = geo.smallest_base(dim, length, rel_tol=rel_tol)
    scan = [10 ** (k / PER_DECADE) for k in range(int(0.31 * PER_DECADE), 5 * PER_DECADE)]  # 2 … 1e5
    ok = passing(dim, length, scan)
    first = scan[ok.index(True)]
    assert passing(dim, length, [found]) == [True]
    # no scanned base below it passes, and it is no higher than the first scanned base that passes
    assert not any(o for b, o in zip(scan, ok) if b < found / (1 + rel_tol))
    assert first / 10 ** (1 / PER_DECADE) < found <= first * (1 + rel_tol)
    if window:
        assert window[0] <= found <= window[1]


def test_failure_certificate_holds():
    """Every base in [b, b·e^Δ) that the walk steps over fails (checked densely), and Δ > 0."""
    dim, length = 16, 256
    for b in (50.0, 900.0, 8000.0, 8500.0, 11000.0):
        step = geo._failure_step(dim, length, math.log(b))
        assert step is not None and step > 0
        inside = [b * math.exp(step * k / 400) for k in range(400)]
        assert not any(passing(dim, length, inside))
    assert geo._failure_step(dim, length, math.log(8600.0)) is None  # inside the narrow window


def test_downward_failure_certificate_holds():
    """From a failing base b, with the bounds taken at a lower base b0: every base in
    (b·e^(−down), b] fails, and down never reaches below b0."""
    dim, length = 16, 256
    for b0, b in ((40.0, 50.0), (800.0, 900.0), (8000.0, 8560.0), (8650.0, 9000.0), (9000.0, 11000.0)):
        up, down = geo._failure_steps(dim, length, math.log(b), bounds_at=math.log(b0))
        assert 0 < down <= math.log(b / b0) + 1e-12 and up > 0
        inside = [b * math.exp(-down * k / 400) for k in range(400)]
        assert not any(passing(dim, length, inside))
    assert geo._failure_steps(dim, length, math.log(8600.0), bounds_at=math.log(8000.0)) is None
    # the narrow window lies between the certificates from either side
    lo, hi = math.log(8000.0), math.log(9000.0)
    found = geo._passing_in(dim, length, lo, hi, floor=1e-12)
    assert found is not None and passing(dim, length, [math.exp(found)]) == [True]
    assert 8565 <= math.exp(found) <= 8645
    assert geo._passing_in(dim, length, math.log(9000.0), math.log(11000.0), floor=1e-12) is None

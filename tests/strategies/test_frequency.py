"""Each frequency strategy against its formula written out naively (float64, plain loops)."""

import math

import pytest
import torch

from ropescale.strategies import get_strategy
from ropescale.strategies.frequency import dynamic_ntk, linear, ntk, pi_over_2n, vanilla

DIMS = [32, 64, 128]
BASES = [10000.0, 500000.0]


def naive_theta(d, b):
    return [b ** (-2 * i / d) for i in range(d // 2)]


def close(tensor, expected, rtol=2e-6):
    assert tensor.dtype == torch.float32 and tensor.shape == (len(expected),)
    torch.testing.assert_close(tensor.double(), torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=0)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("b", BASES)
def test_vanilla_formula(d, b):
    inv_freq, att = vanilla(d, b)
    close(inv_freq, naive_theta(d, b))
    assert att == 1.0


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("s", [1.0, 2.0, 8.0, 16.5])
def test_linear_is_vanilla_over_factor(d, s):
    inv_freq, att = linear(d, 10000.0, s)
    close(inv_freq, [t / s for t in naive_theta(d, 10000.0)])
    assert torch.equal(inv_freq, vanilla(d, 10000.0).inv_freq / s) and att == 1.0


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("s", [2.0, 8.0])
def test_ntk_formula_and_endpoints(d, s):
    b2 = 10000.0 * s ** (d / (d - 2))
    inv_freq, _ = ntk(d, 10000.0, s)
    close(inv_freq, naive_theta(d, b2), rtol=1e-5)
    # NTK keeps the highest frequency and divides the lowest by exactly s
    assert inv_freq[0] == 1.0
    assert math.isclose(inv_freq[-1].item(), naive_theta(d, 10000.0)[-1] / s, rel_tol=1e-5)


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("s", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("L", [10, 128, 129, 512, 4096])
def test_dynamic_ntk_formula(d, s, L):
    T = 128
    got, att = dynamic_ntk(d, 10000.0, T, L, s)
    if L <= T:
        assert torch.equal(got, vanilla(d, 10000.0).inv_freq)  # exactly vanilla up to L_train
    else:
        b2 = 10000.0 * ((s * L / T) - (s - 1)) ** (d / (d - 2))
        close(got, naive_theta(d, b2), rtol=1e-5)
    assert att == 1.0


def test_dynamic_ntk_factor_one_equals_static_ntk_at_ratio():
    # with factor 1 the scale is α = L / L_train: a single forward equals static NTK with s = L/T
    assert torch.equal(dynamic_ntk(32, 1e4, 128, 1024, 1.0).inv_freq, ntk(32, 1e4, 8.0).inv_freq)


@pytest.mark.parametrize("name", ["linear", "ntk", "yarn"])
def test_factor_is_filled_from_sweep_length(name):
    s = get_strategy(name)
    assert s.resolve({}, length=1024, train_length=128)["factor"] == 8.0
    with pytest.raises(ValueError, match="factor is required"):
        s.validate({})


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("n_max", [128.0, 4096.0])
def test_pi_over_2n_formula_and_no_aliasing(d, n_max):
    inv_freq, att = pi_over_2n(d, 1e4, n_max)
    close(inv_freq, [math.pi / (2 * n_max) * 1e4 ** (-t / d) for t in range(0, d, 2)])
    # every pair's angle at n_max is at most π/2 (the fastest exactly π/2): monotone in distance
    angles = inv_freq.double() * n_max
    assert math.isclose(angles[0].item(), math.pi / 2, rel_tol=1e-6) and (angles <= math.pi / 2 + 1e-6).all()
    assert att == 1.0

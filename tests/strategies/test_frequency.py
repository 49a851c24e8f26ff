"""Each frequency strategy against its formula written out naively (float64, plain loops)."""

import math

import pytest
import torch

from ropescale.strategies import get_strategy
from ropescale.strategies.frequency import dynamic_ntk, linear, ntk, vanilla, yarn

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


def naive_yarn(d, b, T, s, beta_fast=32.0, beta_slow=1.0):
    def fcd(r):
        return d * math.log(T / (2 * math.pi * r)) / (2 * math.log(b))

    low, high = max(math.floor(fcd(beta_fast)), 0), min(math.ceil(fcd(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, t in enumerate(naive_theta(d, b)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(t * (1 - ramp) + (t / s) * ramp)
    return out, (0.1 * math.log(s) + 1 if s > 1 else 1.0), (low, high)


@pytest.mark.parametrize("d,b,T", [(32, 1e4, 128), (128, 1e4, 4096), (64, 5e5, 2048)])
@pytest.mark.parametrize("s", [1.0, 2.0, 8.0])
@pytest.mark.parametrize("betas", [(32.0, 1.0), (16.0, 2.0)])
def test_yarn_formula(d, b, T, s, betas):
    inv_freq, att = yarn(d, b, T, s, *betas, None)
    expected, expected_att, _ = naive_yarn(d, b, T, s, *betas)
    close(inv_freq, expected, rtol=1e-5)
    assert math.isclose(att, expected_att, rel_tol=1e-12)


def test_yarn_llama2_correction_range_from_paper_setup():
    # Llama-2 (d=128, b=1e4, L=4096), beta 32/1: dims below 20 extrapolate, from 46 interpolate
    _, _, (low, high) = naive_yarn(128, 1e4, 4096, 4.0)
    assert (low, high) == (20, 46)
    inv_freq, _ = yarn(128, 1e4, 4096, 4.0, 32.0, 1.0, None)
    theta = vanilla(128, 1e4).inv_freq
    assert torch.equal(inv_freq[:21], theta[:21])  # ramp is 0 up to and including `low`
    torch.testing.assert_close(inv_freq[46:], theta[46:] / 4.0, rtol=1e-6, atol=0)
    assert (inv_freq[21:46] < theta[21:46]).all() and (inv_freq[21:46] > theta[21:46] / 4).all()


def test_yarn_attention_factor_override():
    assert yarn(32, 1e4, 128, 4.0, 32.0, 1.0, 1.5).attention_factor == 1.5


def test_yarn_factor_one_is_vanilla():
    f = yarn(64, 1e4, 128, 1.0, 32.0, 1.0, None)
    # equal up to rounding of the ramp blend θ·(1 − r) + θ·r (transformers rounds the same way)
    torch.testing.assert_close(f.inv_freq, vanilla(64, 1e4).inv_freq, rtol=1e-6, atol=0)
    assert f.attention_factor == 1.0


@pytest.mark.parametrize("name", ["linear", "ntk", "yarn"])
def test_factor_is_filled_from_sweep_length(name):
    s = get_strategy(name)
    assert s.validate({}, fill_auto={"scale": 8.0})["factor"] == 8.0
    with pytest.raises(ValueError, match="factor is required"):
        s.validate({})

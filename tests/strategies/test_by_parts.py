"""Per-dimension rules against their formulas written out naively (plain Python floats)."""

import math

import pytest
import torch

from ropescale.errors import InvalidInput
from ropescale.strategies import get_strategy
from ropescale.strategies.by_parts import (
    base_truncation,
    dynamic_yarn,
    llama3,
    longrope,
    ntk_by_parts,
    yarn,
)
from ropescale.strategies.frequency import vanilla
from tests.strategies.test_frequency import close, naive_theta


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


@pytest.mark.parametrize("s", [2.0, 8.0])
def test_ntk_by_parts_is_yarn_without_temperature(s):
    f = ntk_by_parts(64, 1e4, 256, s, 32.0, 1.0)
    expected, _, _ = naive_yarn(64, 1e4, 256, s)
    close(f.inv_freq, expected, rtol=1e-5)
    assert f.attention_factor == 1.0


@pytest.mark.parametrize("L", [50, 128, 129, 300, 1024])
def test_dynamic_yarn_uses_current_length(L):
    f = dynamic_yarn(32, 1e4, 128, L, 32.0, 1.0)
    s = max(1.0, L / 128)
    expected, att, _ = naive_yarn(32, 1e4, 128, s)
    close(f.inv_freq, expected, rtol=1e-5)
    assert math.isclose(f.attention_factor, att)


def naive_llama3(d, b, T, s, low, high):
    out = []
    for t in naive_theta(d, b):
        wavelen = 2 * math.pi / t
        if wavelen < T / high:
            out.append(t)
        elif wavelen > T / low:
            out.append(t / s)
        else:
            g = (T / wavelen - low) / (high - low)
            out.append((1 - g) * t / s + g * t)
    return out


@pytest.mark.parametrize("d,b,T", [(128, 500000.0, 8192), (32, 1e4, 128)])
@pytest.mark.parametrize("s,low,high", [(8.0, 1.0, 4.0), (4.0, 2.0, 8.0)])
def test_llama3_formula(d, b, T, s, low, high):
    f = llama3(d, b, T, s, low, high)
    close(f.inv_freq, naive_llama3(d, b, T, s, low, high), rtol=1e-5)
    assert f.attention_factor == 1.0


def transformers_llama3(d, b, T, s, low, high):
    """transformers' own llama3 initialiser (``ROPE_INIT_FUNCTIONS["llama3"]``) on a Llama config of these
    numbers: ``(inv_freq [d/2], attention_factor)``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=16 * T,
                      rope_parameters={"rope_type": "llama3", "rope_theta": b, "factor": s, "low_freq_factor": low,
                                       "high_freq_factor": high, "original_max_position_embeddings": T})
    return ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")


# meta-llama/Llama-4-Scout-17B-16E's text config: head_dim 128, rope_theta 5e5, rope_scaling llama3 with factor 16,
# low_freq_factor = high_freq_factor = 1, original_max_position_embeddings 8192
SCOUT = {"dim": 128, "rope_theta": 500000.0, "original_max_position_embeddings": 8192}


def test_llama3_takes_llama4s_equal_frequency_factors():
    """Llama 4 ships low_freq_factor = high_freq_factor (no smooth band): refused before ("must be greater
    than"), computed by transformers as θ_i below T and θ_i/16 above. Oracles: transformers' own
    initialiser, bit for bit, and the formula written out naively."""
    strat = get_strategy("llama3")
    params = strat.validate({"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0})
    f = strat.compute(SCOUT, params)
    want, att = transformers_llama3(128, 500000.0, 8192, 16.0, 1.0, 1.0)
    assert torch.equal(f.inv_freq, want) and f.attention_factor == att == 1.0
    close(f.inv_freq, naive_llama3(128, 500000.0, 8192, 16.0, 1.0, 1.0), rtol=1e-5)
    theta = vanilla(128, 500000.0).inv_freq
    wavelen = 2 * math.pi / theta
    assert 0 < int((wavelen > 8192).sum()) < 64  # both sides of the boundary are there
    assert torch.equal(f.inv_freq, torch.where(wavelen > 8192, theta / 16, theta))
    with pytest.raises(InvalidInput, match="high_freq_factor=1.0 must be at least low_freq_factor=4.0"):
        strat.validate({"factor": 16.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0})


def test_llama3_at_equal_factors_a_wavelength_on_the_boundary_is_scaled():
    """Equal factors whose boundary T/low_freq_factor is exactly one pair's wavelength λ_k (float32): there
    transformers' smooth factor is 0/0 and its θ_k NaN; the strategy gives θ_k/s (vLLM's g = 0, the band's
    long end) and transformers' value at every other pair."""
    theta = vanilla(128, 500000.0).inv_freq
    k = 40
    low = 8192 / float(2 * math.pi / theta[k])  # T / low_freq_factor == λ_k in float32
    want, _ = transformers_llama3(128, 500000.0, 8192, 16.0, low, low)
    assert not math.isfinite(float(want[k]))  # the oracle's own 0/0 at the boundary
    got = llama3(128, 500000.0, 8192, 16.0, low, low).inv_freq
    assert float(got[k]) == float(theta[k] / 16)
    others = torch.arange(64) != k
    assert torch.equal(got[others], want[others])


def test_longrope_formula_and_switch():
    d, T = 32, 128
    short = [1.0 + 0.01 * i for i in range(d // 2)]
    long = [1.0 + 0.5 * i for i in range(d // 2)]
    theta = naive_theta(d, 1e4)
    for L, ext in ((128, short), (129, long)):
        f = longrope(d, 1e4, T, L, short, long, 4.0, None)
        close(f.inv_freq, [t / e for t, e in zip(theta, ext)])
        assert math.isclose(f.attention_factor, math.sqrt(1 + math.log(4.0) / math.log(T)))
    assert longrope(d, 1e4, T, 10, short, long, 1.0, None).attention_factor == 1.0
    with pytest.raises(ValueError, match="long_factor has 3 entries; the model's rotary dim 32 needs 16"):
        longrope(d, 1e4, T, 200, short, [1.0, 1.0, 1.0], 2.0, None)


def naive_truncation(d, b, a, c, rho):
    return [t if t >= c else (rho if t >= a else 0.0) for t in naive_theta(d, b)]


def test_base_truncation_explicit_thresholds():
    f = base_truncation(64, 1e4, None, 0.001, 0.05, 0.01)
    close(f.inv_freq, naive_truncation(64, 1e4, 0.001, 0.05, 0.01))
    theta = vanilla(64, 1e4).inv_freq
    assert (f.inv_freq[theta >= 0.05] == theta[theta >= 0.05]).all() and (f.inv_freq[theta < 0.001] == 0).all()


@pytest.mark.parametrize("T_trunc", [128.0, 4096.0])
def test_base_truncation_giraffe_single_length_form(T_trunc):
    # Giraffe: t = 2π/T, low = 2π/(16T), z = 8: ft = where(f < t, low, f); ft = where(f < t/z, 0, ft)
    c = 2 * math.pi / T_trunc
    f = base_truncation(128, 1e4, T_trunc, None, None, None)
    rho = 2 * math.pi / (16 * T_trunc)
    close(f.inv_freq, naive_truncation(128, 1e4, c / 8, c, rho))
    # all three classes, as many pairs in each as the thresholds put there: θ < c/8 → 0,
    # c/8 ≤ θ < c → ρ, θ ≥ c kept
    theta = naive_theta(128, 1e4)
    zeros, low = sum(t < c / 8 for t in theta), sum(c / 8 <= t < c for t in theta)
    assert zeros > 0 and low > 0 and zeros + low < 64
    assert int((f.inv_freq == 0).sum()) == zeros
    assert int(torch.isclose(f.inv_freq, torch.tensor(rho, dtype=f.inv_freq.dtype), rtol=1e-6, atol=0).sum()) == low
    kept = [t for t in theta if t >= c]  # θ falls with i: the first pairs
    assert len(kept) == 64 - zeros - low
    close(f.inv_freq[: len(kept)], kept)


@pytest.mark.parametrize("params,match", [
    ({}, "give truncation_length, or all of a, c and rho"),
    ({"truncation_length": 128, "c": 0.1}, "not both"),
    ({"a": 0.2, "c": 0.1, "rho": 0.01}, "a=0.2 must be below c=0.1"),
])
def test_base_truncation_validation(params, match):
    with pytest.raises(ValueError, match=match):
        get_strategy("base_truncation").validate(params)


def test_list_parameters_are_validated():
    s = get_strategy("longrope")
    with pytest.raises(ValueError, match="short_factor=.* must be a non-empty list"):
        s.validate({"short_factor": 2.0, "long_factor": [1.0], "factor": 2})
    with pytest.raises(ValueError, match="out of range"):
        s.validate({"short_factor": [1.0, -1.0], "long_factor": [1.0, 1.0], "factor": 2})

import math

import pytest
import torch

import ropescale
from ropescale.errors import InvalidInput
from ropescale.serving import EngineRope, compare, ropescale_rope
from ropescale.serving.rope import compare_layers, ropescale_layer_ropes
from tests.serving.conftest import G_D, GLOBAL, LOCAL, THETA, D, T, gemma3_patched, patched, vanilla_inv_freq


def test_ropescale_rope_reads_the_patch_at_the_served_length():
    ours = ropescale_rope(patched("linear", factor=4.0), 256)
    assert ours.inv_freq.dtype == torch.float64 and ours.inv_freq.shape == (D // 2,)
    assert torch.allclose(ours.inv_freq, vanilla_inv_freq() / 4, rtol=1e-6)
    assert ours.magnitude == 1.0 and ours.softmax_scale == 1.0


def test_dynamic_strategies_are_read_at_the_length():
    model = patched("dynamic_ntk", factor=2.0)
    assert torch.allclose(ropescale_rope(model, T).inv_freq, vanilla_inv_freq(), rtol=1e-6)
    alpha = 2.0 * 256 / T - 1
    assert torch.allclose(ropescale_rope(model, 256).inv_freq, vanilla_inv_freq(THETA * alpha ** (D / (D - 2))),
                          rtol=1e-6)


def test_log_n_shows_as_the_softmax_scale_of_the_last_position():
    model = patched("ntk", factor=2.0, logn=True)
    assert ropescale_rope(model, 256).softmax_scale == pytest.approx(math.log(256) / math.log(T))


def test_unpatched_models_relative_rules_and_bad_lengths_are_one_line_errors(tiny_llama):
    with pytest.raises(InvalidInput, match="not patched"):
        ropescale_rope(tiny_llama, 128)
    with pytest.raises(InvalidInput, match="relative-position rule"):
        ropescale_rope(patched("rerope", window=16), 128)
    with pytest.raises(InvalidInput, match="length"):
        ropescale_rope(patched("vanilla"), 1)
    ropescale.unpatch(tiny_llama)


def _rope(inv, magnitude=1.0, **kw):
    return EngineRope(torch.tensor(inv, dtype=torch.float64), magnitude, **kw)


def test_compare_same_within_tolerances():
    v = compare(_rope([1.0, 0.1]), _rope([1.0 + 5e-6, 0.1], 1.0 + 5e-7), 100)
    assert v.same and v.verdict == "same"
    assert v.max_rel_freq_diff == pytest.approx(5e-6)
    assert v.max_angle_diff == pytest.approx(5e-6 * 99)


def test_compare_names_each_reason():
    v = compare(_rope([1.0, 0.1]), _rope([1.0, 0.2], 1.1, softmax_scale=2.0), 10)
    assert not v.same and v.verdict.startswith("differs: ")
    assert "pair 1" in v.verdict and "magnitude" in v.verdict and "softmax" in v.verdict
    assert v.max_angle_diff == pytest.approx(0.1 * 9)


def test_compare_an_engine_failure_or_nan_is_never_same():
    v = compare(_rope([1.0]), _rope([1.0], failure="vLLM returns NaN from position 64 on"), 128)
    assert not v.same and "NaN" in v.verdict
    v = compare(_rope([1.0]), _rope([math.nan], math.nan), 128)
    assert not v.same
    assert not compare(_rope([1.0, 2.0]), _rope([1.0]), 8).same


def test_ropescale_layer_ropes_gives_the_patched_types_first_then_the_kept_ones_as_shipped():
    ropes = ropescale_layer_ropes(gemma3_patched("linear", factor=4.0), 256)
    assert list(ropes) == ["full_attention", "sliding_attention"]
    assert torch.allclose(ropes["full_attention"].inv_freq, vanilla_inv_freq(GLOBAL, G_D) / 4, rtol=1e-6)
    assert torch.allclose(ropes["sliding_attention"].inv_freq, vanilla_inv_freq(LOCAL, G_D), rtol=1e-6)
    assert ropes["sliding_attention"].magnitude == 1.0
    assert list(ropescale_layer_ropes(patched("linear", factor=4.0), 256)) == [None]


def test_compare_layers_is_same_only_when_every_type_is_and_names_the_types_that_differ():
    ours = {"full_attention": _rope([1.0, 0.1], 1.2), "sliding_attention": _rope([1.0, 0.5])}
    v = compare_layers(ours, {"sliding_attention": _rope([1.0, 0.5]), "full_attention": _rope([1.0, 0.1], 1.2)}, 10)
    assert v.same and v.verdict == "same (per layer type: full_attention, sliding_attention)"
    v = compare_layers(ours, {"full_attention": _rope([1.0, 0.1], 1.2), "sliding_attention": _rope([1.0, 0.25])}, 10)
    assert not v.same and v.verdict.startswith("differs: sliding_attention: frequencies differ by up to 0.5")
    assert v.max_rel_freq_diff == pytest.approx(0.5) and v.max_angle_diff == pytest.approx(0.25 * 9)
    v = compare_layers(ours, {"full_attention": _rope([1.0, 0.1], 1.0)}, 10)
    assert not v.same and "full_attention: cos/sin magnitude" in v.verdict
    assert "sliding_attention: the engine computes no rotation" in v.verdict

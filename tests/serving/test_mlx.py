"""MLX (mlx-lm 0.32.2): every frequency strategy exported and read back as mlx-lm reads a config.json
(``mlx_rope``) gives ropescale's rotation; ``mlx_rope`` checked against mlx-lm's formulas written out
here from its source (``mlx_lm/models/rope_utils.py``, ``llama.py``, ``gemma3_text.py``); what mlx-lm
cannot express refused in one line. The real engine: ``tests/serving/test_real_engines.py``."""

import math

import pytest
import torch

from ropescale.serving import ExportRefused, compare, ropescale_rope
from ropescale.serving.engines.mlx import export_mlx, mlx_layer_ropes, mlx_rope
from ropescale.serving.rope import compare_layers, ropescale_layer_ropes
from tests.serving.conftest import FREQUENCY, LONG, RELATIVE, SHORT, THETA, D, T, gemma3_patched, patched


def _legacy(scaling=None, theta=None, mpe=None, **top):
    """A config.json as mlx-lm reads it: top-level rope_theta / rope_scaling (transformers 4 keys)."""
    c = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, **top}
    if theta is not None:
        c["rope_theta"] = theta
    if scaling is not None:
        c["rope_scaling"] = scaling
    if mpe is not None:
        c["max_position_embeddings"] = mpe
    return c


def _inv(base, d=D):
    return torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)


@pytest.mark.parametrize("length", [48, 256])
@pytest.mark.parametrize("case", sorted(FREQUENCY))
def test_every_frequency_strategy_is_served_exactly(case, length):
    name, params = FREQUENCY[case]
    model = patched(name, **params)
    export = export_mlx(model, length)
    theirs, ours = mlx_rope(export.config, length), ropescale_rope(model, length)
    assert theirs.failure is None
    assert torch.allclose(theirs.inv_freq, ours.inv_freq, rtol=1e-5, atol=0)
    if case == "longrope_attention":  # A = 1.5 through an integer max_position_embeddings: round(T^(A²))
        assert theirs.magnitude == pytest.approx(math.sqrt(1 + math.log(round(T ** 2.25) / T) / math.log(T)))
        assert abs(theirs.magnitude - ours.magnitude) <= 2e-6  # the rounding, at T = 64
        return
    assert abs(theirs.magnitude - ours.magnitude) <= 1e-6
    assert compare(ours, theirs, length).same


def test_the_export_writes_the_transformers_4_keys_mlx_reads():
    yarn = export_mlx(patched("yarn", factor=4.0, attention_factor=1.3), 256).keys
    assert yarn["rope_scaling"]["type"] == "yarn" and yarn["rope_scaling"]["original_max_position_embeddings"] == T
    assert 0.1 * yarn["rope_scaling"]["mscale"] * math.log(4.0) + 1 == pytest.approx(1.3)  # no attention_factor key
    ntk = export_mlx(patched("ntk", factor=4.0), 256).keys
    assert ntk["rope_scaling"] is None and ntk["rope_theta"] == pytest.approx(THETA * 4 ** (D / (D - 2)))
    longrope = export_mlx(patched("longrope", factor=4.0, short_factor=SHORT, long_factor=LONG), 48).keys
    assert longrope["rope_scaling"]["long_factor"] == SHORT  # mlx-lm always reads long_factor: ropescale's set at L
    llama3 = export_mlx(patched("llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0), 256).keys
    assert llama3["rope_scaling"]["original_max_position_embeddings"] == T  # mlx-lm's default is 8192


def test_save_patcheds_config_is_plain_rope_at_base_10000_for_mlx():
    """transformers 5 writes rope_parameters; mlx-lm's Llama reads rope_theta (default 10 000) and rope_scaling."""
    written = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": T,
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0}}
    got = mlx_rope(written, 256)
    assert torch.allclose(got.inv_freq, _inv(10000.0), rtol=1e-6) and got.magnitude == 1.0


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_rules_are_refused_naming_mlx(name):
    with pytest.raises(ExportRefused, match=r"^MLX: .*relative-position rule"):
        export_mlx(patched(name, **RELATIVE[name]), 256)


def test_what_mlx_cannot_express_is_refused_in_one_line():
    from transformers import PhiConfig, PhiForCausalLM

    import ropescale
    from tests.conftest import build

    phi = build(PhiForCausalLM, PhiConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, max_position_embeddings=64))
    ropescale.patch(phi, "linear", factor=2.0)
    with pytest.raises(ExportRefused, match=r"^MLX: mlx-lm 0\.32\.2's phi model is not one whose rope keys") as e:
        export_mlx(phi, 128)
    assert "\n" not in str(e.value)
    with pytest.raises(ExportRefused, match=r"^MLX: .*rounds YaRN's correction range"):
        export_mlx(_yarn_untruncated(), 256)


def _yarn_untruncated():
    from transformers import LlamaForCausalLM

    import ropescale
    from tests.conftest import build, tiny_llama_config

    config = tiny_llama_config()
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": THETA, "truncate": False,
                              "original_max_position_embeddings": T}
    model = build(LlamaForCausalLM, config)
    ropescale.patch(model, "native")
    return model


# mlx_rope against mlx-lm's formulas, written out from rope_utils.py


def test_mlx_defaults_when_keys_are_missing():
    assert torch.allclose(mlx_rope(_legacy(), 64).inv_freq, _inv(10000.0), rtol=1e-6)
    g = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    assert torch.allclose(mlx_rope(g, 64, layer_type="full_attention").inv_freq, _inv(1e6), rtol=1e-6)
    assert torch.allclose(mlx_rope(g, 64, layer_type="sliding_attention").inv_freq, _inv(1e4), rtol=1e-6)


def test_mlx_dynamic_recomputes_the_base_from_the_length():
    c = _legacy({"type": "dynamic", "factor": 2.0}, THETA, T)
    for n in (32, 256):
        seq = max(n, T)
        base = THETA * (2.0 * seq / T - 1.0) ** (D / (D - 2))
        assert torch.allclose(mlx_rope(c, n).inv_freq, _inv(base), rtol=1e-5)


def test_mlx_yarn_ignores_attention_factor_and_truncate():
    sc = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": T, "attention_factor": 2.0,
          "truncate": False}
    got = mlx_rope(_legacy(sc, THETA, T), 256)
    assert got.magnitude == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # floor/ceil correction dims of d·ln(T/(2π·β))/(2 ln b), β = 32 and 1
    low = max(math.floor(D * math.log(T / (32 * 2 * math.pi)) / (2 * math.log(THETA))), 0)
    high = min(math.ceil(D * math.log(T / (1 * 2 * math.pi)) / (2 * math.log(THETA))), D - 1)
    expect = []
    for i in range(D // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrap = THETA ** (-2 * i / D)
        expect.append(extrap * (1 - ramp) + extrap / 4.0 * ramp)
    assert torch.allclose(got.inv_freq, torch.tensor(expect, dtype=torch.float64), rtol=1e-5)
    deepseek = mlx_rope(_legacy({**sc, "mscale": 1.0, "mscale_all_dim": 1.0}, THETA, T), 256)
    assert deepseek.magnitude == pytest.approx(1.0)


def test_mlx_longrope_uses_the_long_factors_for_every_length():
    sc = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": T}
    for n in (32, 256):
        got = mlx_rope(_legacy(sc, THETA, 4 * T), n)
        assert torch.allclose(got.inv_freq, _inv(THETA) / torch.tensor(LONG, dtype=torch.float64), rtol=1e-5)
        assert got.magnitude == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(T)))


def test_mlx_llama3_defaults_to_an_8192_window():
    sc = {"type": "llama3", "factor": 8.0}
    got = mlx_rope(_legacy(sc, 500000.0, 131072, hidden_size=512, num_attention_heads=4), 1024)
    d = 128
    inv = _inv(500000.0, d)
    wl = 2 * math.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wl - 1.0) / 3.0
    expect = torch.where(wl > low_wl, inv / 8, torch.where(wl < high_wl, inv, (1 - smooth) * inv / 8 + smooth * inv))
    assert torch.allclose(got.inv_freq, expect, rtol=1e-5)


def test_unknown_model_types_and_rope_types_fail():
    assert mlx_rope({**_legacy(), "model_type": "phi"}, 64).failure.startswith("MLX: no re-implementation")
    assert "'mrope'" in mlx_rope(_legacy({"type": "mrope", "mrope_section": [2, 3, 3]}, THETA), 64).failure


# Gemma 3: one pattern of sliding layers (rope_local_base_freq) and global ones (rope_theta, rope_scaling)


@pytest.mark.parametrize("name, params", [("yarn", {"factor": 4.0}), ("linear", {"factor": 4.0}),
                                          ("ntk", {"factor": 4.0}), ("vanilla", {})])
def test_gemma3_global_patch_is_served_per_layer_type(name, params):
    model = gemma3_patched(name, **params)
    export = export_mlx(model, 256)
    assert export.keys["sliding_window_pattern"] == 6 and export.keys["rope_local_base_freq"] == 10000.0
    assert export.keys["rope_theta"] == (1e6 if name != "ntk" else pytest.approx(1e6 * 4 ** (16 / 14)))
    v = compare_layers(ropescale_layer_ropes(model, 256), mlx_layer_ropes(export.config, 256), 256)
    assert v.same, v.verdict


def test_gemma3_scaled_sliding_layers_are_refused_in_one_line():
    model = gemma3_patched("yarn", layer_types=["sliding_attention", "full_attention"], factor=4.0)
    with pytest.raises(ExportRefused, match=r"^MLX: mlx-lm's gemma3_text gives sliding-window layers a base only"):
        export_mlx(model, 256)
    raised = export_mlx(gemma3_patched("ntk", layer_types=["sliding_attention", "full_attention"], factor=4.0), 256)
    assert raised.keys["rope_local_base_freq"] == pytest.approx(1e4 * 4 ** (16 / 14))

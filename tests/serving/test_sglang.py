"""SGLang 0.5.23 (re-implementation only: its wheel needs CUDA): every frequency strategy exported and
read back as SGLang reads a config.json (``sglang_rope``) gives ropescale's rotation; ``sglang_rope``
against SGLang's formulas written out here from its source (``layers/rotary_embedding/factory.py``,
``yarn.py``, ``rope_variant.py``, ``models/llama.py``, ``models/gemma3_causal.py``); Gemma 3's scaled
layer types refused, and the shipped linear ×8 seen unscaled."""

import math

import pytest
import torch

from ropescale.serving import ExportRefused, compare, ropescale_rope
from ropescale.serving.engines.sglang import export_sglang, sglang_layer_ropes, sglang_rope
from ropescale.serving.rope import compare_layers, ropescale_layer_ropes
from tests.serving.conftest import FREQUENCY, RELATIVE, THETA, D, T, gemma3_patched, patched


def _config(rp, mpe=T):
    return {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": mpe,
            "rope_parameters": {"rope_theta": THETA, **rp}}


@pytest.mark.parametrize("length", [48, 256])
@pytest.mark.parametrize("case", sorted(FREQUENCY))
def test_every_frequency_strategy_is_served_exactly(case, length):
    name, params = FREQUENCY[case]
    model = patched(name, **params)
    export = export_sglang(model, length)
    theirs, ours = sglang_rope(export.config, length), ropescale_rope(model, length)
    assert theirs.failure is None
    assert torch.allclose(theirs.inv_freq, ours.inv_freq, rtol=1e-5, atol=0)
    assert abs(theirs.magnitude - ours.magnitude) <= 1e-6
    assert compare(ours, theirs, length).same


def test_yarn_attention_factor_is_written_as_sglangs_attn_factor():
    rp = export_sglang(patched("yarn", factor=4.0, attention_factor=1.3), 256).config["rope_parameters"]
    assert rp["attn_factor"] == pytest.approx(1.3 / (0.1 * math.log(4.0) + 1))
    # SGLang never reads attention_factor: without attn_factor the magnitude is 0.1·ln s + 1
    plain = sglang_rope(_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": T,
                                 "attention_factor": 1.3}, 4 * T), 256)
    assert plain.magnitude == pytest.approx(0.1 * math.log(4.0) + 1)


def test_sglang_dynamic_is_static_at_mpe_times_factor():
    got = sglang_rope(_config({"rope_type": "dynamic", "factor": 2.0}), 256)
    base = THETA * (2.0 * (2 * T) / T - 1.0) ** (D / (D - 2))
    want = torch.tensor([base ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    assert torch.allclose(got.inv_freq, want, rtol=1e-5)


def test_sglang_context_length_is_mpe_times_factor_without_original():
    assert sglang_rope(_config({"rope_type": "linear", "factor": 4.0}), 4 * T).failure is None
    assert "context length" in sglang_rope(_config({"rope_type": "linear", "factor": 4.0}), 4 * T + 1).failure


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_rules_are_refused_naming_sglang(name):
    with pytest.raises(ExportRefused, match=r"^SGLang: .*relative-position rule"):
        export_sglang(patched(name, **RELATIVE[name]), 256)


def test_gemma3_raised_base_is_exported_and_a_scaled_type_refused_in_one_line():
    model = gemma3_patched("ntk", factor=4.0)
    export = export_sglang(model, 256)
    assert compare_layers(ropescale_layer_ropes(model, 256), sglang_layer_ropes(export.config, 256), 256).same
    with pytest.raises(ExportRefused, match=r"^SGLang: SGLang 0\.5\.23's gemma3_causal\.py rotates every layer with "
                                            r"rope_type default .*full_attention layers' 'yarn'") as e:
        export_sglang(gemma3_patched("yarn", factor=4.0), 256)
    assert "\n" not in str(e.value)


def test_sglang_serves_gemma3s_shipped_linear_global_layers_unscaled():
    """The 4B+ Gemma 3 checkpoints ship linear ×8 on their global layers (θ_i = b^(−2i/d)/8, as transformers
    rotates them); SGLang 0.5.23 rotates them at the plain global base (gemma3_causal.py overwrites the
    layer's rope scaling)."""
    from tests.conftest import tiny_gemma3_config

    shipped = tiny_gemma3_config(rope_type="linear", factor=8.0).to_dict()
    ropes = sglang_layer_ropes(shipped, 256)
    plain = torch.tensor([1e6 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)
    assert torch.allclose(ropes["full_attention"].inv_freq, plain, rtol=1e-6)  # transformers: plain / 8
    assert "the config's 'linear' is not applied" in ropes["full_attention"].note
    local = torch.tensor([1e4 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)
    assert torch.allclose(ropes["sliding_attention"].inv_freq, local, rtol=1e-6)


def test_a_multimodal_config_is_read_through_its_text_config():
    from tests.conftest import tiny_gemma3_config

    text = tiny_gemma3_config(rope_type="linear", factor=8.0).to_dict()
    nested = {"model_type": "gemma3", "text_config": text}
    for lt, rope in sglang_layer_ropes(nested, 256).items():
        assert torch.equal(rope.inv_freq, sglang_layer_ropes(text, 256)[lt].inv_freq)

"""vLLM: every frequency strategy exported and read back by vllm_rope gives ropescale's rotation;
vllm_rope checked against vLLM's formulas written out here from its source
(vllm/model_executor/layers/rotary_embedding/*.py, vllm/config/model.py, v0.32 line); every
known non-parity detected and named. Gemma 3: rope parameters per layer type, as vLLM's gemma3.py
reads them (``config.rope_parameters[layer_type]`` per attention layer)."""

import copy
import math

import pytest
import torch

from ropescale.errors import InvalidInput
from ropescale.serving import ExportRefused, compare, export_vllm, ropescale_rope, vllm_rope
from ropescale.serving.engines.vllm import vllm_layer_ropes
from ropescale.serving.rope import compare_layers, ropescale_layer_ropes
from tests.serving.conftest import (
    FREQUENCY,
    G_D,
    G_T,
    GLOBAL,
    LOCAL,
    LONG,
    RELATIVE,
    SHORT,
    THETA,
    D,
    T,
    gemma3_patched,
    patched,
)

FREQ_TOL, MAG_TOL = 1e-5, 1e-6


@pytest.mark.parametrize("length", [48, 256])
@pytest.mark.parametrize("case", sorted(FREQUENCY))
def test_every_frequency_strategy_is_served_exactly(case, length):
    name, params = FREQUENCY[case]
    model = patched(name, **params)
    export = export_vllm(model, length)
    assert export.max_model_len == length
    theirs = vllm_rope(export.config, export.max_model_len)
    ours = ropescale_rope(model, length)
    assert theirs.failure is None
    assert torch.allclose(theirs.inv_freq, ours.inv_freq, rtol=FREQ_TOL, atol=0)
    assert abs(theirs.magnitude - ours.magnitude) <= MAG_TOL
    verdict = compare(ours, theirs, length)
    assert verdict.same and verdict.verdict.startswith("same"), verdict.verdict


def test_the_export_follows_the_measured_rules():
    mpe = {case: export_vllm(patched(*FREQUENCY[case][:1], **FREQUENCY[case][1]), 256).config["max_position_embeddings"]
           for case in ("vanilla", "linear", "ntk", "yarn", "llama3", "longrope", "dynamic_ntk")}
    assert mpe == {"vanilla": 256, "linear": T, "ntk": 256, "yarn": T * 4, "llama3": 256, "longrope": T * 4,
                   "dynamic_ntk": 256}
    ntk = export_vllm(patched("ntk", factor=4.0), 256)
    assert ntk.config["rope_parameters"]["rope_type"] == "default"  # never vLLM's "ntk"
    assert ntk.config["rope_parameters"]["rope_theta"] == pytest.approx(THETA * 4 ** (D / (D - 2)))
    assert ntk.hf_overrides == {"rope_parameters": ntk.config["rope_parameters"], "max_position_embeddings": 256}
    long = export_vllm(patched("longrope", factor=4.0, short_factor=SHORT, long_factor=LONG), 256)
    assert "original_max_position_embeddings" not in long.config
    dyn = export_vllm(patched("dynamic_ntk", factor=2.0), 256, freeze_dynamic_at=128)
    assert any("frozen at 128" in n for n in dyn.notes)
    alpha = 2.0 * 128 / T - 1
    assert dyn.config["rope_parameters"]["rope_theta"] == pytest.approx(THETA * alpha ** (D / (D - 2)))
    assert "vllm serve OUT --max-model-len 256" in dyn.serve_command("OUT")


def test_frozen_dynamic_ntk_is_same_only_at_the_freeze_length():
    model = patched("dynamic_ntk", factor=2.0)
    export = export_vllm(model, 512, freeze_dynamic_at=256)
    theirs = vllm_rope(export.config, 512)
    assert compare(ropescale_rope(model, 256), theirs, 256).same
    assert not compare(ropescale_rope(model, 512), theirs, 512).same


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_rules_are_refused_naming_vllm(name):
    from ropescale.strategies import strategy_names

    if name not in strategy_names():
        pytest.skip(f"{name} not registered")
    with pytest.raises(ExportRefused, match=f"^vLLM: {name} is a relative-position rule"):
        export_vllm(patched(name, **RELATIVE[name]), 256)


@pytest.mark.parametrize(("name", "params", "match"), [
    ("ntk", {"factor": 2.0, "logn": True}, "query temperature"),
    ("pi_over_2n", {"n_max": 256.0}, "no transformers rope type"),
    ("dynamic_yarn", {}, "no transformers rope type"),
    ("yarn", {"factor": 2.0}, "NaN past"),  # serving 256 > T·s = 128
])
def test_what_vllm_cannot_express_is_refused_in_one_line(name, params, match):
    with pytest.raises(ExportRefused, match=match) as err:
        export_vllm(patched(name, **params), 256)
    assert str(err.value).startswith("vLLM: ") and "\n" not in str(err.value)


def test_bad_input_is_one_line(tiny_llama):
    with pytest.raises(InvalidInput, match="not patched"):
        export_vllm(tiny_llama, 256)
    with pytest.raises(InvalidInput, match="serve_length"):
        export_vllm(patched("vanilla"), 0)


# ---- vllm_rope against vLLM's formulas, written out from its source -------------------------------

def _config(rope_parameters, mpe=T, **top):
    return {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": mpe,
            "rope_parameters": {"rope_theta": THETA, **rope_parameters}, **top}


def _base(b=THETA):  # RotaryEmbedding._compute_inv_freq
    return [1.0 / b ** (2 * i / D) for i in range(D // 2)]


def _close(engine, expected, magnitude=1.0):
    assert engine.inv_freq.tolist() == pytest.approx(expected, rel=FREQ_TOL)
    assert engine.magnitude == pytest.approx(magnitude, abs=MAG_TOL)


def test_vllm_default_linear_and_its_own_ntk_formula():
    _close(vllm_rope(_config({"rope_type": "default"}), 64), _base())
    lin = vllm_rope(_config({"rope_type": "linear", "factor": 4.0}), 256)  # positions t / s
    _close(lin, [f / 4 for f in _base()])
    assert lin.failure is None  # cache T·s = 256
    # ntk_scaling_rope.py: base·s, then inv_freq / s^(2/d)
    _close(vllm_rope(_config({"rope_type": "ntk", "factor": 4.0}), 64), [f / 4 ** (2 / D) for f in _base(THETA * 4)])


def test_vllm_dynamic_is_static_and_plain_without_max_trained_positions():
    s = 2.0
    plain = vllm_rope(_config({"rope_type": "dynamic", "factor": s}, mpe=256), 256)
    _close(plain, _base())  # base·(s·mpe/mpe − (s − 1))^… = base
    trained = vllm_rope(_config({"rope_type": "dynamic", "factor": s, "max_trained_positions": T}, mpe=256), 256)
    _close(trained, _base(THETA * (s * 256 / T - (s - 1)) ** (D / (D - 2))))


def test_vllm_yarn_formula_and_its_cache():
    s, bf, bs = 4.0, 16.0, 2.0

    def corr(rot):
        return D * math.log(T / (rot * 2 * math.pi)) / (2 * math.log(THETA))

    for truncate in (True, False):
        low, high = corr(bf), corr(bs)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        ramp = [min(1.0, max(0.0, (i - low) / (high - low))) for i in range(D // 2)]
        expected = [f / s * r + f * (1 - r) for f, r in zip(_base(), ramp)]
        rp = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": T, "beta_fast": bf,
              "beta_slow": bs, "truncate": truncate}
        _close(vllm_rope(_config(rp), 256), expected, 0.1 * math.log(s) + 1)
        _close(vllm_rope(_config({**rp, "attention_factor": 1.3}), 256), expected, 1.3)
    rp = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": T}
    # vLLM 0.32.0 takes YaRN's max_position_embeddings as already scaled: mpe = T is refused at 4T,
    # a larger mpe is accepted and runs past its cache of T·s positions into NaN
    assert vllm_rope(_config(rp, mpe=T), 4 * T).failure.startswith(f"vLLM refuses max_model_len {4 * T}")
    assert vllm_rope(_config(rp, mpe=1024), 1024).failure.startswith("vLLM returns NaN from position 256")


def test_vllm_llama3_formula():
    s, lo, hi = 4.0, 1.0, 4.0
    expected = []
    for f in _base():
        wl = 2 * math.pi / f
        smooth = (T / wl - lo) / (hi - lo)
        expected.append(f if wl < T / hi else f / s if wl > T / lo else (1 - smooth) * f / s + smooth * f)
    rp = {"rope_type": "llama3", "factor": s, "low_freq_factor": lo, "high_freq_factor": hi,
          "original_max_position_embeddings": T}
    _close(vllm_rope(_config(rp, mpe=256), 256), expected)


def test_vllm_longrope_chooses_factors_once_and_takes_mscale_from_mpe():
    rp = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": T,
          "factor": 8.0, "attention_factor": 2.0}  # factor and attention_factor are not read
    mscale = math.sqrt(1 + math.log(256 / T) / math.log(T))
    _close(vllm_rope(_config(rp, mpe=256), 256), [f / x for f, x in zip(_base(), LONG)], mscale)
    _close(vllm_rope(_config(rp, mpe=256), 48), [f / x for f, x in zip(_base(), SHORT)], mscale)
    _close(vllm_rope(_config({**rp, "long_mscale": 1.7}, mpe=256), 256), [f / x for f, x in zip(_base(), LONG)], 1.7)


# ---- known non-parities: detected and named, never "same" ----------------------------------------

def _differs(model, config, length):
    verdict = compare(ropescale_rope(model, length), vllm_rope(config, length), length)
    assert not verdict.same and verdict.verdict.startswith("differs: ")
    return verdict.verdict


def test_vllms_ntk_type_is_another_formula():
    v = _differs(patched("ntk", factor=4.0), _config({"rope_type": "ntk", "factor": 4.0}, mpe=256), 256)
    assert "pair 0" in v  # vLLM scales even the fastest pair


def test_dynamic_as_transformers_writes_it_is_refused_nan_or_plain():
    model = patched("dynamic_ntk", factor=2.0)
    as_saved = _config({"rope_type": "dynamic", "factor": 2.0})  # save_patched: mpe = T
    assert "refuses" in _differs(model, as_saved, 256)  # 256 > T·s = 128
    allowed = compare(ropescale_rope(model, 256), vllm_rope(as_saved, 256, allow_long_max_model_len=True), 256)
    assert not allowed.same and "NaN" in allowed.verdict
    assert "frequencies differ" in _differs(model, as_saved, 128)  # plain RoPE vs ropescale's scaled base


def test_longrope_factor_and_attention_factor_are_ignored():
    model = patched("longrope", factor=4.0, short_factor=SHORT, long_factor=LONG, attention_factor=1.5)
    rp = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": T,
          "factor": 4.0, "attention_factor": 1.5}
    assert "magnitude" in _differs(model, _config(rp, mpe=T * 4), 256)


def test_save_patched_configs_left_at_the_training_window_are_refused():
    for name, params, rp in [
        ("llama3", {"factor": 4.0}, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": T}),
        ("ntk", {"factor": 4.0}, {"rope_type": "default", "rope_theta": THETA * 4 ** (D / (D - 2))}),
    ]:
        assert "refuses" in _differs(patched(name, **params), _config(rp), 256)


def test_unknown_rope_types_fail():
    assert "unknown rope type" in _differs(patched("vanilla"), _config({"rope_type": "bogus"}), 64)


# ---- Gemma 3: rope parameters per layer type ------------------------------------------------------

GEMMA3 = {"yarn": ("yarn", {"factor": 4.0}), "linear": ("linear", {"factor": 4.0}), "ntk": ("ntk", {"factor": 4.0}),
          "dynamic_ntk": ("dynamic_ntk", {"factor": 2.0})}
SHIPPED_SLIDING = {"rope_type": "default", "rope_theta": LOCAL}


@pytest.mark.parametrize("length", [128, 256])
@pytest.mark.parametrize("case", sorted(GEMMA3))
def test_gemma3_global_patch_is_served_per_layer_type(case, length):
    """ropescale scales Gemma 3's global layers and keeps the sliding ones: vLLM gets each type's
    parameters, the sliding ones exactly as shipped, and rotates every layer type as ropescale does."""
    name, params = GEMMA3[case]
    model = gemma3_patched(name, **params)
    export = export_vllm(model, length)
    assert export.config["rope_parameters"]["sliding_attention"] == SHIPPED_SLIDING
    assert export.config["max_position_embeddings"] >= length and export.max_model_len == length
    theirs = vllm_layer_ropes(export.config, length)
    assert set(theirs) == {"sliding_attention", "full_attention"}
    assert all(t.failure is None for t in theirs.values())
    verdict = compare_layers(ropescale_layer_ropes(model, length), theirs, length)
    assert verdict.same and verdict.verdict.startswith("same"), verdict.verdict


def test_gemma3_export_writes_the_keys_vllm_reads():
    yarn = export_vllm(gemma3_patched("yarn", factor=4.0), 256)
    assert yarn.config["rope_parameters"]["full_attention"] == {
        "rope_type": "yarn", "rope_theta": GLOBAL, "factor": 4.0, "original_max_position_embeddings": G_T,
        "attention_factor": pytest.approx(0.1 * math.log(4) + 1), "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True}
    assert yarn.config["max_position_embeddings"] == 256 and yarn.config["model_type"] == "gemma3_text"
    assert yarn.hf_overrides == {"rope_parameters": yarn.config["rope_parameters"], "max_position_embeddings": 256}
    # vLLM takes a gemma3 config's length as already scaled: linear needs mpe = L, not ⌈L/s⌉ as for Llama
    linear = export_vllm(gemma3_patched("linear", factor=4.0), 256)
    assert linear.config["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": GLOBAL}
    assert linear.config["max_position_embeddings"] == 256
    ntk = export_vllm(gemma3_patched("ntk", factor=4.0), 256).config["rope_parameters"]["full_attention"]
    assert ntk == {"rope_type": "default", "rope_theta": pytest.approx(GLOBAL * 4 ** (G_D / (G_D - 2)))}
    assert any("rope_parameters[layer_type]" in n for n in yarn.notes)


def test_gemma3_shipped_linear_global_layers_are_replaced_by_the_patch():
    """Gemma 3 4B+ ships linear ×8 on its global layers: the patch replaces it there, the sliding
    layers stay as shipped."""
    model = gemma3_patched("yarn", factor=4.0, full={"rope_type": "linear", "factor": 8.0})
    export = export_vllm(model, 256)
    assert export.config["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    assert export.config["rope_parameters"]["sliding_attention"] == SHIPPED_SLIDING
    assert compare_layers(ropescale_layer_ropes(model, 256), vllm_layer_ropes(export.config, 256), 256).same


def test_gemma3_patch_of_the_sliding_layers_is_served_too():
    """vLLM 0.32.0's Gemma 3 passes each layer its own type's rope parameters to get_rope, so a patch
    of the sliding layers is expressed as well (measured: real vLLM 0.32.0 within 1.3e-6 log p)."""
    model = gemma3_patched("yarn", factor=4.0, layer_types=["sliding_attention", "full_attention"])
    export = export_vllm(model, 256)
    sliding = export.config["rope_parameters"]["sliding_attention"]
    assert sliding["rope_type"] == "yarn" and sliding["rope_theta"] == LOCAL
    assert compare_layers(ropescale_layer_ropes(model, 256), vllm_layer_ropes(export.config, 256), 256).same


def test_vllm_rope_per_layer_type_shows_a_wrong_key():
    model = gemma3_patched("yarn", factor=4.0)
    export = export_vllm(model, 256)
    ours = ropescale_layer_ropes(model, 256)
    sliding_at_global_base = copy.deepcopy(export.config)
    sliding_at_global_base["rope_parameters"]["sliding_attention"]["rope_theta"] = GLOBAL
    v = compare_layers(ours, vllm_layer_ropes(sliding_at_global_base, 256), 256)
    assert not v.same and v.verdict.startswith("differs: sliding_attention: frequencies differ"), v.verdict
    half_factor = copy.deepcopy(export.config)
    half_factor["rope_parameters"]["full_attention"]["factor"] = 2.0
    v = compare_layers(ours, vllm_layer_ropes(half_factor, 256), 256)
    assert not v.same and v.verdict.startswith("differs: full_attention: ") and "sliding" not in v.verdict
    # a Gemma 3 config's length is not scaled by the factor: linear with mpe = T is refused at 4T
    linear = copy.deepcopy(export_vllm(gemma3_patched("linear", factor=4.0), 256).config)
    linear["max_position_embeddings"] = G_T
    assert vllm_rope(linear, 256, layer_type="full_attention").failure.startswith(
        f"vLLM refuses max_model_len 256 > {G_T}")
    # per-layer-type parameters in a model vLLM reads one set for
    other = vllm_layer_ropes({**export.config, "model_type": "olmo3"}, 256)
    assert all("reads one set of rope parameters" in r.failure for r in other.values())
    with pytest.raises(InvalidInput, match="per layer type .*name one of them"):
        vllm_rope(export.config, 256)


def test_per_layer_type_patches_of_other_families_are_refused_in_one_line():
    from transformers import AutoConfig, AutoModelForCausalLM

    import ropescale

    config = AutoConfig.for_model("olmo3", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, sliding_window=16, eos_token_id=1, pad_token_id=1,
                                  layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    ropescale.patch(model, "yarn", factor=4.0)
    with pytest.raises(ExportRefused, match=r"^vLLM: vLLM 0\.32\.0's olmo3 model reads one set of rope parameters") \
            as err:
        export_vllm(model, 256)
    assert "\n" not in str(err.value)

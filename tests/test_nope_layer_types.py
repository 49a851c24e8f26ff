"""A layer type whose rope parameters are None runs without position encoding (NoPE): Beam's and Cohere
Compass's ``full_attention`` layers, and Ergo's from transformers 5.25 (``{"sliding_attention": {...},
"full_attention": None}``). Every reader of ropescale takes such a type as NoPE — the config reader
(``ropescale.rope_config``), patch, inspect, the exports and the engines' re-implementations — and the model
itself agrees: the census probe finds that those layers do not rotate."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers as T

import ropescale
from ropescale.errors import InvalidInput
from ropescale.models import exported_config, model_rope_config
from ropescale.rope_config import NoRopeConfigError, nope_layer_types, per_layer_type, rope_config_of
from ropescale.serving.engines.sglang import sglang_layer_ropes, sglang_rope
from ropescale.serving.engines.vllm import vllm_layer_ropes, vllm_rope
from ropescale.serving.plan import served_rope_parameters
from tests.census.build import build, text_config, tiny_config
from tests.census.checks import inputs
from tests.census.probe import rotating_layers
from tests.census.run import types

NOPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}, "full_attention": None}
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
             max_position_embeddings=32)


def _beam_config(rope_parameters=NOPE) -> T.BeamConfig:
    return T.BeamConfig(**SMALL, rope_parameters=copy.deepcopy(rope_parameters))


def _model(name: str = "beam"):
    if name not in types():
        pytest.skip(f"{name} is not a model type of the installed transformers")
    return build(types()[name], dtype=torch.float32)


def test_per_layer_type_reads_none_as_a_nope_layer_type():
    assert per_layer_type(NOPE) == NOPE
    assert per_layer_type({"full_attention": None}) == {"full_attention": None}  # every layer type NoPE
    # one set of rope parameters, None values included, is no per-layer-type config
    assert per_layer_type({"rope_type": "yarn", "factor": 2.0, "attention_factor": None, "mscale": None}) is None
    assert per_layer_type({"rope_theta": None}) is None
    assert per_layer_type(None) is None and per_layer_type({}) is None


def test_a_hand_built_config_with_a_none_layer_type_reads_the_rotating_one():
    """A config object that is no transformers class (the reader reads attributes only)."""
    config = SimpleNamespace(rope_parameters=copy.deepcopy(NOPE), head_dim=16, max_position_embeddings=64,
                             layer_types=["sliding_attention", "full_attention"])
    assert nope_layer_types(config) == ["full_attention"]
    rope = rope_config_of(config)  # full_attention is the default type, but it does not rotate
    assert (rope.layer_type, rope.rope_theta, rope.dim, rope.original_max_position_embeddings) == (
        "sliding_attention", 500000.0, 16, 64)
    with pytest.raises(NoRopeConfigError, match=r"'full_attention' has rope parameters None.*\(NoPE\)") as e:
        rope_config_of(config, "full_attention")
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidInput, match="'chunked' not in the config's rope_parameters"):
        rope_config_of(config, "chunked")


def test_a_config_whose_every_layer_type_is_none_has_no_rope():
    with pytest.raises(NoRopeConfigError, match="every layer type's rope parameters are None.*NoPE"):
        rope_config_of(_beam_config({"sliding_attention": None, "full_attention": None}))


@pytest.mark.parametrize("name", ["beam", "cohere_compass_text", "ergo"])
def test_the_config_reader_names_the_layers_the_probe_finds_without_rope(name):
    """The oracle: the model itself (the census probe swaps each layer's rotary table for scrambled positions
    and sees which layers' outputs move); the reader only reads the config."""
    if name not in types():
        pytest.skip(f"{name} is not a model type of the installed transformers")
    config = tiny_config(types()[name])
    text = text_config(config)
    nope = nope_layer_types(config)
    assert nope == ["full_attention"]
    declared = [lt not in nope for lt in text.layer_types]
    assert any(declared) and not all(declared)  # the tiny model keeps both kinds of layer
    ids, other = inputs()
    found = rotating_layers(build(types()[name], config, dtype=torch.float32), ids[:, :24], other[:, :24])
    assert list(found.values()) == declared
    rope = rope_config_of(config)
    assert rope.layer_type == "sliding_attention"
    assert rope.rope_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    with pytest.raises(NoRopeConfigError, match="NoPE"):
        rope_config_of(config, "full_attention")


def test_patch_scales_the_rotating_layers_and_refuses_the_nope_type_in_one_line():
    model = _model()
    with ropescale.patch(model, "yarn", factor=2.0) as handle:
        assert handle.layer_types == ["sliding_attention"]
        rows = {r["layer"]: r for r in handle.report()}
        full = [i for i, lt in enumerate(model.config.layer_types) if lt == "full_attention"]
        assert full and all(rows[i]["rope"] == "none" for i in full)
    with pytest.raises(InvalidInput, match=r"layer_types \['full_attention'\]: .*None.*\(NoPE\)") as e:
        ropescale.patch(model, "linear", factor=2.0, layer_types=["full_attention"])
    assert "\n" not in str(e.value)
    assert ropescale.current_patch(model) is None  # refused before anything changed


@pytest.mark.parametrize("strategy,params", [("yarn", {"factor": 2.0}), ("rerope", {"window": 8})])
def test_a_saved_patch_keeps_the_nope_layer_type_none_and_reads_back(strategy, params, tmp_path):
    """The exported config keeps the config's shape (a loader indexes every layer type's rope parameters):
    a frequency strategy in the rotating type, a relative rule's marker in every rotating type, None kept."""
    model = _model()
    with ropescale.patch(model, strategy, **params) as handle:
        config, native = exported_config(model, handle)
    rp = config.rope_parameters
    assert set(rp) == {"sliding_attention", "full_attention"} and rp["full_attention"] is None
    written = rp["sliding_attention"]["rope_type"]
    assert (written == "yarn") if strategy == "yarn" else written.startswith("ropescale:rerope")
    assert native == (strategy == "yarn")
    config.save_pretrained(tmp_path)  # a config.json as shipped: the config-only reader
    assert model_rope_config(str(tmp_path)).layer_type == "sliding_attention"
    with pytest.raises(NoRopeConfigError, match="NoPE"):
        model_rope_config(str(tmp_path), "full_attention")


def test_the_served_rope_names_the_nope_type_and_writes_it_back_as_none():
    model = _model()
    with ropescale.patch(model, "yarn", factor=2.0) as handle:
        served = served_rope_parameters(handle, "test", 64, per_layer_type=True)
    assert list(served.layer_types) == ["sliding_attention"] and served.nope_types == ["full_attention"]
    assert served.keyed(served.layer_types) == {"sliding_attention": served.layer_types["sliding_attention"],
                                                "full_attention": None}
    assert any("full_attention: NoPE" in n for n in served.notes)


def test_engine_re_implementations_rotate_only_the_rotating_type():
    """vLLM's and SGLang's re-implementations read a config.json keyed by layer type per type: the NoPE one is
    no rotation to compute (asked for, refused in one line), never the nested dict read as one set (θ 10 000)."""
    config = _beam_config().to_dict()
    theta = 500000.0 ** (-2 / 16)  # pair 1 of d = 16 at b = 5e5
    sglang = sglang_layer_ropes(config, 64)
    assert list(sglang) == ["sliding_attention"]
    assert float(sglang["sliding_attention"].inv_freq[1]) == pytest.approx(theta, rel=1e-6)
    vllm = vllm_layer_ropes(config, 64)
    assert list(vllm) == ["sliding_attention"]
    assert "one set of rope parameters" in vllm["sliding_attention"].failure  # vLLM's beam: not per layer type
    for rope in (sglang_rope, vllm_rope):
        with pytest.raises(InvalidInput, match=r"layer_type='full_attention': .*None.*\(NoPE\)"):
            rope(config, 64, layer_type="full_attention")


def test_inspect_reads_the_rotating_type_and_names_the_nope_one(tmp_path):
    from eval.inspect import rotary_config_of_model

    _beam_config().save_pretrained(tmp_path)
    cfg = rotary_config_of_model(str(tmp_path))
    assert (cfg.rope_theta, cfg.dim) == (500000.0, 16)
    assert cfg.source == f"{tmp_path} (sliding_attention layers; full_attention: NoPE, rope_parameters None)"
    assert float(cfg.inv_freq[1]) == pytest.approx(500000.0 ** (-2 / 16), rel=1e-6)

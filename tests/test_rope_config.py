"""One reader of d, θ and the training window T: patching a loaded model, ``ropescale inspect``
and the name-based reader (no weights) agree, on Phi-3 (T kept outside rope_parameters) and
Gemma 3 (θ per layer type)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import ropescale
from ropescale.models import model_rope_config, model_training_window
from ropescale.rope_config import NoRopeConfigError, rope_config_of
from ropescale.rotary import find_rotary_modules
from tests.conftest import build, tiny_llama_config
from tests.families import family_config, family_model

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _phi3_config(**extra) -> T.Phi3Config:
    # written as a Phi-3 checkpoint has it: T at the top level, max_position_embeddings the longer window
    return T.Phi3Config(**SIZES, max_position_embeddings=64, original_max_position_embeddings=32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)


def test_phi3_training_window_is_the_same_through_every_reader(tmp_path):
    config = _phi3_config()
    assert config.max_position_embeddings == 64  # the trap: the longer window is right there
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = T.Phi3ForCausalLM(config).eval()
    with ropescale.patch(model, "yarn", factor=2.0) as handle:
        assert handle.context["original_max_position_embeddings"] == 32
    assert model_rope_config(str(tmp_path)).original_max_position_embeddings == 32
    assert model_training_window(str(tmp_path)) == 32

    from eval.inspect import rotary_config_of_model

    assert rotary_config_of_model(str(tmp_path)).train_length == 32


def test_phi3_longrope_reads_the_window_from_rope_parameters(tmp_path):
    config = T.Phi3Config(**SIZES, max_position_embeddings=64, original_max_position_embeddings=32,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 8})
    config.save_pretrained(tmp_path)
    assert model_rope_config(str(tmp_path)).original_max_position_embeddings == 32
    assert model_rope_config(str(tmp_path)).rope_parameters["rope_type"] == "longrope"


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt_neox", "gemma3", "qwen3"])
def test_config_reader_matches_the_loaded_rotary_module(family, tmp_path):
    """d from the config (head_dim × partial_rotary_factor) equals 2·len(inv_freq) of the module
    transformers builds, and θ reproduces its first non-trivial frequency: θ^(−2/d)."""
    config = family_config(family)
    config.save_pretrained(tmp_path)
    model = family_model(family)
    (_, module), = find_rotary_modules(model)
    buffer = "inv_freq" if "inv_freq" in module._buffers else "full_attention_inv_freq"
    inv_freq = getattr(module, buffer)
    rope = model_rope_config(str(tmp_path))
    assert rope.dim == 2 * inv_freq.numel()
    assert rope.rope_theta ** (-2 / rope.dim) == pytest.approx(float(inv_freq[1]), rel=1e-6)


def test_gemma3_keeps_theta_per_layer_type(tmp_path):
    config = family_config("gemma3")
    config.save_pretrained(tmp_path)
    thetas = {lt: config.rope_parameters[lt]["rope_theta"] for lt in ("sliding_attention", "full_attention")}
    assert thetas["sliding_attention"] != thetas["full_attention"]  # else the test proves nothing
    for lt, theta in thetas.items():
        assert model_rope_config(str(tmp_path), lt).rope_theta == theta
        assert rope_config_of(config, lt).layer_type == lt
    assert model_rope_config(str(tmp_path)).rope_theta == thetas["full_attention"]  # default: the long-range layers
    model = family_model("gemma3")
    with ropescale.patch(model, "linear", factor=2.0, layer_types=["sliding_attention", "full_attention"]) as h:
        assert {lt: c["rope_theta"] for lt, c in h.contexts.items()} == thetas
    with pytest.raises(ValueError, match="layer type 'chunked' not in"):
        model_rope_config(str(tmp_path), "chunked")


def test_a_saved_patch_record_gives_the_window_it_was_applied_over(tmp_path):
    config = T.LlamaConfig(**SIZES, max_position_embeddings=64)
    config.save_pretrained(tmp_path)
    assert model_training_window(str(tmp_path)) == 64
    (tmp_path / "ropescale.json").write_text(json.dumps({"strategy": "linear", "params": {"factor": 2.0},
                                                         "original_max_position_embeddings": 16}))
    assert model_training_window(str(tmp_path)) == 16
    assert model_rope_config(str(tmp_path)).original_max_position_embeddings == 16


def test_a_saved_patched_model_reads_its_base_theta_not_the_exported_one(tmp_path):
    model = family_model("llama")
    with ropescale.patch(model, "ntk", factor=4.0) as handle:  # exported as a raised rope_theta
        from ropescale.models import exported_config

        exported, native = exported_config(model, handle)
        exported.save_pretrained(tmp_path)
        record = handle.to_dict() | {"native": native, "base_rope_parameters": model.config.rope_parameters}
        (tmp_path / "ropescale.json").write_text(json.dumps(record))
    assert exported.rope_parameters["rope_theta"] > model.config.rope_parameters["rope_theta"]
    assert model_rope_config(str(tmp_path)).rope_theta == model.config.rope_parameters["rope_theta"]


def test_a_config_without_rope_is_one_line():
    config = T.GPT2Config(n_layer=1, n_embd=16, n_head=2)
    with pytest.raises(NoRopeConfigError, match="GPT2Config has no rope_theta"):
        rope_config_of(config)


def test_qwen2_5_1m_training_window_is_its_dual_chunk_attention_config():
    """Qwen2.5-7B-Instruct-1M's config.json: max_position_embeddings 1010000 is the served window,
    dual_chunk_attention_config.original_max_position_embeddings 262144 the trained one."""
    config = T.Qwen2Config(**SIZES, max_position_embeddings=1010000, rope_parameters={
        "rope_type": "default", "rope_theta": 10000000.0})
    config.dual_chunk_attention_config = {"chunk_size": 262144, "local_size": 8192,
                                          "original_max_position_embeddings": 262144}
    assert rope_config_of(config).original_max_position_embeddings == 262144
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(config).eval()
    with ropescale.patch(model, "dca") as handle:
        assert handle.context["original_max_position_embeddings"] == 262144


def test_a_local_attention_only_model_takes_its_window_as_t():
    """RecurrentGemma has no max_position_embeddings: its attention sees keys attention_window_size
    back at most, the largest relative position it was trained on."""
    config = T.RecurrentGemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=2, num_key_value_heads=1, attention_window_size=24)
    assert not hasattr(config, "max_position_embeddings")
    assert rope_config_of(config).original_max_position_embeddings == 24


def test_gemma4_per_layer_head_dim_and_blt_read_without_a_traceback():
    """Gemma 4 sets head_dim per layer (its global layers are wider, proportional RoPE over the whole
    width); transformers refuses config.head_dim on it. BLT names no head size at its top level."""
    from tests.census.build import build, tiny_config
    from tests.census.run import types

    model = build(types()["gemma4_text"])
    cfg = model.config
    (rotary,) = [m for n, m in model.named_modules() if n.endswith("rotary_emb")]
    for lt in ("sliding_attention", "full_attention"):
        # the oracle: the loaded rotary module's own inv_freq has d/2 entries
        assert rope_config_of(cfg, lt).dim == 2 * getattr(rotary, f"{lt}_inv_freq").numel()
    with pytest.raises(NoRopeConfigError, match="BltConfig names no head_dim"):
        rope_config_of(tiny_config(types()["blt"]))


def test_legacy_rope_scaling_and_rope_theta_keys_are_read(tmp_path):
    model = build(T.LlamaForCausalLM, tiny_llama_config())
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})  # a v4-era config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    legacy = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert legacy.config.rope_parameters["rope_type"] == "linear"
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(3))
    with ropescale.patch(legacy, "linear", factor=2.0) as h:
        assert h.context["rope_theta"] == 500000.0
        with torch.no_grad():
            patched = legacy(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(patched, legacy(ids).logits, rtol=0, atol=1e-5)


def test_the_old_name_of_model_training_window_still_works():
    from ropescale import models

    assert models.model_training_length is models.model_training_window

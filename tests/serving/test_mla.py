"""DeepSeek's MLA attention served by each engine: YaRN's cos/sin magnitude *and* the softmax factor
mscale(s, mscale_all_dim)² that DeepSeek's attention multiplies in (transformers' deepseek_v3, vLLM's and
SGLang's deepseek_v2.py, llama.cpp's deepseek2). ropescale's side is the patched tiny DeepSeek-V3 (the
softmax factor read back from its attention modules); each engine's side is its re-implementation of
the engine's own code applied to ropescale's export. The rules that make a naive export wrong are pinned:
vLLM turns ``attention_factor: 1.0`` into ``deepseek_llama_scaling`` (no mscale² on the softmax), and every
engine serves any scaled rope type on DeepSeek as DeepSeek's YaRN."""

import copy
import math

import pytest

import ropescale
from ropescale.rotary.quirks import model_softmax_scale
from ropescale.serving import ExportRefused, compare, get_engine
from ropescale.serving.engines.llama_cpp import llama_cpp_rope
from ropescale.serving.engines.sglang import sglang_rope
from ropescale.serving.engines.vllm import vllm_rope
from ropescale.serving.rope import ropescale_rope
from tests.serving.conftest import served
from tests.serving.test_native_export import SHIPPED, _model

L = 256  # within ⌈T·s⌉ of every case below [tokens]


def _g(s: float, m: float) -> float:
    """DeepSeek's yarn_get_mscale, written out."""
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


@pytest.fixture(scope="module")
def deepseek():
    """The tiny DeepSeek-V3 as shipped: YaRN ×40, mscale = mscale_all_dim = 1 (T = 32)."""
    return _model(*SHIPPED["yarn_deepseek_v3"])


def test_the_shipped_model_multiplies_its_softmax_by_mscale_squared(deepseek):
    assert model_softmax_scale(deepseek) == pytest.approx(_g(40, 1) ** 2, rel=1e-9)
    with ropescale.patch(deepseek, "native") as h:
        ours = ropescale_rope(h, L)
    assert ours.magnitude == pytest.approx(1.0, abs=1e-7) and ours.softmax_scale == pytest.approx(_g(40, 1) ** 2)


CASES = {  # strategy, params → (magnitude, softmax) the patched model must have
    "native": ("native", {}, 1.0, _g(40, 1) ** 2),
    "yarn x16": ("yarn", {"factor": 16.0}, _g(16, 1), 1.0),
    "yarn x16 mscale_all_dim=1": ("yarn", {"factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0}, 1.0, _g(16, 1) ** 2),
    "yarn x16 attention_factor=1": ("yarn", {"factor": 16.0, "attention_factor": 1.0}, 1.0, 1.0),
    "yarn x16 mscale_all_dim=0.5": ("yarn", {"factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5},
                                    _g(16, 1) / _g(16, 0.5), _g(16, 0.5) ** 2),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine", ["vllm", "llama.cpp", "sglang"])
def test_each_engine_serves_deepseeks_magnitude_and_softmax(deepseek, case, engine):
    name, params, magnitude, softmax = CASES[case]
    ours, translation, theirs = served(deepseek, engine, name, L, **params)
    assert ours.magnitude == pytest.approx(magnitude, rel=1e-6)
    assert ours.softmax_scale == pytest.approx(softmax, rel=1e-6)
    v = compare(ours, theirs, L)
    assert v.same, v.verdict
    if engine == "vllm":  # vLLM reads attention_factor 1.0 as deepseek_llama_scaling: never written
        assert "attention_factor" not in translation.config["rope_parameters"]
        assert "deepseek_yarn" in theirs.note


def test_vllms_deepseek_rules_as_read_from_its_code():
    """deepseek_v2.py: attention_factor == 1.0 → deepseek_llama_scaling (softmax × 1); else deepseek_yarn
    (softmax × mscale(s, mscale_all_dim)²); magnitude mscale(s, mscale)/mscale(s, mscale_all_dim)."""
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_attention_heads": 2,
              "hidden_size": 64, "head_dim": 64, "max_position_embeddings": 8192,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 4096}}
    shipped = vllm_rope(config, 4096)
    assert shipped.softmax_scale == pytest.approx(_g(40, 1) ** 2) and shipped.magnitude == pytest.approx(1.0)
    written = copy.deepcopy(config)
    written["rope_parameters"]["attention_factor"] = 1.0  # what transformers derives, written out
    assert vllm_rope(written, 4096).softmax_scale == 1.0  # deepseek_llama_scaling: the mscale² is lost
    llama = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert vllm_rope(llama, 4096).softmax_scale == 1.0  # only DeepSeek's attention applies it


def test_llama_cpp_deepseek2_reads_the_log_multiplier_and_scales_the_softmax():
    """src/models/deepseek2.cpp: yarn_log_multiplier / 0.1 = mscale_all_dim (as the converter writes it);
    the runtime's mscale ratio is 1; softmax × (attn·(1 + 0.1·ln s)·(1 + 0.1·M·ln s))²."""
    kv = {"general.architecture": "deepseek2", "deepseek2.rope.dimension_count": 64,
          "deepseek2.rope.freq_base": 10000.0, "deepseek2.rope.scaling.type": "yarn",
          "deepseek2.rope.scaling.factor": 40.0, "deepseek2.rope.scaling.original_context_length": 4096,
          "deepseek2.rope.scaling.yarn_log_multiplier": 0.1}
    r = llama_cpp_rope(kv, {}, 4096, 64)
    assert r.magnitude == pytest.approx(1.0, rel=1e-6) and r.softmax_scale == pytest.approx(_g(40, 1) ** 2, rel=1e-6)
    llama = {k.replace("deepseek2", "llama"): v for k, v in kv.items()}
    assert llama_cpp_rope(llama, {}, 4096, 64).softmax_scale == 1.0  # the llama graph never reads it


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_another_scaled_type_on_deepseek_is_refused_in_one_line(deepseek, engine):
    model = copy.deepcopy(deepseek)
    with ropescale.patch(model, "linear", factor=4.0) as h, pytest.raises(ExportRefused) as e:
        get_engine(engine).translate(h, L)
    assert "\n" not in str(e.value) and ("DeepSeek" in str(e.value) or "deepseek2" in str(e.value))


def test_sglang_deepseek_serves_every_scaled_type_as_deepseek_yarn():
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_attention_heads": 2,
              "hidden_size": 64, "head_dim": 64, "max_position_embeddings": 8192,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                  "truncate": False}}
    r = sglang_rope(config, 4096)
    assert r.softmax_scale == pytest.approx(_g(40, 1) ** 2) and "deepseek_yarn" in r.note
    rounded = sglang_rope({**config, "rope_parameters": {**config["rope_parameters"], "truncate": True}}, 4096)
    assert compare(rounded, r, 4096).same  # DeepSeek's class always rounds: truncate is not read

"""Mistral's query temperature (Ministral 3's ``llama_4_scaling_beta``: queries × 1 + β·ln(1 + ⌊p/T⌋)) served by
each engine as its code reads it: vLLM's mistral.py from a top-level ``llama_4_scaling`` only (never from
transformers' ``rope_parameters``), llama.cpp's mistral3 from ``attention.temperature_scale`` with the floor
scale ``original_context_length``, SGLang's ministral3.py with ``max_position_embeddings`` where transformers
uses T. ropescale's side: the temperatures its patched RoPE layers apply (the model's own β where kept)."""

import copy

import pytest

import ropescale
from ropescale.serving import ExportRefused, compare, get_engine
from ropescale.serving.engines.sglang import sglang_rope
from ropescale.serving.engines.vllm import vllm_rope
from ropescale.serving.rope import ropescale_rope
from tests.serving.conftest import served
from tests.serving.test_native_export import SHIPPED, W, _model

L = 64  # within ⌈T·s⌉ of every case [tokens]
BETA = f"beta=0.1/T={W}"  # the tiny Ministral 3: β 0.1, T = W


@pytest.fixture(scope="module")
def ministral():
    return _model(*SHIPPED["yarn_ministral3"])


CASES = {  # strategy, params, the temperature the patched model applies
    "native": ("native", {}, BETA),
    "yarn": ("yarn", {"factor": 16.0}, ""),  # another strategy removes the model's own β
    "yarn, temperature native": ("yarn", {"factor": 16.0, "temperature": "native"}, BETA),
    "yarn, beta 0.2": ("yarn", {"factor": 16.0, "temperature": "beta:beta=0.2"}, f"beta=0.2/T={W}"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine", ["vllm", "llama.cpp"])
def test_vllm_and_llama_cpp_serve_the_patched_temperature(ministral, case, engine):
    name, params, expected = CASES[case]
    ours, translation, theirs = served(ministral, engine, name, L, **params)
    assert ours.temperature == expected
    assert theirs.temperature == expected, theirs.note
    v = compare(ours, theirs, L)
    assert v.same, v.verdict
    if engine == "vllm":
        scaling = translation.config.get("llama_4_scaling")
        assert (scaling is None) == (expected == "")


def test_vllm_given_the_transformers_config_drops_the_temperature(ministral):
    """vLLM 0.32.0's mistral.py reads ``config.llama_4_scaling`` only: a Ministral 3 config.json as transformers
    writes it (β inside rope_parameters) is served without the temperature."""
    config = ministral.config.to_dict() | {"architectures": ["Ministral3ForCausalLM"]}
    assert config["rope_parameters"]["llama_4_scaling_beta"] == 0.1
    theirs = vllm_rope(config, L)
    with ropescale.patch(copy.deepcopy(ministral), "native") as h:
        ours = ropescale_rope(h, L)
    assert theirs.temperature == "" and ours.temperature == BETA
    assert "query temperature beta=0.1" in compare(ours, theirs, L).verdict


def test_sglang_divides_by_max_position_embeddings_and_is_refused(ministral):
    config = ministral.config.to_dict() | {"architectures": ["Ministral3ForCausalLM"]}
    assert sglang_rope(config, L).temperature == f"beta=0.1/T={config['max_position_embeddings']}"
    with ropescale.patch(copy.deepcopy(ministral), "native") as h, pytest.raises(ExportRefused) as e:
        get_engine("sglang").translate(h, L)
    assert str(e.value).startswith("SGLang: query temperature (beta:beta=0.1) has no SGLang setting")


def test_a_temperature_on_a_model_the_engine_does_not_scale_is_refused():
    from tests.serving.test_native_export import _model as model_of

    llama = model_of(*SHIPPED["yarn"])
    with ropescale.patch(llama, "yarn", factor=4.0, temperature="beta:beta=0.1") as h:
        for engine in ("vllm", "llama.cpp"):
            with pytest.raises(ExportRefused, match="query temperature .*has no .* setting for this model"):
                get_engine(engine).translate(h, L)


def test_vllm_gets_llama4s_nope_temperature_in_the_generation_config(tmp_path):
    """vLLM 0.32.0's llama4.py sets the NoPE layers' attn_temperature_tuning from generation_config.json, else
    max_model_len > 32768 — never from config.json: served at 32k tokens or fewer it would run without the
    temperature transformers applies. The export writes the config's value there."""
    import json

    from transformers import AutoTokenizer

    from ropescale.models import REFERENCE_MODEL

    llama4 = _model("llama4_text", {None: {"rope_type": "default", "rope_theta": 500000.0}})
    assert llama4.config.attn_temperature_tuning is True
    with ropescale.patch(llama4, "yarn", factor=2.0) as h:
        eng = get_engine("vllm")
        translation = eng.translate(h, L)
        eng.write(llama4, AutoTokenizer.from_pretrained(REFERENCE_MODEL), translation, tmp_path / "out")
    assert translation.generation == {"attn_temperature_tuning": True}
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written["attn_temperature_tuning"] is True
    llama = _model(*SHIPPED["yarn"])
    with ropescale.patch(llama, "yarn", factor=4.0) as h:
        assert get_engine("vllm").translate(h, L).generation == {}  # only Llama 4 reads it

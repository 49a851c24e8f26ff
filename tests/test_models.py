"""ropescale.models: save_patched → plain transformers reproduces what it can express
(``exported_config``, from each strategy's export hook) and refuses the rest; load_model restores it."""

import inspect
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ropescale
import ropescale.models
from tests.families import family_model

IDS = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(3))
N = 8  # rotary pairs of the tiny Llama (head_dim 16)

NATIVE = [
    ("vanilla", {}),
    ("native", {}),  # the model's own rope_parameters: exported as they are
    ("ntk", {"factor": 4.0}),
    ("linear", {"factor": 3.0}),
    ("dynamic_ntk", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "beta_fast": 16.0}),
    ("llama3", {"factor": 8.0}),  # factor is required outside sweeps
    ("longrope", {"short_factor": [1.0] * N, "long_factor": [1.0 + i for i in range(N)], "factor": 4.0}),
]


class _Tok:  # stand-in tokenizer: save_patched only calls save_pretrained
    def save_pretrained(self, path):
        pass


@torch.no_grad()
def saved_logits(model, strategy, params, path, **kw):
    with ropescale.patch(model, strategy, **kw, **params):
        expected = model(IDS).logits
        ropescale.save_patched(model, _Tok(), path)
    return expected


@pytest.mark.parametrize("strategy,params", NATIVE, ids=[s for s, _ in NATIVE])
def test_plain_transformers_reproduces_native_strategies(tmp_path, tiny_llama, strategy, params):
    kw = {"original_max_position_embeddings": 16} if strategy == "llama3" else {}
    expected = saved_logits(tiny_llama, strategy, params, tmp_path, **kw)
    assert json.loads((tmp_path / "ropescale.json").read_text())["native"] is True
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,strategy,params", [
    ("gpt_neox", "ntk", {"factor": 4.0}),      # partial rotary: d = rotary dim in b·s^(d/(d−2))
    ("gemma3", "yarn", {"factor": 4.0}),       # nested per-layer-type rope parameters
])
def test_native_export_other_families(tmp_path, family, strategy, params):
    model = family_model(family)
    expected = saved_logits(model, strategy, params, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,params", [
    ("base_truncation", {"truncation_length": 32.0}), ("pi_over_2n", {"n_max": 128.0}),
    ("ntk_by_parts", {"factor": 4.0}), ("dynamic_yarn", {}),
])
def test_other_strategies_refuse_plain_loading(tmp_path, tiny_llama, strategy, params):
    saved_logits(tiny_llama, strategy, params, tmp_path)
    assert json.loads((tmp_path / "ropescale.json").read_text())["native"] is False
    with pytest.raises(KeyError, match="ropescale.load_model"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_reload_with_ropescale_restores_patch_exactly(tmp_path, tiny_model_dir):
    for strategy, params in [("base_truncation", {"truncation_length": 16.0}), ("ntk", {"factor": 2.0})]:
        model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
        with torch.no_grad(), ropescale.patch(model, strategy, **params):
            expected = model(IDS % 100).logits
            ropescale.save_patched(model, tok, tmp_path / strategy)
        loaded, _ = ropescale.load_model(str(tmp_path / strategy), device="cpu")
        assert ropescale.current_patch(loaded).strategy == strategy
        assert loaded.config.rope_parameters["rope_type"] == "default"  # original config rebuilt
        with torch.no_grad():
            assert torch.equal(loaded(IDS % 100).logits, expected)


def test_dynamic_ntk_with_a_different_training_window_is_not_native(tmp_path, tiny_llama):
    saved_logits(tiny_llama, "dynamic_ntk", {}, tmp_path, original_max_position_embeddings=32)
    assert json.loads((tmp_path / "ropescale.json").read_text())["native"] is False


def test_export_is_a_hook_registered_with_each_strategy():
    """Which strategies transformers can express is declared beside each strategy; models.py (its
    ``exported_config``) has no list of names."""
    from ropescale.strategies import REGISTRY

    assert {name for name, s in REGISTRY.items() if s.export is not None} == {name for name, _ in NATIVE}
    assert all(s.kind == "frequency" for s in REGISTRY.values() if s.export is not None)
    source = "".join(inspect.getsource(f) for f in (ropescale.models.exported_config,
                                                    ropescale.models.native_rope_parameters))
    assert "export(" in source  # the hook is what is called
    assert not any(f'"{name}"' in source for name, _ in NATIVE)


@torch.no_grad()
def test_a_newly_registered_strategy_exports_through_its_hook(tmp_path, tiny_llama):
    """A strategy registered with an ``export`` hook is saved natively with no change to models.py:
    here position interpolation under another name, checked against transformers' own linear."""
    from ropescale.strategies import REGISTRY, register
    from ropescale.strategies.frequency import FACTOR, rope_inv_freq
    from ropescale.strategies.registry import RopeFrequencies

    def export(params, context, base, max_position_embeddings):
        return {"rope_type": "linear", "factor": params["factor"]}

    @register("test_pi_alias", params=(FACTOR,), source="test", export=export)
    def pi_alias(dim, rope_theta, factor):
        return RopeFrequencies(rope_inv_freq(dim, rope_theta) / factor, 1.0)

    try:
        expected = saved_logits(tiny_llama, "test_pi_alias", {"factor": 3.0}, tmp_path)
        assert json.loads((tmp_path / "ropescale.json").read_text())["native"] is True
        assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"
        plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(plain(IDS).logits, expected, rtol=0, atol=1e-5)
    finally:
        del REGISTRY["test_pi_alias"]


def test_served_is_the_folder_as_plain_transformers_serves_it(tmp_path, tiny_model_dir):
    """``load_model(..., served=True)``: a saved export kept as its config.json has it, not undone and
    re-applied (what ``native`` starts from): the model plain ``from_pretrained`` gives."""
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "yarn", factor=4.0)
    ropescale.save_patched(model, tok, tmp_path / "y4")
    served, _ = ropescale.load_model(str(tmp_path / "y4"), device="cpu", served=True)
    assert ropescale.current_patch(served) is None and served.config.rope_parameters["rope_type"] == "yarn"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "y4").eval()
    with torch.no_grad():
        assert torch.equal(served(IDS % 100).logits, plain(IDS % 100).logits)


def test_served_refuses_what_plain_transformers_cannot_serve(tmp_path, tiny_model_dir):
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "base_truncation", truncation_length=16.0)
    ropescale.save_patched(model, tok, tmp_path / "bt")
    with pytest.raises(ropescale.models.ModelLoadError, match=r"carries a base_truncation patch that plain "
                                                              r"transformers cannot express") as e:
        ropescale.load_model(str(tmp_path / "bt"), device="cpu", served=True)
    assert "\n" not in str(e.value)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    with pytest.raises(ropescale.models.ModelLoadError, match="LoRA adapter folder, which plain transformers"):
        ropescale.load_model(str(adapter), device="cpu", served=True)

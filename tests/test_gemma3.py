"""Gemma 3 end to end: per-layer-type export, the harness, and attention-side rules on the
multimodal class (whose language model holds its own config object)."""

import copy

import pytest
import torch
import transformers as T
from transformers import AutoModelForCausalLM, AutoTokenizer

import ropescale
from ropescale.models import REFERENCE_MODEL
from tests.families import COMMON, FAMILIES, family_model

IDS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))


class _Tok:
    def save_pretrained(self, path):
        pass


def test_export_writes_each_layer_types_own_rope_theta(tmp_path):
    model = family_model("gemma3")
    rp = model.config.rope_parameters
    assert rp["sliding_attention"]["rope_theta"] != rp["full_attention"]["rope_theta"]
    with torch.no_grad(), ropescale.patch(model, "ntk", factor=4.0, layer_types=["sliding_attention", "full_attention"]):
        expected = model(IDS).logits
        ropescale.save_patched(model, _Tok(), tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    saved = plain.config.rope_parameters
    d = 16  # head_dim: b·s^(d/(d−2)) per layer type, from that type's own base
    for lt in ("sliding_attention", "full_attention"):
        assert saved[lt]["rope_theta"] == pytest.approx(rp[lt]["rope_theta"] * 4.0 ** (d / (d - 2)))
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, expected, rtol=0, atol=1e-5)


def test_harness_runs_gemma3(tmp_path, text_file):
    from eval.config import build_config
    from eval.sweep import run_sweep

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    cfg_cls, model_cls, extra = FAMILIES["gemma3"]
    torch.manual_seed(0)
    model_cls(cfg_cls(**{**COMMON, "vocab_size": len(tok)}, **extra)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    cfg = build_config({"model": str(tmp_path / "m"), "data": str(text_file), "lengths": [64, 128],
                        "strategies": ["vanilla", "yarn", "rerope", "ntk:logn=true"], "max_windows": 2,
                        "device": "cpu"})
    records = run_sweep(cfg, tmp_path / "o", progress=False)
    assert len(records) == 8 and all(torch.isfinite(torch.tensor(r["ppl"])) for r in records)
    assert records[0]["train_length"] == 64


def multimodal_gemma3():
    text = T.Gemma3TextConfig(**COMMON, **FAMILIES["gemma3"][2])
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14)
    cfg = T.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    return T.Gemma3ForConditionalGeneration(copy.deepcopy(cfg)).eval()


@pytest.mark.parametrize("strategy,params", [("rerope", {"window": 16}), ("yarn", {"factor": 2.0, "logn": True}),
                                             ("self_extend", {"window": 16, "group_size": 4})])
def test_attention_rules_on_the_multimodal_class(strategy, params):
    model = multimodal_gemma3()
    with torch.no_grad():
        before = model(input_ids=IDS).logits
        with ropescale.patch(model, strategy, **params):
            blocked = model(input_ids=IDS).logits
        if strategy != "yarn":  # truncation rules: the blocked kernel equals the explicit n × n oracle
            with ropescale.patch(model, strategy, attention_path="naive", **params):
                naive = model(input_ids=IDS).logits
            torch.testing.assert_close(blocked, naive, rtol=0, atol=1e-5)
        assert not torch.equal(blocked, before)
        torch.testing.assert_close(model(input_ids=IDS).logits, before, rtol=0, atol=0)  # unpatched exactly

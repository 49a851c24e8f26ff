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
    with torch.no_grad(), ropescale.patch(model, "ntk", factor=4.0,
                                          layer_types=["sliding_attention", "full_attention"]):
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


DYNAMIC_BOTH_TYPES = """
import torch, transformers as T, ropescale
from tests.families import family_config, family_model
ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))  # past max_pos 64
both = ["sliding_attention", "full_attention"]
model = family_model("gemma3")
cfg = family_config("gemma3")
cfg.rope_parameters = {lt: {**cfg.rope_parameters[lt], "rope_type": "dynamic", "factor": 2.0} for lt in both}
torch.manual_seed(0)
native = T.Gemma3ForCausalLM(cfg).eval()
native.load_state_dict(model.state_dict())
print(list(set(cfg.layer_types)))
with torch.no_grad(), ropescale.patch(model, "dynamic_ntk", factor=2.0, layer_types=both):
    for n in (80, 100, 128):  # each the first forward at a new length (native's dynamic only grows)
        err = (model(ids[:, :n]).logits - native(ids[:, :n]).logits).abs().max().item()
        assert err <= 1e-5, (n, err)
print("ok")
"""


@pytest.mark.parametrize("hash_seed", ["0", "1"])  # Gemma 3 calls its layer types in set() order
def test_dynamic_on_both_layer_types_matches_native_whatever_the_call_order(hash_seed):
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", DYNAMIC_BOTH_TYPES], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_static_strategies_read_no_position_values():
    """Only dynamic strategies need max(position_ids): a static forward must not sync (meta tensors have no values)."""
    model = family_model("gemma3")
    with ropescale.patch(model, "linear", factor=2.0, layer_types=["sliding_attention", "full_attention"]):
        rotary = model.model.rotary_emb
        pos = torch.arange(10, device="meta")[None]
        x = torch.zeros(1, 10, 64, device="meta")
        for lt in ("full_attention", "sliding_attention"):
            cos, sin = rotary(x, pos, lt)
            assert cos.shape == sin.shape == (1, 10, 16) and cos.device.type == "meta"


def test_the_patchs_own_window_does_not_depend_on_the_order_of_layer_types():
    """Issue 54: ``patch`` kept each layer type's context in a loop and the last one named won
    ``handle.context`` — the T the record (``to_dict``, what ``save_patched`` re-applies), log-n and the
    exports read. With T 32 on the full-attention type and 64 on the sliding one, ``layer_types`` in one
    order recorded 64, in the other 32. Now the primary type's (full attention's) context is the patch's,
    whichever order; each type keeps its own in ``contexts``."""
    from tests.conftest import build, tiny_gemma3_config

    model = build(T.Gemma3ForCausalLM, tiny_gemma3_config(rope_type="yarn", factor=2.0,
                                                          original_max_position_embeddings=32))
    seen = []
    for order in (["full_attention", "sliding_attention"], ["sliding_attention", "full_attention"]):
        with ropescale.patch(model, "linear", factor=2.0, layer_types=order) as handle:
            assert {lt: c["original_max_position_embeddings"] for lt, c in handle.contexts.items()} == {
                "full_attention": 32, "sliding_attention": 64}
            seen.append((handle.context["original_max_position_embeddings"],
                         handle.to_dict()["original_max_position_embeddings"]))
    both = {"full_attention": 32, "sliding_attention": 64}  # the record keeps each type's T (one T was lossy)
    assert seen == [(32, both), (32, both)]


def test_a_saved_patch_whose_layer_types_have_different_windows_loads_back_exactly(tmp_path):
    """A patch recorded one T (the full-attention type's) for every layer type: loaded back, Gemma 3's sliding
    layers (T = 64 here) were re-patched with T = 32, so YaRN's ramp moved and the logits changed. The record
    keeps T per layer type where they differ, and ``patch`` takes such a mapping."""
    from tests.conftest import build, tiny_gemma3_config

    model = build(T.Gemma3ForCausalLM, tiny_gemma3_config(rope_type="yarn", factor=2.0,
                                                          original_max_position_embeddings=32)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ropescale.patch(model, "yarn", factor=4.0,
                                          layer_types=["full_attention", "sliding_attention"]) as handle:
        want = model(ids).logits
        ropescale.save_patched(model, _Tok(), tmp_path / "p")
        assert handle.to_dict()["original_max_position_embeddings"] == {"full_attention": 32,
                                                                         "sliding_attention": 64}
    loaded, _ = ropescale.load_model(str(tmp_path / "p"), device="cpu", tokenizer=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, want, rtol=0, atol=1e-5)
    assert ropescale.models.model_training_window(str(tmp_path / "p")) == 32  # the model's T: full attention's
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=\{'full_attention': 1\} must be"):
        ropescale.patch(model, "yarn", factor=2.0, original_max_position_embeddings={"full_attention": 1})
    with pytest.raises(ValueError, match=r"names no window for layer type 'sliding_attention'; it names "
                                         r"'full_attention'"):
        ropescale.patch(model, "yarn", factor=2.0, layer_types=["full_attention", "sliding_attention"],
                        original_max_position_embeddings={"full_attention": 64})
    llama = build(T.LlamaForCausalLM, T.LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match=r"names no window for this model, whose layers have no types: give one T"):
        ropescale.patch(llama, "yarn", factor=2.0, original_max_position_embeddings={"full_attention": 64})

"""log-n query scaling through the AttentionInterface."""

import pytest
import torch
from transformers import DynamicCache

import ropescale
from ropescale.attention import AttentionNotPluggableError, logn_factor
from tests.families import family_model

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(4))  # L_train = 64


@torch.no_grad()
def logits(model, ids=IDS):
    return model(ids).logits


def test_logn_factor_formula():
    f = logn_factor(torch.tensor([[0, 63, 64, 127, 4095]]), 64)
    expected = [max(1.0, __import__("math").log(p + 1) / __import__("math").log(64)) for p in (0, 63, 64, 127, 4095)]
    torch.testing.assert_close(f[0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    assert f[0, 1] == 1.0 and f[0, 2] > 1.0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])  # gemma2: eager attention
def test_logn_matches_queries_scaled_at_q_proj(family):
    """Oracle: scaling q_proj's output per token (a scalar commutes with the rotation)."""
    model = family_model(family)
    scale = logn_factor(torch.arange(100)[None], 64)[..., None]  # [1, s, 1]
    hooks = [m.register_forward_hook(lambda mod, a, out: out * scale)
             for n, m in model.named_modules() if n.endswith("q_proj")]
    expected = logits(model)
    for h in hooks:
        h.remove()
    with ropescale.patch(model, "vanilla", logn=True):
        torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt_neox", "phi3", "gemma3", "olmo"])  # fused qkv or q-norm
def test_logn_sdpa_and_eager_paths_agree(family):
    model = family_model(family)
    with ropescale.patch(model, "vanilla", logn=True):
        via_sdpa = logits(model)
    model.set_attn_implementation("eager")
    with ropescale.patch(model, "vanilla", logn=True):
        assert model.config._attn_implementation == "ropescale_logn_eager"
        torch.testing.assert_close(logits(model), via_sdpa, rtol=0, atol=1e-5)
    assert not torch.equal(via_sdpa, logits(model))  # it did scale something


def test_logn_inside_training_window_changes_nothing_and_unpatch_restores():
    model = family_model("llama")
    short = IDS[:, :60]
    base, base_long = logits(model, short), logits(model)
    with ropescale.patch(model, "yarn", factor=1.0, logn=True):
        assert model.config._attn_implementation == "ropescale_logn_sdpa"
        torch.testing.assert_close(logits(model, short), base, rtol=0, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model), base_long)


def test_logn_cached_decoding_equals_full_forward():
    model = family_model("llama")
    with torch.no_grad(), ropescale.patch(model, "linear", factor=2.0, logn=True):
        cache = DynamicCache(config=model.config)
        model(IDS[:, :60], past_key_values=cache, use_cache=True)
        for t in range(60, 80):
            step = model(IDS[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, model(IDS[:, : t + 1]).logits[:, -1], rtol=0, atol=1e-5)


def test_model_bypassing_the_interface_is_refused_and_left_intact():
    model = family_model("falcon")
    base = logits(model)
    with pytest.raises(AttentionNotPluggableError, match="does not route attention through"):
        ropescale.patch(model, "yarn", factor=2.0, logn=True)
    assert ropescale.current_patch(model) is None and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model), base)

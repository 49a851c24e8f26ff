"""log-n query scaling through the AttentionInterface: around sdpa, eager, flex_attention and a
user's own implementation (with flash's mask function); lazy registration; per-model counters."""

import os
import subprocess
import sys

import pytest
import torch
import transformers.integrations.flex_attention
import transformers.masking_utils
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, flex_attention_mask

import ropescale
import ropescale.attention
from ropescale.attention import AttentionNotPluggableError, logn_factor, register_logn
from tests.conftest import with_cache
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
        model(IDS[:, :60], **with_cache(cache), use_cache=True)
        for t in range(60, 80):
            step = model(IDS[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, model(IDS[:, : t + 1]).logits[:, -1], rtol=0, atol=1e-5)


def test_model_bypassing_the_interface_is_refused_and_left_intact():
    model = family_model("falcon")
    base = logits(model)
    with pytest.raises(AttentionNotPluggableError, match="does not route attention through"):
        ropescale.patch(model, "yarn", factor=2.0, logn=True)
    assert ropescale.current_patch(model) is None and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model), base)


def _hand_scaled(model, ids, **kw):
    """Oracle logits: log-n applied by hand to q_proj's output (a per-token scalar commutes with RoPE)."""
    scale = logn_factor(torch.arange(ids.shape[1])[None], 64)[..., None]  # [1, s, 1]
    if "position_ids" in kw:
        scale = logn_factor(kw["position_ids"], 64)[..., None]  # [b, s, 1]
    hooks = [m.register_forward_hook(lambda mod, a, out: out * scale)
             for n, m in model.named_modules() if n.endswith("q_proj")]
    try:
        with torch.no_grad():
            return model(ids, **kw).logits
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_logn_wraps_flex_attention(monkeypatch):
    """transformers' own flex_attention integration (it runs on the CPU in eval): log-n wraps it
    under ropescale_logn_flex_attention, with flex's mask function (a BlockMask builder). Run eagerly
    Uncompiled: transformers compiles flex and its block mask, 50 s of inductor on the CPU for a
    wrapper's test; its own switch to the uncompiled kernel (taken when it is already compiling) and
    create_block_mask's ``_compile=False`` are taken here."""
    monkeypatch.setattr(transformers.integrations.flex_attention, "is_torchdynamo_compiling", lambda: True)
    block_mask = transformers.masking_utils.create_block_mask
    monkeypatch.setattr(transformers.masking_utils, "create_block_mask",
                        lambda *a, **kw: block_mask(*a, **{**kw, "_compile": False}))
    model = family_model("llama")
    model.set_attn_implementation("flex_attention")
    ids = IDS[:, :80]
    expected = _hand_scaled(model, ids)
    with ropescale.patch(model, "vanilla", logn=True):
        assert model.config._attn_implementation == "ropescale_logn_flex_attention"
        assert AttentionMaskInterface._global_mapping["ropescale_logn_flex_attention"] is flex_attention_mask
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "flex_attention"


def _padding_mask_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A user's attention function taking flash_attention_2's mask: None, or a 2-D ``[b, s_k]``
    padding mask (causality is implied). Computes sdpa; every query also sees itself, so padded
    rows stay finite. Records the mask and the implementation name it sees. ``[b, s_q, n_h, h_d]``."""
    assert attention_mask is None or attention_mask.dim() == 2, "expected flash's 2-D padding mask"
    s_q, s_k = query.shape[2], key.shape[2]
    slot = torch.arange(s_k - s_q, s_k)[:, None]  # [s_q, 1] query slots
    keep = torch.arange(s_k)[None] <= slot  # [s_q, s_k] causal
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]  # [b, 1, s_q, s_k]
    keep = keep | (torch.arange(s_k)[None] == slot)
    n_rep = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1), attn_mask=keep, scale=scaling)
    _padding_mask_sdpa.seen.append((attention_mask, module.config._attn_implementation))
    return out.transpose(1, 2).contiguous(), None


_padding_mask_sdpa.seen = []


@pytest.mark.parametrize("name", ["test_padding_mask_sdpa", "test_flash_style_sdpa"])
def test_logn_wraps_any_registered_attention_with_its_own_mask_function(name):
    """A new implementation whose mask function is flash's: log-n registers that mask function
    under its own name (else transformers would hand it no mask and padding would be lost). A
    name containing "flash" is a flash kernel to transformers, loaded by the name the layer's
    config gives: the wrapped function must still see its own name there."""
    AttentionInterface.register(name, _padding_mask_sdpa)
    AttentionMaskInterface.register(name, flash_attention_mask)
    model = family_model("llama")
    if "flash" in name:  # set_attn_implementation would look for a hub kernel of that name
        model.config._attn_implementation = name
    else:
        model.set_attn_implementation(name)
    mask = torch.ones_like(IDS)
    mask[1, :15] = 0
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    expected = _hand_scaled(model, IDS, **kw)
    _padding_mask_sdpa.seen.clear()
    with ropescale.patch(model, "vanilla", logn=True):
        assert model.config._attn_implementation == "ropescale_logn_" + name
        assert AttentionMaskInterface._global_mapping["ropescale_logn_" + name] is flash_attention_mask
        with torch.no_grad():
            out = model(IDS, **kw).logits
    seen_mask, seen_name = _padding_mask_sdpa.seen[-1]
    assert seen_mask.shape == (2, 100)  # the padding reached the wrapped function
    assert seen_name == (name if "flash" in name else "ropescale_logn_" + name)
    torch.testing.assert_close(out[:, 15:], expected[:, 15:], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=1e-5)
    assert model.config._attn_implementation == name


def test_logn_of_an_unregistered_implementation_is_one_value_error():
    with pytest.raises(ValueError, match="'no_such_attention' is not one"):
        register_logn("no_such_attention")


def test_call_counters_live_on_each_models_state_not_globally():
    a, b = family_model("llama"), family_model("llama")
    with ropescale.patch(a, "vanilla", logn=True), ropescale.patch(b, "rerope", window=8):
        state_a = a.model.layers[0].self_attn._ropescale_logn
        state_b = b.model.layers[1].self_attn._ropescale_truncation
        assert state_a is a.model.layers[1].self_attn._ropescale_logn  # one object per model
        before_a, before_b = state_a.calls, state_b.calls
        logits(a)
        assert state_a.calls == before_a + 2 and state_b.calls == before_b  # 2 layers, only model a
        logits(b)
        assert state_b.calls == before_b + 2 and state_a.calls == before_a + 2
    assert not hasattr(ropescale.attention, "_CALLS")


def test_nothing_is_registered_at_import():
    """The wrappers are registered when first enabled, not by importing ropescale."""
    code = ("import ropescale, ropescale.attention; from transformers import AttentionInterface; "
            "from transformers.masking_utils import AttentionMaskInterface; "
            "print([k for k in {**AttentionInterface._global_mapping, **AttentionMaskInterface._global_mapping} "
            "if k.startswith('ropescale')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "[]"

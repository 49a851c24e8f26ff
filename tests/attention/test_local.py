"""Sliding-window layers without n × n masks (``ropescale.attention.local``): against transformers' own
sdpa attention with the masks it builds, on the families that ship sliding windows, with padding, a
KV cache and bfloat16; the check that keeps sdpa where the path would be wrong; the memory estimate."""

import json

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import ropescale
from ropescale.attention.local import LOCAL, enable_local_attention, local_attention
from ropescale.runs.memory import forward_bytes, model_dims
from tests.conftest import build, tiny_gemma3_config, with_cache
from tests.families import family_model

N = 70  # > every tiny config's window: band calls of every kind


def _gemma3(**kw):
    from transformers import Gemma3ForCausalLM

    return build(Gemma3ForCausalLM, tiny_gemma3_config(**kw))


def _mistral():
    model = family_model("mistral")
    model.config.sliding_window = 12
    return model


def _qwen2():  # sliding window on the layers from max_window_layers on
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=10,
                      max_window_layers=2, max_position_embeddings=128)
    return build(Qwen2ForCausalLM, cfg)


def _cohere2():
    from transformers import Cohere2Config, Cohere2ForCausalLM

    cfg = Cohere2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=9, max_position_embeddings=128,
                        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    return build(Cohere2ForCausalLM, cfg)


MODELS = {"gemma3": _gemma3, "mistral": _mistral, "qwen2": _qwen2, "cohere2": _cohere2}
IDS = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model, ids=IDS, **kw):
    return model(input_ids=ids, **kw).logits


@pytest.mark.parametrize("family", sorted(MODELS))
def test_local_attention_gives_sdpa_with_its_masks(family):
    """Oracle: the same model under transformers' sdpa and the n × n masks it builds — batch rows with
    and without left padding."""
    model = MODELS[family]()
    mask = torch.ones_like(IDS)
    mask[1, :7] = 0
    expected = _logits(model, attention_mask=mask)
    assert model_dims(model).dense_masks
    assert enable_local_attention(model)
    assert model.config._attn_implementation == LOCAL and not model_dims(model).dense_masks
    got = _logits(model, attention_mask=mask)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(got[1, 7:], expected[1, 7:], rtol=0, atol=2e-5)  # padded rows: no one reads them


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_local_attention_under_a_kv_cache(family):
    """Prefill, a 13-token chunk, then single tokens on the cache (Gemma 3's sliding layers keep their
    window only) give the full forward's logits."""
    model = MODELS[family]()
    ids = IDS[:1]
    expected = _logits(model, ids)
    assert enable_local_attention(model)
    cache = DynamicCache(config=model.config)
    got = [_logits(model, ids[:, :40], use_cache=True, **with_cache(cache)),
           _logits(model, ids[:, 40:53], use_cache=True, **with_cache(cache))]
    got += [_logits(model, ids[:, t : t + 1], use_cache=True, **with_cache(cache)) for t in range(53, N)]
    torch.testing.assert_close(torch.cat(got, 1), expected, rtol=0, atol=2e-5)


def test_local_attention_in_bfloat16():
    model = _gemma3().to(torch.bfloat16)
    expected = _logits(model, IDS[:1]).float()
    assert enable_local_attention(model)
    got = _logits(model, IDS[:1]).float()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_no_mask_wider_than_the_keys_reaches_the_layers():
    """What the layers get under local attention: padding masks ``[b, 1, 1, s_k]`` or None, never
    ``[b, 1, s_q, s_k]``."""
    model = _gemma3()
    assert enable_local_attention(model)
    seen = []

    def spy(module, q, k, v, attention_mask, **kw):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return local_attention(module, q, k, v, attention_mask, **kw)

    AttentionInterface.register(LOCAL, spy)
    try:
        mask = torch.ones_like(IDS)
        mask[1, :3] = 0
        _logits(model, attention_mask=mask)
        _logits(model, IDS[:1])
    finally:
        AttentionInterface.register(LOCAL, local_attention)
    assert seen[:6] == [(2, 1, 1, N)] * 6 and seen[6:] == [None] * 6


def test_a_model_the_path_does_not_fit_keeps_sdpa():
    """Layers that take their window from the mask only (no ``sliding_window`` passed to attention)
    would attend past it under local attention: the enabling forward sees it and keeps sdpa."""
    model = _gemma3()
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    expected = _logits(model)
    assert not enable_local_attention(model)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)


def test_enabled_only_where_it_helps():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    assert not enable_local_attention(build(LlamaForCausalLM, tiny_llama_config()))  # no sliding window
    assert not enable_local_attention(family_model("gemma2"))  # soft-capping: eager
    model = _gemma3()
    model.set_attn_implementation("eager")
    assert not enable_local_attention(model) and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("strategy,params", [("yarn", {"factor": 4.0}), ("rerope", {"window": 24}),
                                             ("vanilla", {"logn": True})])
def test_patches_compose_with_local_attention(strategy, params):
    """A frequency patch, a relative rule and log-n on top of local attention give what they give on
    sdpa; unpatching returns to local attention."""
    model = _gemma3()
    with ropescale.patch(model, strategy, **params):
        expected = _logits(model)
    assert enable_local_attention(model)
    with ropescale.patch(model, strategy, **params):
        torch.testing.assert_close(_logits(model), expected, rtol=0, atol=2e-5)
    assert model.config._attn_implementation == LOCAL
    assert ALL_ATTENTION_FUNCTIONS[LOCAL] is local_attention


def test_the_memory_estimate_counts_the_masks_sdpa_builds():
    """n² bytes of bool mask and n² float32 of SDPA's additive copy, gone under local attention."""
    model = _gemma3()
    n = 65_536
    dense = forward_bytes(model_dims(model), n, 4)
    assert enable_local_attention(model)
    assert dense - forward_bytes(model_dims(model), n, 4) == n * n * 5


def test_a_sweep_on_a_sliding_window_model_runs_local_attention(tiny_gemma3_dir, tmp_path, monkeypatch):
    """The harness switches a sliding-window model to local attention on the CPU, and its perplexity
    is sdpa's: an independent NLL loop over the same window under transformers' own masks."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    from eval.config import EvalConfig
    from eval.sweep import run_sweep

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} and{i % 11}" for i in range(400)))
    cfg = EvalConfig(model=str(tiny_gemma3_dir), data=str(text), lengths=[96], strategies=["vanilla"],
                     max_windows=1, device="cpu")
    calls = []
    monkeypatch.setattr("ropescale.attention.local.enable_local_attention",
                        lambda m: calls.append(enable_local_attention(m)) or calls[-1])
    rows = run_sweep(cfg, tmp_path / "run", progress=False)
    assert calls == [True]
    tok = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    ids = torch.tensor(tok(text.read_text(), add_special_tokens=False)["input_ids"][:96])[None]
    model = Gemma3ForCausalLM.from_pretrained(tiny_gemma3_dir).eval()
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
    nll = -logp.gather(-1, ids[0, 1:, None]).mean().item()
    assert rows[0]["nll"] == pytest.approx(nll, rel=1e-5)
    assert json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[0])["nll"] == rows[0]["nll"]

"""Truncation rules inside attention: the blocked O(n) path against the naive n × n oracle,
vanilla equivalence, cached decoding, padding, log-n, and refusal where attention is not pluggable."""

import pytest
import torch
from transformers import DynamicCache

import ropescale
from ropescale.attention import AttentionNotPluggableError, logn_factor
from ropescale.truncated_attention import blocked_attention, naive_attention
from ropescale.strategies.truncation import leaky_rerope, rerope, self_extend
from tests.families import family_model

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(5))
RULES = [("rerope", {"window": 8}), ("rerope", {"window": 40}), ("leaky_rerope", {"window": 16, "k": 4.0}),
         ("self_extend", {"window": 16, "group_size": 4}), ("self_extend", {"window": 8, "group_size": 3})]
FAMILIES = ["llama", "qwen2", "gemma2", "gpt_neox"]  # gemma2: eager, softcap, sliding window; neox: partial


@torch.no_grad()
def logits(model, ids=IDS, **kw):
    return model(ids, **kw).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,params", RULES, ids=[f"{s}-{p}" for s, p in RULES])
@pytest.mark.parametrize("length", [30, 100])
def test_blocked_equals_naive_oracle(family, strategy, params, length):
    model = family_model(family)
    ids = IDS[:, :length]
    with ropescale.patch(model, strategy, block_size=16, **params):
        fast = logits(model, ids)
    with ropescale.patch(model, strategy, attention_path="naive", **params):
        slow = logits(model, ids)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES + ["gemma3", "phi3"])
def test_rerope_with_window_beyond_length_is_vanilla(family):
    model = family_model(family)
    base = logits(model)
    with ropescale.patch(model, "rerope", window=100):
        torch.testing.assert_close(logits(model), base, rtol=0, atol=1e-5)
    assert torch.equal(logits(model), base)  # unpatch is exact


def test_rule_changes_logits_past_the_window():
    model = family_model("llama")
    base = logits(model)
    with ropescale.patch(model, "rerope", window=8):
        assert not torch.allclose(logits(model), base, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
@pytest.mark.parametrize("strategy,params", RULES[::2], ids=[s for s, _ in RULES[::2]])
def test_cached_decoding_equals_full_forward(family, strategy, params):
    model = family_model(family)
    with torch.no_grad(), ropescale.patch(model, strategy, block_size=16, **params):
        cache = DynamicCache(config=model.config)
        model(IDS[:, :70], past_key_values=cache, use_cache=True)
        for t in range(70, 85):
            step = model(IDS[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, logits(model, IDS[:, : t + 1])[:, -1], rtol=0, atol=1e-5)


def test_generate_runs_and_agrees_with_full_forward():
    model = family_model("llama")
    with torch.no_grad(), ropescale.patch(model, "self_extend", window=16, group_size=4):
        g = model.generate(IDS[:, :60], attention_mask=torch.ones_like(IDS[:, :60]), max_new_tokens=10,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
        for i, step in enumerate(g.logits):
            torch.testing.assert_close(step, logits(model, g.sequences[:, : 60 + i])[:, -1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", ["blocked", "naive"])
def test_left_padded_batch_equals_rows_alone(path):
    model = family_model("gemma2")
    short = IDS[1:2, 12:80]
    batch = torch.cat([IDS[0:1, :80], torch.cat([torch.zeros(1, 12, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :12] = 0
    with ropescale.patch(model, "leaky_rerope", window=16, k=4.0, attention_path=path):
        out = logits(model, batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        torch.testing.assert_close(out[1, 12:], logits(model, short)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[0], logits(model, IDS[0:1, :80])[0], rtol=0, atol=1e-5)


def test_logn_with_a_truncation_rule_matches_queries_scaled_at_q_proj():
    model = family_model("llama")
    scale = logn_factor(torch.arange(100)[None], 64)[..., None]
    hooks = [m.register_forward_hook(lambda mod, a, out: out * scale[:, : out.shape[1]])  # patch probes 2 tokens
             for n, m in model.named_modules() if n.endswith("q_proj")]
    with ropescale.patch(model, "rerope", window=16, attention_path="naive"):
        expected = logits(model)
    for h in hooks:
        h.remove()
    with ropescale.patch(model, "rerope", window=16, logn=True):
        torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)


def test_falcon_is_refused_not_silently_vanilla():
    model = family_model("falcon")
    base = logits(model)
    with pytest.raises(AttentionNotPluggableError, match="does not route attention"):
        ropescale.patch(model, "rerope", window=8)
    assert ropescale.current_patch(model) is None and torch.equal(logits(model), base)


def test_bad_attention_options():
    model = family_model("llama")
    with pytest.raises(ValueError, match="attention_path='flash'"):
        ropescale.patch(model, "rerope", attention_path="flash")
    with pytest.raises(ValueError, match="block_size=0"):
        ropescale.patch(model, "rerope", block_size=0)


@pytest.mark.parametrize("rule", [rerope(8), leaky_rerope(8, 4.0, None, 64), self_extend(4, 8)])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_kernel_block_sizes_and_gqa_against_oracle(rule, block):
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 6, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    pos = torch.arange(40).float()[None].expand(2, -1)
    inv = 1.0 / (10000 ** (torch.arange(0, 10, 2).float() / 10))  # partial rotary: 10 of 16 channels
    for interleaved in (False, True):
        a = blocked_attention(q, k, v, pos, pos, rule, inv, 1.2, scale=0.25, block=block, interleaved=interleaved,
                              softcap=5.0, sliding_window=30)
        b = naive_attention(q, k, v, pos, pos, rule, inv, 1.2, scale=0.25, interleaved=interleaved,
                            softcap=5.0, sliding_window=30)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

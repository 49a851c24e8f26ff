"""Relative rules on sparse-attention models whose indexer selects keys (DSA, QSA): the indexer keeps the
model's own rotation, attention applies the rule over the keys it selected (ropescale.attention.indexers).

Oracles: the unpatched model itself inside the rule's window (every rule is plain RoPE at distances below
it), and past the window the float64 naive path (``attention_path="naive"``: the rule's matrix p(i, j) and
the rotation identity, written out) fed the same selection. The census (tests/test_census.py) runs the
window check on all seven indexer types of transformers 5.24 (DSA: deepseek_v32, glm_moe_dsa,
dots3_note_text, axk2, hy_v4; QSA: qwen4_exp, qwen4_exp_text) with a selection smaller than the window.
"""

import pytest
import torch
from torch import nn

import ropescale
from ropescale.attention.indexers import find_indexers, hook_indexers
from ropescale.errors import InvalidInput
from tests.census.build import build, text_config, tiny_config
from tests.census.checks import RULES, WINDOW, inputs
from tests.census.run import types


def _indexed_model(name: str):
    if name not in types():
        pytest.skip(f"{name} is not a model type of the installed transformers")
    config = tiny_config(types()[name])
    text = text_config(config)
    budget = getattr(text, "index_topk", None) or getattr(text, "indexer_budget", None)
    assert budget is not None and budget < WINDOW  # the indexer drops keys inside the window
    return build(types()[name], config)


def test_every_rule_inside_its_window_equals_the_model():
    """Bit for bit in float64 (the census checks the same on all seven indexer types, to its tolerance)."""
    name = "deepseek_v32"
    model = _indexed_model(name)
    ids, _ = inputs()
    with torch.no_grad():
        ref = model(ids).logits
        for rule, params in RULES.items():
            with ropescale.patch(model, rule, **params):
                got = model(ids).logits
            inside = (got - ref)[:, :WINDOW].abs().max().item()
            assert inside <= 1e-12, f"{name} {rule}: max|Δ| {inside:.1e} inside the window"
            assert (got - ref)[:, WINDOW:].abs().max().item() > 1e-3  # past it the rule acts
        assert torch.equal(model(ids).logits, ref)  # unpatched again


def test_past_the_window_the_rule_acts_over_the_selected_keys():
    """deepseek_v32 at 6× the window: the default path (blocked, under the indexer's per-query mask) equals
    the naive float64 oracle, and layer 0 selects exactly the keys the unpatched model's indexer selects."""
    model = _indexed_model("deepseek_v32")
    ids, _ = inputs()
    picked = []
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(
        lambda m, a, o: picked.append(o.sort(-1).values))  # [b, s, topk] key indices
    out = {}
    with torch.no_grad():
        model(ids)
        unpatched = picked[-1]
        for path in ("fused", "naive"):
            with ropescale.patch(model, "rerope", window=WINDOW, attention_path=path):
                out[path] = model(ids).logits
                assert torch.equal(picked[-1], unpatched)
    hook.remove()
    assert unpatched.shape[-1] < ids.shape[1]  # keys were dropped
    # the model's (and the default path's) angles p·θ are float32, the oracle's float64: 1e-5 of the logits
    assert (out["fused"] - out["naive"]).abs().max().item() <= 1e-5 * out["naive"].abs().max().item()


def test_indexers_are_found_by_their_position_embeddings_argument():
    model = _indexed_model("deepseek_v32")
    attn = model.model.layers[0].self_attn
    assert find_indexers(attn) == [attn.indexer]


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1]), persistent=False)

    def forward(self, x, position_ids):
        angle = position_ids[..., None].float() * self.inv_freq  # [b, s, d/2]
        return torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)


class _Indexer(nn.Module):
    def forward(self, hidden_states, position_embeddings):
        return position_embeddings


def test_an_indexer_gets_the_model_rotation_and_a_foreign_one_is_refused():
    rotary, indexer = _Rotary(), _Indexer()
    own = rotary.inv_freq.clone()

    class Own:  # the context under which the rotary module holds its own frequencies
        def __enter__(self):
            self.saved, rotary.inv_freq = rotary.inv_freq, own

        def __exit__(self, *exc):
            rotary.inv_freq = self.saved

    rotary.inv_freq = torch.zeros(2)  # what a relative rule leaves: the identity
    remove = hook_indexers([indexer], [rotary], lambda m: Own())
    pos = torch.arange(5)[None]
    x = torch.zeros(1, 5, 4)
    cos, sin = indexer(x, rotary(x, pos))
    assert torch.equal(cos[0, :, 0], torch.arange(5.0).cos())
    assert torch.equal(sin[0, :, 1], (torch.arange(5.0) * 0.1).sin())
    assert torch.equal(rotary.inv_freq, torch.zeros(2))  # the rule's frequencies are back
    with pytest.raises(InvalidInput, match="no rotary module"):
        indexer(x, (torch.ones(1, 5, 4), torch.zeros(1, 5, 4)))
    remove()
    cos, _ = indexer(x, rotary(x, pos))
    assert torch.equal(cos, torch.ones(1, 5, 4))  # hooks removed

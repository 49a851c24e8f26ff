"""Training through a patch: parameter gradients equal those of transformers' own rope types,
log-n equals queries scaled by hand, dynamic strategies train at the target length, dropout
is honoured."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

import ropescale
from ropescale.attention import logn_factor
from ropescale.training.loop import causal_lm_loss
from tests.conftest import build, tiny_llama_config

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(7))  # T = 64 < 100


def grads(model, batch=None) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    causal_lm_loss(model, batch or {"input_ids": IDS}).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = b[name].abs().max()
        assert scale > 0, name
        err = (a[name] - b[name]).abs().max() / scale
        assert err <= rtol, f"{name}: relative difference {err:.2e}"


NATIVE = {  # ours, transformers' rope_parameters (tests/test_architectures.py's cases)
    "linear": ({"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    "yarn": ({"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama3": ({"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
               {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    "dynamic_ntk": ({"factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}),
}


@pytest.mark.parametrize("strategy", NATIVE)
def test_gradients_equal_transformers_native_rope_type(strategy):
    ours, native = NATIVE[strategy]
    reference = build(LlamaForCausalLM, tiny_llama_config(**native))
    model = build(LlamaForCausalLM, tiny_llama_config(), reference.state_dict())
    expected = grads(reference)
    with ropescale.patch(model, strategy, **ours):
        got = grads(model)
    assert_same_grads(got, expected)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           grads(model)["model.layers.0.self_attn.q_proj.weight"])


def test_logn_gradients_equal_queries_scaled_by_hand():
    """Oracle: q_proj's output multiplied per token by max(1, ln(p+1)/ln T) (a scalar per position
    commutes with the rotation), on the native linear rope type."""
    reference = build(LlamaForCausalLM, tiny_llama_config(rope_type="linear", factor=2.0))
    model = build(LlamaForCausalLM, tiny_llama_config(), reference.state_dict())
    scale = logn_factor(torch.arange(IDS.shape[1])[None], 64)[..., None]  # [1, s, 1]
    assert scale.max() > 1
    hooks = [m.register_forward_hook(lambda mod, a, out: out * scale)
             for n, m in reference.named_modules() if n.endswith("q_proj")]
    expected = grads(reference)
    for h in hooks:
        h.remove()
    with ropescale.patch(model, "linear", factor=2.0, logn=True):
        got = grads(model)
    assert_same_grads(got, expected)


def test_dynamic_strategy_trains_at_the_target_length():
    """In training mode with training_length L, dynamic NTK (factor 1) on a short PoSE-like batch
    uses s = L/T: the same as static NTK with factor L/T. In eval mode it is vanilla again."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    static = copy.deepcopy(model)
    pos = torch.cat([torch.arange(10), torch.arange(40, 50)])[None].expand(2, -1)  # [2, 20], max 49 < T
    batch = {"input_ids": IDS[:, :20], "position_ids": pos}
    with ropescale.patch(static, "ntk", factor=4.0):
        expected = grads(static, batch)
    with ropescale.patch(model, "dynamic_ntk"):
        ropescale.current_patch(model).train_at(256)  # L = 4T
        assert_same_grads(grads(model, batch), expected)
        model.eval()
        with torch.no_grad():
            eval_logits = model(input_ids=IDS[:, :20], position_ids=pos).logits
    with torch.no_grad():
        vanilla = model.eval()(input_ids=IDS[:, :20], position_ids=pos).logits
    torch.testing.assert_close(eval_logits, vanilla, rtol=0, atol=1e-6)


@pytest.mark.parametrize("logn", [False, True])
def test_attention_dropout_is_honoured_in_training_mode(logn):
    config = tiny_llama_config()
    config.attention_dropout = 0.5
    model = build(LlamaForCausalLM, config)
    with ropescale.patch(model, "yarn", factor=2.0, logn=logn), torch.no_grad():
        model.train()
        a, b = (causal_lm_loss(model, {"input_ids": IDS}) for _ in range(2))
        assert a != b  # dropout drew different masks
        model.eval()
        c, d = (causal_lm_loss(model, {"input_ids": IDS}) for _ in range(2))
        assert c == d

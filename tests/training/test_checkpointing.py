"""Gradient checkpointing (transformers' non-reentrant activation checkpointing): the same batch
gives the same loss and the same parameter gradients with and without it, for frequency rules,
dynamic ones, log-n, truncation rules through the fused kernel's autograd Function, and PoSE
position ids — the oracle is the same model without checkpointing. The layers really are
recomputed (each attention runs twice per step), and a training run gives the same loss curve."""

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

import ropescale
from ropescale.training import build_finetune_config, finetune
from ropescale.training.loop import causal_lm_loss, enable_checkpointing
from ropescale.training.pose import sample_pose
from ropescale.training.report import read_log
from tests.conftest import build, tiny_llama_config
from tests.training.test_gradients import IDS, assert_same_grads

# [2, 64] < 200
POSE = sample_pose(64, 200, np.random.default_rng(3), chunks=3, sampling="paper").position_ids[None].expand(2, -1)


def loss_and_grads(model, batch, checkpointing: bool, chunk_size=0):
    model.train()
    model.zero_grad()
    if checkpointing:
        enable_checkpointing(model)
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    loss = causal_lm_loss(model, batch, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {  # strategy, patch kwargs, batch
    "linear": ("linear", {"factor": 2.0}, {"input_ids": IDS}),
    "yarn+logn": ("yarn", {"factor": 2.0, "logn": True}, {"input_ids": IDS}),
    "dynamic_ntk": ("dynamic_ntk", {}, {"input_ids": IDS}),
    "rerope (fused)": ("rerope", {"window": 16}, {"input_ids": IDS}),
    "leaky_rerope+logn (fused)": ("leaky_rerope", {"window": 16, "logn": True}, {"input_ids": IDS}),
    "yarn+PoSE": ("yarn", {"factor": 4.0}, {"input_ids": IDS[:, :64], "position_ids": POSE}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [0, None])
def test_same_loss_and_gradients_with_and_without_checkpointing(case, chunk_size):
    strategy, kwargs, batch = CASES[case]
    model = build(LlamaForCausalLM, tiny_llama_config())
    with ropescale.patch(model, strategy, **kwargs):
        if strategy == "dynamic_ntk":
            ropescale.current_patch(model).train_at(256)
        loss, expected = loss_and_grads(model, batch, checkpointing=False, chunk_size=chunk_size)
        calls = []
        hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        got_loss, got = loss_and_grads(model, batch, checkpointing=True, chunk_size=chunk_size)
        hook.remove()
    assert len(calls) == 2  # forward, then again in backward: the layer was checkpointed
    assert abs(got_loss - loss) <= 1e-5 * loss
    assert_same_grads(got, expected, rtol=1e-5)


def test_attention_dropout_draws_the_same_masks_when_recomputed():
    """With dropout, a recomputation that drew new masks would give other gradients; checkpointing
    restores the RNG state. Oracle: the same seed without checkpointing."""
    model = build(LlamaForCausalLM, tiny_llama_config().__class__(**{**tiny_llama_config().to_dict(),
                                                                     "attention_dropout": 0.3}))
    with ropescale.patch(model, "yarn", factor=2.0, attention_path="fused"):
        torch.manual_seed(1)
        loss, expected = loss_and_grads(model, {"input_ids": IDS}, checkpointing=False)
        torch.manual_seed(1)
        got_loss, got = loss_and_grads(model, {"input_ids": IDS}, checkpointing=True)
        torch.manual_seed(2)
        other, _ = loss_and_grads(model, {"input_ids": IDS}, checkpointing=True)
    assert other != loss  # dropout is on
    assert abs(got_loss - loss) <= 1e-6 * loss
    assert_same_grads(got, expected, rtol=1e-5)


def losses(output):
    return [r["loss"] for r in read_log(output) if "loss" in r]


@pytest.mark.parametrize("strategy,extra", [("yarn", {"pose": {"chunks": 2}}), ("rerope", {})])
def test_a_run_with_checkpointing_trains_as_one_without(tmp_path, tiny_run, strategy, extra):
    raw = tiny_run(strategy=strategy, steps=3, eval=None, checkpoint_every=10, **extra)
    finetune(build_finetune_config(raw), tmp_path / "plain", progress=False)
    out = finetune(build_finetune_config({**raw, "gradient_checkpointing": True}), tmp_path / "ckpt", progress=False)
    assert out["config"]["gradient_checkpointing"] is True
    assert losses(tmp_path / "ckpt") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


def _counting_offload(monkeypatch) -> dict:
    """``torch.autograd.graph.save_on_cpu`` with its packs counted: how the loop's offload is seen to act."""
    real, seen = torch.autograd.graph.save_on_cpu, {"packs": 0, "pinned": []}

    class Counting(real):
        def __init__(self, pin_memory=False, **kw):
            super().__init__(pin_memory=pin_memory, **kw)
            seen["pinned"].append(pin_memory)
            pack = self.pack_hook

            def counted(tensor):
                seen["packs"] += 1
                return pack(tensor)

            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    return seen


@pytest.mark.parametrize("case,frozen_head", [("linear", False), ("rerope (fused)", False), ("linear", True)])
def test_offloaded_activations_give_the_same_loss_and_gradients(case, frozen_head, monkeypatch):
    """Oracle: the same step with checkpointing and no offload (a frozen head: as LoRA trains). The offload
    really acts: each checkpointed layer's inputs pass through save_on_cpu's pack."""
    strategy, kwargs, batch = CASES[case]
    model = build(LlamaForCausalLM, tiny_llama_config())
    model.lm_head.weight.requires_grad_(not frozen_head)
    seen = _counting_offload(monkeypatch)
    with ropescale.patch(model, strategy, **kwargs):
        loss, expected = loss_and_grads(model, batch, checkpointing=True, chunk_size=16)
        assert seen["packs"] == 0
        model.zero_grad()
        enable_checkpointing(model, offload=True)
        got_loss = causal_lm_loss(model, batch, chunk_size=16)
        got_loss.backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert seen["packs"] >= model.config.num_hidden_layers
    assert seen["pinned"] == [True] * model.config.num_hidden_layers  # one per layer; pinned where a GPU is
    assert got_loss == loss
    assert_same_grads(got, expected, rtol=0)


def test_activation_offload_needs_checkpointing(tiny_run):
    from ropescale.training.config import ConfigError

    with pytest.raises(ConfigError, match="activation_offload: needs gradient_checkpointing"):
        build_finetune_config(tiny_run(activation_offload=True))
    cfg = build_finetune_config(tiny_run(activation_offload=True, gradient_checkpointing=True))
    assert cfg.identity() == build_finetune_config(tiny_run()).identity()  # same numbers: the same run


def test_a_run_with_activation_offload_trains_as_one_without(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=3, eval=None, checkpoint_every=10, gradient_checkpointing=True)
    finetune(build_finetune_config(raw), tmp_path / "plain", progress=False)
    finetune(build_finetune_config({**raw, "activation_offload": True}), tmp_path / "offload", progress=False)
    assert losses(tmp_path / "offload") == losses(tmp_path / "plain")

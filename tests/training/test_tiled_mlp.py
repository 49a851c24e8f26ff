"""tiled_mlp (DeepSpeed's TiledMLP on each decoder layer's MLP): the same loss and gradients as the plain MLP —
with checkpointing, offload and LoRA —, the MLP really run slice by slice, and one line without DeepSpeed."""

import pytest
from transformers import LlamaForCausalLM

import ropescale
from ropescale.training import build_finetune_config, finetune
from ropescale.training.loop import causal_lm_loss, enable_checkpointing
from ropescale.training.tiled_mlp import enable_tiled_mlp, tiled_mlp_available
from tests.conftest import build, tiny_llama_config
from tests.training.test_checkpointing import losses
from tests.training.test_gradients import IDS, assert_same_grads

pytestmark = pytest.mark.skipif(not tiled_mlp_available(), reason="DeepSpeed is not installed (ropescale[scale])")


def _step(model, batch):
    model.train()
    model.zero_grad()
    loss = causal_lm_loss(model, batch, chunk_size=16)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shards", [None, 3])
@pytest.mark.parametrize("stack", ["plain", "checkpointing+offload", "lora"])
def test_tiled_mlp_gives_the_plain_mlps_loss_and_gradients(shards, stack):
    """Oracle: the same model and batch without tiling. Each MLP's own forward runs once per slice."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    if stack == "checkpointing+offload":
        enable_checkpointing(model, offload=True)
    if stack == "lora":
        from ropescale.training.lora import LoraSettings, apply_lora

        enable_checkpointing(model)
        model = apply_lora(model, LoraSettings())
    batch = {"input_ids": IDS}  # [2, 100]; hidden 64: ⌈100 / 64⌉ = 2 slices by default
    with ropescale.patch(model, "yarn", factor=2.0):
        loss, expected = _step(model, batch)
        mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
        calls = []
        mlp.down_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape[-2]))
        assert enable_tiled_mlp(model, shards) == 2
        got_loss, got = _step(model, batch)
    per_forward = shards or 2
    assert len(calls) >= 2 * per_forward  # slices in forward and again in backward
    assert max(calls[:per_forward]) == -(-100 // per_forward)  # the forward: slices of the 100 positions
    assert got_loss == pytest.approx(loss.item(), rel=1e-6)
    nonzero = {n for n, g in expected.items() if g.abs().max() > 0}  # LoRA's A: zero while B is zero
    assert len(nonzero) >= len(expected) // 2
    assert_same_grads({n: got[n] for n in nonzero}, {n: expected[n] for n in nonzero}, rtol=1e-5)


def test_a_run_with_tiled_mlp_trains_as_one_without(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=3, eval=None, checkpoint_every=10, gradient_checkpointing=True)
    finetune(build_finetune_config(raw), tmp_path / "plain", progress=False)
    finetune(build_finetune_config({**raw, "tiled_mlp": 2, "activation_offload": True}), tmp_path / "tiled",
             progress=False)
    assert losses(tmp_path / "tiled") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


def test_tiled_mlp_options_are_checked(tiny_run):
    from ropescale.runs.config import ConfigError

    with pytest.raises(ConfigError, match="tiled_mlp: true or a number of slices"):
        build_finetune_config(tiny_run(tiled_mlp=0))
    assert build_finetune_config(tiny_run(tiled_mlp=True)).identity() == build_finetune_config(tiny_run()).identity()

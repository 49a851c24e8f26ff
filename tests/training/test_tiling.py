"""tiled_mlp and tiled_norms (DeepSpeed's TiledMLP on each decoder layer's MLP, on each norm over the residual
stream): the same loss and gradients as the plain model — with checkpointing, offload and LoRA —, the modules
really run slice by slice, and one line without DeepSpeed."""

import pytest
from transformers import LlamaForCausalLM

import ropescale
from ropescale.training import build_finetune_config, finetune
from ropescale.training.loop import causal_lm_loss, enable_checkpointing
from ropescale.training.tiling import enable_tiled_mlp, enable_tiled_norms, tiled_mlp_available
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


def _stacked(stack: str):
    """The tiny Llama with the memory options ``stack`` names: plain, checkpointing+offload(+mlp: MLPs tiled
    in 3 slices), or lora (checkpointing, then PEFT's LoRA)."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    if stack.startswith("checkpointing+offload"):
        enable_checkpointing(model, offload=True)
        if stack.endswith("+mlp"):
            enable_tiled_mlp(model, 3)
    if stack == "lora":
        from ropescale.training.lora import LoraSettings, apply_lora

        enable_checkpointing(model)
        model = apply_lora(model, LoraSettings())
    return model


def _assert_same_step(got_loss, got, loss, expected) -> set:
    """The tiled step's loss and gradients equal the plain one's; returns the parameters with a nonzero
    gradient (at least half of them: LoRA's A is zero while B is)."""
    assert got_loss == pytest.approx(loss.item(), rel=1e-6)
    nonzero = {n for n, g in expected.items() if g.abs().max() > 0}
    assert len(nonzero) >= len(expected) // 2
    assert_same_grads({n: got[n] for n in nonzero}, {n: expected[n] for n in nonzero}, rtol=1e-5)
    return nonzero


@pytest.mark.parametrize("shards", [None, 3])
@pytest.mark.parametrize("stack", ["plain", "checkpointing+offload", "lora"])
def test_tiled_mlp_gives_the_plain_mlps_loss_and_gradients(shards, stack):
    """Oracle: the same model and batch without tiling. Each MLP's own forward runs once per slice."""
    model = _stacked(stack)
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
    _assert_same_step(got_loss, got, loss, expected)


def test_a_run_with_tiled_mlp_trains_as_one_without(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=3, eval=None, checkpoint_every=10, gradient_checkpointing=True)
    finetune(build_finetune_config(raw), tmp_path / "plain", progress=False)
    finetune(build_finetune_config({**raw, "tiled_mlp": 2, "tiled_norms": True, "activation_offload": True}),
             tmp_path / "tiled", progress=False)
    assert losses(tmp_path / "tiled") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


@pytest.mark.parametrize("key", ["tiled_mlp", "tiled_norms"])
def test_tiling_options_are_checked(tiny_run, key):
    from ropescale.runs.config import ConfigError

    with pytest.raises(ConfigError, match=f"{key}: true or a number of slices"):
        build_finetune_config(tiny_run(**{key: 0}))
    assert build_finetune_config(tiny_run(**{key: True})).identity() == build_finetune_config(tiny_run()).identity()


@pytest.mark.parametrize("stack", ["plain", "checkpointing+offload+mlp", "lora"])
def test_tiled_norms_give_the_plain_norms_loss_and_gradients(stack):
    """Oracle: the same model and batch without tiling; the norms' own weights train in the plain stack
    (their gradients summed over slices). Each norm runs once per slice; q/k-style norms over another
    width are left alone."""
    model = _stacked(stack)
    batch = {"input_ids": IDS}  # [2, 100]; hidden 64: ⌈100 / 64⌉ = 2 slices by default
    with ropescale.patch(model, "ntk", factor=2.0):
        loss, expected = _step(model, batch)
        norm = next(m for n, m in model.named_modules() if n.endswith("layers.1.post_attention_layernorm"))
        calls, own = [], norm.forward
        norm.forward = lambda x: calls.append(x.shape[-2]) or own(x)  # what tiling wraps: the norm's own forward
        assert enable_tiled_norms(model) == 2 * 2 + 1  # two per decoder layer and the final one
        assert enable_tiled_norms(model) == 5  # a second call does not tile twice
        got_loss, got = _step(model, batch)
    assert calls[:2] == [50, 50]  # the forward: two slices of the 100 positions (then again in backward)
    nonzero = _assert_same_step(got_loss, got, loss, expected)
    if stack == "plain":
        assert any("layernorm" in n for n in nonzero)


def test_tiled_norms_leave_per_head_norms_alone():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = build(Qwen3ForCausalLM, Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16))
    assert enable_tiled_norms(model) == 5
    assert not hasattr(model.model.layers[0].self_attn.q_norm.forward, "ropescale_tiled")


def test_the_tiled_recomputation_in_backward_runs_under_the_forwards_autocast():
    """Backward runs outside the forward's autocast; TiledMLP recomputes the MLP there, so without its state
    the recomputation of a float32 model under bf16 autocast would run in float32 (and a bf16 base with
    float32 inputs would not run at all). Every matmul of the MLP, forward and recomputed, is bf16."""
    import torch

    model = build(LlamaForCausalLM, tiny_llama_config())
    enable_tiled_mlp(model, 2)
    seen = []
    mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
    mlp.down_proj.register_forward_hook(lambda _m, args, out: seen.append((torch.is_grad_enabled(), out.dtype)))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(model, {"input_ids": IDS}, chunk_size=16)
    loss.backward()
    assert {grad for grad, _ in seen} == {False, True}  # the no-grad forward and the recomputation in backward
    assert {dtype for _, dtype in seen} == {torch.bfloat16}

"""The training loss through ``ropescale.lm_head`` (the LM head over chunks of positions,
recomputed in backward): ``loss_chunk_size`` null (chosen from a memory budget), a number, or
0 / false (the model's own ``labels=`` loss, the oracle) give the same losses, gradients and
training runs; the chunk size asked for is the one used."""

import pytest
from transformers import LlamaForCausalLM

import ropescale
from ropescale import lm_head
from ropescale.training import build_finetune_config, finetune
from ropescale.training.loop import causal_lm_loss
from ropescale.training.report import read_log
from tests.conftest import build, tiny_llama_config
from tests.training.test_checkpointing import POSE
from tests.training.test_gradients import IDS, assert_same_grads, grads


@pytest.mark.parametrize("batch", [{"input_ids": IDS}, {"input_ids": IDS[:, :64], "position_ids": POSE}],
                         ids=["plain", "pose"])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_chunked_loss_and_gradients_equal_the_models_own_loss(batch, chunk_size, monkeypatch):
    model = build(LlamaForCausalLM, tiny_llama_config())
    with ropescale.patch(model, "yarn", factor=4.0, logn=True):
        model.train()
        expected = causal_lm_loss(model, batch, chunk_size=0)
        widths = []
        logits = lm_head.OutputHead.logits
        monkeypatch.setattr(lm_head.OutputHead, "logits", lambda self, h: widths.append(h.shape[1]) or logits(self, h))
        got = causal_lm_loss(model, batch, chunk_size=chunk_size)
        monkeypatch.undo()
        n = batch["input_ids"].shape[1] - 1  # positions with a next token
        assert widths[0] == 1  # lm_head checks its head against the model's logits at the last position
        if chunk_size == 7:
            assert widths[1:] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
        else:
            assert widths[1:] == [n]  # a tiny vocabulary: one chunk fits the budget
        assert abs(got - expected) <= 1e-5 * expected
        model.zero_grad()
        got.backward()
        chunked = {k: p.grad.clone() for k, p in model.named_parameters()}
        assert_same_grads(chunked, grads(model, batch), rtol=1e-5)


def losses(output):
    return [r["loss"] for r in read_log(output) if "loss" in r]


def test_training_runs_give_the_same_losses_with_any_chunk_size(tmp_path, tiny_run):
    """(LoRA+ with the chunked loss against the plain one: tests/training/test_lora.py, under bf16.)"""
    raw = tiny_run(strategy="yarn", steps=3, eval=None, checkpoint_every=10)
    curves = {}
    for chunk in (0, None, 5):
        out = finetune(build_finetune_config({**raw, "loss_chunk_size": chunk}), tmp_path / str(chunk), progress=False)
        curves[chunk] = losses(tmp_path / str(chunk))
        assert out["config"]["loss_chunk_size"] == chunk
    for chunk in (None, 5):
        assert curves[chunk] == pytest.approx(curves[0], rel=1e-5), chunk


def test_chunk_size_config_values():
    from eval.config import ConfigError

    base = {"strategy": "yarn", "length": 64, "steps": 1}
    assert build_finetune_config(base).loss_chunk_size is None
    assert build_finetune_config({**base, "loss_chunk_size": False}).loss_chunk_size == 0
    with pytest.raises(ConfigError, match="loss_chunk_size: true is not a chunk size"):
        build_finetune_config({**base, "loss_chunk_size": True})
    with pytest.raises(ConfigError, match="loss_chunk_size: Input should be greater than or equal to 0"):
        build_finetune_config({**base, "loss_chunk_size": -3})


def test_a_run_checks_the_head_once_not_every_step(tmp_path, tiny_run, monkeypatch):
    """The check against the model's own logits ends in a host-side verdict (a device sync): a
    run makes it on its first batch only."""
    calls = []
    check = lm_head.OutputHead.check
    monkeypatch.setattr(lm_head.OutputHead, "check", lambda self, h, own: calls.append(1) or check(self, h, own))
    finetune(build_finetune_config(tiny_run(steps=3, grad_accum=2, eval=None)), tmp_path, progress=False)
    assert calls == [1]


def test_a_head_that_fails_its_check_trains_on_the_models_own_loss(tmp_path, tiny_run, monkeypatch):
    raw = tiny_run(steps=2, eval=None)
    finetune(build_finetune_config({**raw, "loss_chunk_size": 0}), tmp_path / "plain", progress=False)
    monkeypatch.setattr(lm_head.OutputHead, "check", lambda self, h, own: "forced mismatch")
    with pytest.warns(UserWarning, match="forced mismatch"):
        finetune(build_finetune_config(raw), tmp_path / "fallback", progress=False)
    assert losses(tmp_path / "fallback") == losses(tmp_path / "plain")

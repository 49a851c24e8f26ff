"""Sequence parallelism (DeepSpeed Ulysses) for every rule: two gloo processes on the CPU give
the loss and gradients of one process, the run's loss curve equals one process's, and what
Ulysses cannot run exactly is refused in one line.

Measured here: DeepSpeed's CPU accelerator runs Ulysses' all-to-all (``all_to_all_single``) and
all-gather over gloo; ``sp_worker.py`` holds the two-process comparison."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as T

from ropescale.runs.config import ConfigError
from ropescale.training import build_finetune_config, finetune, resolve
from ropescale.training.report import read_log
from ropescale.training.sequence_parallel import check_sequence_parallel, deepspeed_available, with_positions
from tests.launch import PROCESSES
from tests.training.test_sharding import free_port

ROOT = Path(__file__).resolve().parents[2]
needs_deepspeed = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed (ropescale[scale])")
TOL = 1e-6


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@needs_deepspeed
def test_two_process_sequence_parallel_step_equals_one_process_for_every_kind_of_rule(tmp_path):
    out = tmp_path / "sp.json"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), str(ROOT / "tests" / "training" / "sp_worker.py"),
                          str(out)], capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(out.read_text())
    names = {"yarn+logn, PoSE positions": "ropescale_logn_sdpa", "rerope": "ropescale_truncation",
             "dca": "ropescale_truncation", "self_extend, NoPE layers (SmolLM3)": "ropescale_truncation_sdpa",
             "linear, NoPE layers (SmolLM3)": "sdpa", "rerope, sliding-window hybrid (Gemma 3)": "ropescale_truncation"}
    assert set(results) == set(names)
    for case, r in results.items():
        assert r["attention"] == names[case], case  # the function Ulysses wrapped
        for oracle, sp in r["loss"]:  # each of the two batches: one process vs the group's summed shares
            assert abs(sp - oracle) <= TOL * abs(oracle), (case, oracle, sp)
        assert r["grad"] <= TOL, (case, r["grad"])  # largest ‖Σ_ranks g − g_oracle‖ / ‖g_oracle‖ over parameters
        # the control: the same shards attending within themselves are far off, so the check can fail
        assert r["grad_without_exchange"] > 1e-2, (case, r["grad_without_exchange"])


@needs_deepspeed
@PROCESSES
# data parallel (DDP) or sharded (FSDP2) gradients; "+memory": with every memory option of the stack (checkpointing,
# offload, tiled MLP and norms) on top of sequence parallelism and FSDP — the one-process run has none of them
@pytest.mark.parametrize("sharding", [None, "fsdp", "fsdp+memory"])
def test_finetune_with_sequence_parallelism_follows_the_one_process_loss_curve(tmp_path, tiny_run, sharding):
    raw = tiny_run(strategy="rerope", steps=4, batch_size=2, checkpoint_every=2)
    finetune(build_finetune_config(raw), tmp_path / "one", progress=False)
    cfg = tmp_path / "sp.yaml"
    memory = {"gradient_checkpointing": True, "activation_offload": True, "tiled_mlp": 2, "tiled_norms": 2}
    # 2 processes × 1 window: the same global batch
    cfg.write_text(json.dumps({**raw, "batch_size": 1, **({"sharding": "fsdp"} if sharding else {}),
                               **(memory if sharding == "fsdp+memory" else {})}))
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(ROOT / "cli.py"), "finetune", str(cfg), "-q",
                          "--set", "parallelism.sequence=2", "-o", str(tmp_path / "sp")],
                         capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "sp" / "model" / "finetune.json").read_text())
    assert summary["parallelism"] == {"data": 1, "sequence": 2, "sharded": sharding is not None}
    if sharding == "fsdp+memory":
        assert {k: summary["config"][k] for k in memory} == memory
    one, sp = read_log(tmp_path / "one"), read_log(tmp_path / "sp")
    assert [r["step"] for r in one] == [r["step"] for r in sp]
    for a, b in zip(one, sp):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
            assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
        else:  # held-out perplexity: whole windows per process (Ulysses is off in eval mode)
            for k in a["ppl"]:
                assert abs(a["ppl"][k] - b["ppl"][k]) <= 1e-5 * a["ppl"][k]


def test_with_positions_gives_the_adapter_labels_and_positions():
    import torch

    ids = torch.arange(12).view(2, 6)
    out = with_positions({"input_ids": ids})
    assert torch.equal(out["labels"], ids) and torch.equal(out["position_ids"], torch.arange(6).expand(2, 6))
    pose = torch.tensor([[0, 1, 7, 8, 9, 10]] * 2)
    assert torch.equal(with_positions({"input_ids": ids, "position_ids": pose})["position_ids"], pose)


def _llama(**kw):
    return T.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, **kw)


@needs_deepspeed
@pytest.mark.parametrize("size,config,kind,window,pose,attn,fragment", [
    (3, _llama(), "frequency", 48, False, None, "3 does not divide the model's 4 attention heads"),
    (4, T.LlamaConfig(num_attention_heads=12, num_key_value_heads=3, hidden_size=96), "frequency", 64, False, None,
     "4 and the model's 3 key-value heads do not divide one another"),
    (4, _llama(), "frequency", 66, False, None, "4 does not divide the 66-token training window"),
    (2, T.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
     "frequency", 64, False, None, "sliding_attention layers, whose window lives in the attention mask"),
    (2, T.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=16), "frequency", 64, False,
     None, "sliding_attention layers"),
    (2, _llama(), "frequency", 64, False, "eager", "call 'eager', which attends without a causal mask"),
    (2, _llama(), "frequency", 64, False, "ropescale_logn_flex_attention", "call 'ropescale_logn_flex_attention'"),
    (2, _llama(), "attention", 64, False, "ropescale_truncation_eager", "call 'ropescale_truncation_eager'"),
    (2, _llama(), "frequency", 64, True, "flash_attention_2", "PoSE with flash_attention_2"),
])
def test_what_ulysses_cannot_run_exactly_is_refused_in_one_line(size, config, kind, window, pose, attn, fragment):
    with pytest.raises(ConfigError, match="parallelism.sequence: ") as e:
        check_sequence_parallel(size, config=config, kind=kind, window=window, pose=pose, attn_implementation=attn)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@needs_deepspeed
@pytest.mark.parametrize("kind,attn", [
    ("attention", "ropescale_truncation"), ("attention", "ropescale_truncation_sdpa"),
    ("frequency", "ropescale_logn_sdpa"), ("frequency", "flash_attention_2")])
def test_what_ulysses_runs_exactly_passes(kind, attn):
    gemma = T.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    config = gemma if kind == "attention" else _llama()  # relative rules apply sliding windows in their kernel
    check_sequence_parallel(2, config=config, kind=kind, window=64, pose=False, attn_implementation=attn)
    check_sequence_parallel(4, config=_llama(), kind=kind, window=64, pose=False, attn_implementation=attn)


def test_parallelism_key_errors_are_one_line(tiny_run):
    with pytest.raises(ConfigError, match=r"parallelism.sequence: Input should be greater than or equal to 1"):
        build_finetune_config(tiny_run(parallelism={"sequence": 0}))
    with pytest.raises(ConfigError, match=r"parallelism.sequnce: unknown key; allowed: sequence \(did you mean "
                                          r"'sequence'\?\)"):
        build_finetune_config(tiny_run(parallelism={"sequnce": 2}))
    with pytest.raises(ConfigError, match=r"parallelism.sequence: expected an integer, got true"):
        build_finetune_config(tiny_run(parallelism={"sequence": True}))


@needs_deepspeed
def test_model_checks_run_when_the_config_is_resolved(tiny_run):
    """The tiny model has 2 heads: 4 processes per group are refused before anything loads or is written."""
    with pytest.raises(ConfigError, match="parallelism.sequence: 4 does not divide the model's 2 attention heads"):
        resolve(build_finetune_config(tiny_run(parallelism={"sequence": 4})))
    run = resolve(build_finetune_config(tiny_run(parallelism={"sequence": 2})))
    assert run.window == 64


@needs_deepspeed
@PROCESSES
def test_one_process_cannot_hold_a_group_of_two(tmp_path, tiny_run):
    with pytest.raises(ConfigError, match=r"parallelism.sequence: 2 does not divide the 1 launched process\(es\); "
                                          r"launch a multiple of 2"):
        finetune(build_finetune_config(tiny_run(parallelism={"sequence": 2})), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_sequence_parallelism_is_not_part_of_the_run_identity(tiny_run):
    """The same global batches and the same gradients: a run may resume with another group size."""
    a = build_finetune_config(tiny_run()).identity()
    if deepspeed_available():
        assert build_finetune_config(tiny_run(parallelism={"sequence": 2})).identity() == a
    assert "parallelism" not in a

"""FSDP2 on CPU processes: ``sharding: fsdp`` shards with torch's ``fully_shard`` where accelerate
will not (``test_sharding.py`` shows accelerate dropping its plugin there). Two gloo processes
train what one unsharded process trains (loss curve and saved weights within float noise), a
run stopped at a checkpoint resumes exactly (bit for bit), the chunked loss runs inside the
sharded forward, and the checkpoint holds every process's shards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eval.config import ConfigError
from ropescale.training import build_finetune_config, finetune
from ropescale.training.report import read_log
from tests.launch import PROCESSES
from tests.training.test_sharding import free_port

ROOT = Path(__file__).resolve().parents[2]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(next((folder / "model").glob("*.safetensors")))


@PROCESSES
def test_two_sharded_processes_train_what_one_process_trains_and_resume_exactly(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=4, batch_size=4, checkpoint_every=2)
    finetune(build_finetune_config(raw), tmp_path / "one", progress=False)
    cfg = tmp_path / "ft.json"
    cfg.write_text(json.dumps({**raw, "batch_size": 2, "sharding": "fsdp"}))  # 2 × 2: the same global batch
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # the three runs in one launched process (sharded, stopped at 2, resumed): they share its process group
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(ROOT / "tests" / "training" / "fsdp_worker.py"), str(cfg),
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    worker = json.loads((tmp_path / "worker.json").read_text())
    # the stopped run's checkpoint: accelerate's state plus both processes' shards of model and optimiser
    assert worker["stopped"]["stopped_at"] == 2
    shards = [f for f in worker["checkpoint_files"] if f.startswith("sharded/")]
    assert "sharded/.metadata" in shards and len([f for f in shards if f.endswith(".distcp")]) == 2
    one, sharded, resumed = (read_log(tmp_path / d) for d in ("one", "sharded", "resumed"))
    assert [r["step"] for r in one] == [r["step"] for r in sharded] == [r["step"] for r in resumed]
    for a, b in zip(one, sharded):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        else:
            for k in a["ppl"]:
                assert abs(a["ppl"][k] - b["ppl"][k]) <= 1e-5 * a["ppl"][k]
    strip = lambda log: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log]
    assert strip(resumed) == strip(sharded)  # bit for bit
    w1, ws, wr = (_weights(tmp_path / d) for d in ("one", "sharded", "resumed"))
    assert set(w1) == set(ws) == set(wr)
    for k in w1:
        assert torch.allclose(ws[k], w1[k], rtol=1e-4, atol=1e-6), k  # float noise over 4 AdamW steps
        assert torch.equal(wr[k], ws[k]), k
    summary = json.loads((tmp_path / "sharded" / "model" / "finetune.json").read_text())
    assert summary["parallelism"]["sharded"] is True and summary["processes"] == 2


def test_sharding_on_one_cpu_process_is_refused_before_anything_is_written(tmp_path, tiny_run):
    with pytest.raises(ConfigError, match="sharding: one process holds the whole model either way"):
        finetune(build_finetune_config(tiny_run(sharding="fsdp")), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

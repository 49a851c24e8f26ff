"""Two CPU processes (gloo) with half the per-process batch train exactly what one process
trains: the same global batches, the same loss curve (float tolerance), one writer.

``accelerate launch --cpu --num_processes 2`` starts a *single* process on a machine without
MPI (accelerate 1.15's simple launcher); ``--multi_gpu`` starts two through torchrun, and the
run makes them one gloo group (``Accelerator(cpu=True)`` when there is no GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ropescale.training import build_finetune_config, finetune
from ropescale.training.report import read_log
from tests.launch import launch_two

ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_give_one_process_loss_curve_and_only_the_main_process_writes(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=4, batch_size=4, checkpoint_every=2)
    finetune(build_finetune_config(raw), tmp_path / "one", progress=False)
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(json.dumps({**raw, "batch_size": 2}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          str(ROOT / "cli.py"), "finetune", str(cfg), "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("fine-tuned yarn for 4 steps") == 1  # the main process reports
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 2, 3, 4, 4]  # each line once
    summary = json.loads((tmp_path / "two" / "model" / "finetune.json").read_text())
    assert summary["processes"] == 2 and summary["tokens"] == 4 * 4 * 64  # the same global batch
    for a, b in zip(one, two):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
            assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
        else:
            for k in a["ppl"]:
                assert abs(a["ppl"][k] - b["ppl"][k]) <= 1e-5 * a["ppl"][k]
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name != ".ropescale.lock")
    assert files(tmp_path / "two") == files(tmp_path / "one")


ONE_RUN = """
import json, sys
import torch.distributed as dist
from ropescale.training import build_finetune_config, finetune

raw = json.loads(sys.argv[1])
for out in sys.argv[2:]:
    summary = finetune(build_finetune_config(raw), out, progress=False)
    print(json.dumps({"processes": summary["processes"], "open": dist.is_initialized()}), flush=True)
"""


def test_a_launched_run_closes_its_process_group(tmp_path, tiny_run):
    """The gloo group was left to interpreter shutdown, which can abort at exit ("terminate called
    without an active exception"); closed when the run ends. (A second run in the same launched
    process sets up a group of its own, but gloo's connect can hang there — torch reuses the closed
    group's name while torchrun's store keeps its peers' addresses — so one run per launch here.)"""
    raw = tiny_run(strategy="linear", steps=1, batch_size=1, eval=None)
    (tmp_path / "run.py").write_text(ONE_RUN)
    res, lines = launch_two(tmp_path / "run.py", json.dumps(raw), str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert lines == [{"processes": 2, "open": False}] * 2, res.stdout  # two processes
    assert "terminate called" not in res.stderr

"""Data-parallel evaluation: two CPU processes (gloo) under `accelerate launch` write exactly the
records one process writes, and only the main process writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.config import build_config
from eval.sweep import RESULTS, read_results, run_sweep

ROOT = Path(__file__).resolve().parents[2]


def launch(config: Path, output: Path, n: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # `--cpu --num_processes 2` starts one process without MPI (accelerate's simple launcher);
    # `--multi_gpu` starts two through torchrun, which the harness makes one gloo group on CPU
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(ROOT / "cli.py"), "eval", str(config), "-q", "-o", str(output)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


METRICS = {"perplexity": ("ppl", "nll", "tokens", "windows", "nll_by_position"),
           "passkey": ("accuracy", "accuracy_ci", "candidate_accuracy", "candidate_accuracy_ci", "by_depth")}


@pytest.mark.parametrize("task", ["perplexity", "passkey"])
def test_two_processes_write_what_one_process_writes(tmp_path, tiny_model_dir, text_file, task):
    raw = {"task": task, "model": str(tiny_model_dir), "lengths": [32, 64], "strategies": ["vanilla", "yarn", "rerope"],
           "device": "cpu", "threads": 1}
    raw |= {"data": str(text_file), "max_windows": 7} if task == "perplexity" else {
        "lengths": [56, 64], "passkey": {"trials": 3, "depths": [0, 0.5, 1], "digits": 3, "candidates": 4}}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(raw))
    single = run_sweep(build_config(raw), tmp_path / "one", progress=False)
    res = launch(cfg_path, tmp_path / "two")
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["processes"] == 2
    double = read_results(tmp_path / "two" / RESULTS)
    assert len((tmp_path / "two" / RESULTS).read_text().splitlines()) == 6  # one writer, each cell once
    for a, b in zip(single, double):
        assert (a["strategy"], a["length"], a["cell"]) == (b["strategy"], b["length"], b["cell"])
        for key in METRICS[task]:
            assert a[key] == b[key], (task, a["strategy"], a["length"], key)


def test_device_map_auto_loads_through_accelerate_and_scores_the_same(tmp_path, tiny_model_dir, text_file):
    raw = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["vanilla", "yarn"],
           "max_windows": 4, "device": "cpu"}
    plain = run_sweep(build_config(raw), tmp_path / "a", progress=False)
    mapped = run_sweep(build_config({**raw, "device_map": "auto"}), tmp_path / "b", progress=False)
    assert [r["ppl"] for r in mapped] == [r["ppl"] for r in plain]


def test_device_map_reaches_from_pretrained(tiny_model_dir, monkeypatch):
    import transformers

    from ropescale.models import load_model

    seen = {}
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, **kw):
        seen.update(kw)
        return original(path, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_model(str(tiny_model_dir), device_map="balanced")
    assert seen["device_map"] == "balanced"  # accelerate's big-model inference places the layers


ONE_RUN = """
import json, sys
import torch.distributed as dist
from eval.config import build_config
from eval.sweep import run_sweep

raw = json.loads(sys.argv[1])
for out in sys.argv[2:]:
    records = run_sweep(build_config(raw), out, progress=False)
    print(json.dumps({"cells": len(records), "open": dist.is_initialized()}), flush=True)
"""


def test_two_sweeps_in_a_launched_process_share_its_group_which_closes_at_exit(tmp_path, tiny_model_dir, text_file):
    """Each sweep closed its gloo group, so the next sweep in the process (a fine-tuning run's second
    after-training evaluation) set a second one up, which hangs or fails to connect; now the sweeps work
    on the process's one group, closed when the interpreter exits (left open there, gloo can abort:
    "terminate called without an active exception")."""
    from tests.launch import launch_two

    raw = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["vanilla"],
           "max_windows": 2, "device": "cpu", "threads": 1}
    (tmp_path / "run.py").write_text(ONE_RUN)
    res, lines = launch_two(tmp_path / "run.py", json.dumps(raw), str(tmp_path / "a"), str(tmp_path / "b"),
                            timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert lines == [{"cells": 1, "open": True}] * 4, res.stdout
    assert "terminate called" not in res.stderr
    for run in "ab":
        assert json.loads((tmp_path / run / "manifest.json").read_text())["processes"] == 2

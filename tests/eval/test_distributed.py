"""Data-parallel evaluation: two CPU processes (gloo) under `accelerate launch` write exactly the
records one process writes, and only the main process writes."""

import json
from pathlib import Path

import pytest

from eval.config import build_config
from eval.sweep import RESULTS, read_results, run_sweep
from tests.launch import PROCESSES

METRICS = {"perplexity": ("ppl", "nll", "tokens", "windows", "nll_by_position"),
           "passkey": ("accuracy", "accuracy_ci", "candidate_accuracy", "candidate_accuracy_ci", "by_depth")}


def _raw(task: str, model: Path, text: Path) -> dict:
    raw = {"task": task, "model": str(model), "lengths": [32, 64], "strategies": ["vanilla", "yarn", "rerope"],
           "device": "cpu", "threads": 1}
    return raw | ({"data": str(text), "max_windows": 7} if task == "perplexity" else {
        "lengths": [56, 64], "passkey": {"trials": 3, "depths": [0, 0.5, 1], "digits": 3, "candidates": 4}})


# `cli.py eval <config> -q -o <out>` for each (config, out) in one launched process — the command users
# launch, twice in a row (a fine-tuning run's after-training evaluations do the same) — and, after each,
# whether the process group is still open
TWO_EVALS = """
import json, sys
import torch.distributed as dist
from cli import main

for config, out in zip(sys.argv[1::2], sys.argv[2::2]):
    main(["eval", config, "-q", "-o", out], standalone_mode=False)
    print(json.dumps({"out": out, "open": dist.is_initialized()}), flush=True)
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model_dir, text_file):
    """One launch of two processes evaluating the perplexity config, then the passkey one (a launch
    costs two interpreters and a process group: one for the module's tests)."""
    from tests.launch import launch_two

    tmp = tmp_path_factory.mktemp("launched")
    args = []
    for task in METRICS:
        (tmp / f"{task}.yaml").write_text(json.dumps(_raw(task, tiny_model_dir, text_file)))
        args += [str(tmp / f"{task}.yaml"), str(tmp / task)]
    (tmp / "run.py").write_text(TWO_EVALS)
    res, lines = launch_two(tmp / "run.py", *args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp, res, lines


@PROCESSES
@pytest.mark.parametrize("task", ["perplexity", "passkey"])
def test_two_processes_write_what_one_process_writes(tmp_path, tiny_model_dir, text_file, task, launched):
    single = run_sweep(build_config(_raw(task, tiny_model_dir, text_file)), tmp_path / "one", progress=False)
    two = launched[0] / task
    assert json.loads((two / "manifest.json").read_text())["processes"] == 2
    double = read_results(two / RESULTS)
    assert len((two / RESULTS).read_text().splitlines()) == 6  # one writer, each cell once
    for a, b in zip(single, double, strict=True):
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


@PROCESSES
def test_two_sweeps_in_a_launched_process_share_its_group_which_closes_at_exit(launched):
    """Each sweep closed its gloo group, so the next sweep in the process (a fine-tuning run's second
    after-training evaluation) set a second one up, which hangs or fails to connect; now the sweeps work
    on the process's one group, closed when the interpreter exits (left open there, gloo can abort:
    "terminate called without an active exception")."""
    tmp, res, lines = launched
    assert sorted(lines, key=lambda x: x["out"]) == sorted(
        [{"out": str(tmp / task), "open": True} for task in METRICS for _ in range(2)], key=lambda x: x["out"])
    assert "terminate called" not in res.stderr
    for task in METRICS:
        assert json.loads((tmp / task / "manifest.json").read_text())["processes"] == 2

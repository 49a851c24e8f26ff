"""``dtype: auto`` (the default): bfloat16 on a GPU that supports it, float32 on the CPU, recorded
resolved — so a default run on the CPU is the same experiment as an explicit float32 one."""

import json

import pytest
import torch
from click.testing import CliRunner

from eval.config import build_config, resolved_dtype
from eval.search.config import build_search_config
from eval.sweep import run_sweep


@pytest.mark.parametrize("device,bf16,expected", [
    ("cpu", True, "float32"), ("cuda", True, "bfloat16"), ("cuda:1", True, "bfloat16"),
    ("cuda", False, "float32"),  # a GPU without bfloat16 (before Ampere): full precision
    ("mps", True, "float32"),
])
def test_auto_is_bfloat16_on_a_gpu_that_supports_it(monkeypatch, device, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolved_dtype("auto", torch.device(device)) == expected
    assert resolved_dtype("float16", device) == "float16"  # a name is kept as given
    assert resolved_dtype("float32", "cuda") == "float32"


def test_auto_is_the_default_of_eval_and_search_configs(tiny_model_dir, text_file):
    assert build_config({"lengths": [32], "strategies": ["vanilla"]}).dtype == "auto"
    assert build_search_config({"strategy": "yarn", "lengths": [64],
                                "search": {"beta_fast": [2, 128]}}).dtype == "auto"


def test_a_default_run_records_the_resolved_dtype_and_resumes_an_explicit_float32_folder(
        tmp_path, tiny_model_dir, text_file):
    raw = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["vanilla"],
           "max_windows": 2, "device": "cpu"}
    first = run_sweep(build_config({**raw, "dtype": "float32"}), tmp_path, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    again = run_sweep(build_config(raw), tmp_path, progress=False)  # auto: float32 here, so the same cells
    assert again == first and again[0]["dtype"] == "float32"
    assert json.loads((tmp_path / "manifest.json").read_text())["identity"] == manifest["identity"]
    fresh = run_sweep(build_config(raw), tmp_path / "auto", progress=False)
    assert fresh[0]["dtype"] == "float32"
    assert json.loads((tmp_path / "auto" / "manifest.json").read_text())["identity"]["dtype"] == "float32"


def test_cli_takes_dtype_auto(tmp_path, tiny_model_dir, text_file):
    from cli import main

    res = CliRunner().invoke(main, ["sweep", "--model", str(tiny_model_dir), "--data", str(text_file),
                                    "--lengths", "32", "--strategy", "vanilla", "--device", "cpu", "--dtype", "auto",
                                    "--set", "max_windows=2", "-q", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])["dtype"] == "float32"

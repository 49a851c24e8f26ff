"""``engine: mlx``: a cell scored by mlx-lm serving the patch's MLX export (eval/engines/mlx/scoring.py).
Without mlx-lm: what it refuses, in one line, before anything is written. With it (marked ``engines``):
perplexity through mlx-lm equals the transformers engine's on the bundled model."""

import pytest

from eval import engines
from eval.config import build_config
from eval.engines.scoring import scoring_engine
from eval.sweep import run_sweep
from ropescale.runs.config import ConfigError

HAS_MLX = engines.engine_python("mlx") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason=engines.engine_status("mlx"))


def test_mlx_answers_log_probabilities_only(tiny_model_dir):
    """Perplexity asks for log-probabilities only; passkey also for generations, which the mlx driver
    does not answer."""
    cfg = build_config({"model": str(tiny_model_dir), "task": "passkey", "lengths": [64], "strategies": ["yarn"],
                        "engine": "mlx"})
    with pytest.raises(ConfigError, match="engine: mlx does not answer generate, which passkey asks for — use "
                                          "engine: transformers or vllm$"):
        scoring_engine("mlx").check(cfg)


def test_mlx_absent_is_one_line_before_anything_is_written(tmp_path, tiny_model_dir, text_file, monkeypatch):
    monkeypatch.setenv(engines.environment("mlx").variable, str(tmp_path / "no-such-python"))
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32],
                        "strategies": ["vanilla"], "engine": "mlx"})
    with pytest.raises(ConfigError, match=r"^config: engine: mlx: .*bench/engines/install.sh") as e:
        run_sweep(cfg, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@needs_mlx
@pytest.mark.engines
def test_sweep_through_mlx_equals_the_transformers_engine(tmp_path):
    raw = {"model": "reference", "data": "kjv-heldout", "lengths": [128, 256], "max_windows": 2, "device": "cpu",
           "strategies": ["vanilla", "yarn", "dynamic_ntk"]}
    ours = run_sweep(build_config(raw), tmp_path / "hf", progress=False)
    theirs = run_sweep(build_config({**raw, "engine": "mlx"}), tmp_path / "mlx", progress=False)
    assert [(r["strategy"], r["length"]) for r in ours] == [(r["strategy"], r["length"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["engine"] == "transformers" and b["engine"] == "mlx" and b["engine_version"].startswith("mlx-lm")
        assert b["tokens"] == a["tokens"]
        assert abs(b["nll"] - a["nll"]) <= 1e-4, (a["strategy"], a["length"], a["nll"], b["nll"])

"""vllm_rope checked against vLLM's own rotary classes (``get_rope``), run in vLLM's interpreter as a
subprocess (tests/serving/vllm_probe.py), and mlx_rope against mlx-lm's own rotary modules
(eval/engines/mlx/scripts/mlx_driver.py) — the engines are never dependencies of ropescale. Skipped unless
ROPESCALE_VLLM_PYTHON / ROPESCALE_MLX_PYTHON names a Python with the engine installed (e.g. the venvs
of bench/engines/install.sh)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ropescale.serving import compare, export_vllm, ropescale_rope, vllm_rope
from ropescale.serving.engines.vllm import vllm_layer_ropes
from ropescale.serving.rope import ropescale_layer_ropes
from tests.serving.conftest import FREQUENCY, LONG, SHORT, THETA, T, gemma3_patched, patched

VLLM_PYTHON = os.environ.get("ROPESCALE_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="set ROPESCALE_VLLM_PYTHON to a Python with vLLM")


def _probe(cases):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    res = subprocess.run([VLLM_PYTHON, str(Path(__file__).with_name("vllm_probe.py"))], input=json.dumps(cases),
                         capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.split("PROBE", 1)[1])


def _config(rp, mpe):
    return {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": mpe,
            "rope_parameters": {"rope_theta": THETA, **rp}}


@needs_vllm
def test_real_vllm_serves_every_export_as_ropescale_and_vllm_rope_say():
    cases, expected = [], []
    for name, params in (FREQUENCY[case] for case in sorted(FREQUENCY)):
        for length in (48, 256):
            model = patched(name, **params)
            export = export_vllm(model, length)
            cases.append({"config": export.config, "max_model_len": length})
            expected.append((ropescale_rope(model, length), vllm_rope(export.config, length), length))
    for real, (ours, mine, length) in zip(_probe(json.loads(json.dumps(cases, default=str))), expected):
        real_freq = torch.tensor(real["inv_freq"], dtype=torch.float64)
        for side in (ours, mine):  # cache read-back: float32 cos/sin, ~1e-7 relative
            assert torch.allclose(real_freq, side.inv_freq, rtol=1e-5, atol=0)
            assert abs(real["magnitude"] - side.magnitude) <= 1e-6
        assert real["cache"] >= length
        assert compare(ours, mine, length).same


@needs_vllm
def test_real_vllm_has_the_quirks_vllm_rope_reproduces():
    longrope = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                "original_max_position_embeddings": T, "factor": 8.0, "attention_factor": 2.0}
    cases = [
        (_config({"rope_type": "ntk", "factor": 4.0}, 256), 256),
        (_config({"rope_type": "dynamic", "factor": 2.0}, T), T),
        (_config({"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": T}, 256), 256),
        (_config(longrope, 256), 256),
        (_config(longrope, 256), 48),
        (_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": T, "beta_fast": 16.0,
                  "beta_slow": 2.0, "truncate": False}, 256), 256),
    ]
    for real, (config, length) in zip(_probe([{"config": c, "max_model_len": n} for c, n in cases]), cases):
        mine = vllm_rope(config, length)
        assert torch.allclose(torch.tensor(real["inv_freq"], dtype=torch.float64), mine.inv_freq, rtol=1e-5, atol=0)
        assert abs(real["magnitude"] - mine.magnitude) <= 1e-6


@needs_vllm
def test_real_vllm_rotates_each_gemma3_layer_type_as_ropescale_and_vllm_layer_ropes_say():
    """Each layer type's parameters of a Gemma 3 export through vLLM's get_rope, as its gemma3.py passes
    them (``rope_parameters[layer_type]``, the config's one max_position_embeddings)."""
    cases, expected = [], []
    for name, params, layer_types in (("yarn", {"factor": 4.0}, None), ("linear", {"factor": 4.0}, None),
                                      ("ntk", {"factor": 4.0}, None),
                                      ("yarn", {"factor": 4.0}, ["sliding_attention", "full_attention"])):
        model = gemma3_patched(name, layer_types=layer_types, **params)
        export = export_vllm(model, 256)
        ours, mine = ropescale_layer_ropes(model, 256), vllm_layer_ropes(export.config, 256)
        for lt, rp in export.config["rope_parameters"].items():
            cases.append({"config": {**export.config, "rope_parameters": rp}, "max_model_len": 256})
            expected.append((ours[lt], mine[lt]))
    for real, (ours, mine) in zip(_probe(json.loads(json.dumps(cases, default=str))), expected):
        real_freq = torch.tensor(real["inv_freq"], dtype=torch.float64)
        for side in (ours, mine):
            assert torch.allclose(real_freq, side.inv_freq, rtol=1e-5, atol=0)
            assert abs(real["magnitude"] - side.magnitude) <= 1e-6
        assert real["cache"] >= 256


MLX_PYTHON = os.environ.get("ROPESCALE_MLX_PYTHON")


@pytest.mark.skipif(not MLX_PYTHON, reason="set ROPESCALE_MLX_PYTHON to a Python with mlx-lm")
def test_real_mlx_rotates_every_export_as_ropescale_and_mlx_rope_say(tmp_path):
    """Each export's config.json through mlx-lm's own model class and rotary module (eval/engines/
    mlx_driver.py, in MLX's interpreter): every angle at positions 0 … L−1 and the magnitude."""
    from ropescale.serving.engines.mlx import export_mlx, mlx_layer_ropes

    driver = Path(__file__).parents[2] / "eval" / "engines" / "mlx" / "scripts" / "mlx_driver.py"
    cases, expected = [], []
    models = [(patched(n, **p), f"{c}") for c, (n, p) in sorted(FREQUENCY.items())]
    models += [(gemma3_patched("yarn", factor=4.0), "gemma3-yarn"), (gemma3_patched("linear", factor=4.0), "g3-linear")]
    for model, name in models:
        for length in (48, 256):
            export = export_mlx(model, length)
            folder = tmp_path / f"{name}-{length}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(export.config, default=str))
            ours = (ropescale_layer_ropes(model, length) if name.startswith("g")
                    else {None: ropescale_rope(model, length)})
            mine = mlx_layer_ropes(export.config, length)
            for lt in mine:
                cases.append({"model": str(folder), "length": length, "layer_type": lt})
                expected.append((ours[lt], mine[lt], name))
    (tmp_path / "req.json").write_text(json.dumps({"mode": "rope", "cases": cases}))
    res = subprocess.run([MLX_PYTHON, str(driver), str(tmp_path / "req.json"), str(tmp_path / "res.json")],
                         capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads((tmp_path / "res.json").read_text())["cases"]
    for real, (ours, mine, name) in zip(got, expected, strict=True):
        cos, sin = torch.tensor(real["cos"], dtype=torch.float64), torch.tensor(real["sin"], dtype=torch.float64)
        freq, magnitude = torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean())
        for side in (ours, mine):
            assert torch.allclose(freq, side.inv_freq, rtol=1e-5, atol=1e-7), name
            assert abs(magnitude - side.magnitude) <= (2e-6 if name == "longrope_attention" else 1e-6), name

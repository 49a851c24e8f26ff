"""bench/gpu_check.py's plumbing on the CPU: its blocked float64 oracle against the naive path in
one piece (outputs and gradients), a case's errors, timeouts and skips, the depth extrapolation."""

import json
import time

import pytest
import torch

from bench import gpu_check
from ropescale.attention.relative import naive_attention
from ropescale.strategies.relative import dca, rerope

INV = 1.0 / (10000 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12))  # 12 of 16 channels rotate


@pytest.mark.parametrize("rule", [rerope(8), dca(14, 3, 2.0, False, 16)], ids=["rerope", "dca"])
@pytest.mark.parametrize("s_q,pad", [(45, 0), (13, 0), (45, 6)], ids=["forward", "kv_cache_split", "left_padding"])
def test_blocked_oracle_equals_the_naive_path_in_one_piece(rule, s_q, pad):
    """Query blocks against the keys up to their last row's slot, gradients summed over blocks:
    the same outputs and q, k, v gradients as one naive call over every row."""
    b, n_h, n_kv, s_k = 2, 4, 2, 45
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, n_h, s_q, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, n_kv, s_k, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, n_h, s_q, 16, generator=g, dtype=torch.float64)
    k_pos = torch.arange(s_k, dtype=torch.float64)[None].repeat(b, 1)
    keep = None
    if pad:
        k_pos[-1] -= pad
        keep = torch.ones(b, 1, 1, s_k, dtype=torch.bool)
        keep[-1, ..., :pad] = False
    q_pos = k_pos[:, s_k - s_q:]
    got = gpu_check.oracle(q, k, v, q_pos, k_pos, rule, INV, 1.1, grad, keep=keep, block=7, scale=0.3)
    ref = naive_attention(q, k, v, q_pos, k_pos, rule, INV, 1.1, keep=keep, scale=0.3)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    for a, w in zip(got, want, strict=True):  # naive_attention computes in float32
        torch.testing.assert_close(a, w.detach().float(), rtol=0, atol=2e-6 * float(w.abs().max()))


def test_a_case_records_errors_timeouts_and_skips_and_keeps_the_files(tmp_path):
    check = gpu_check.Check(tmp_path, budget_s=60, device="cpu")
    check.data["config"] = {"shape": "small"}

    def boom():
        raise ValueError("boom\nsecond line")

    check.case("s", "ok", lambda: {"x": 1}, cap_s=10, rule="a")
    check.case("s", "boom", boom, cap_s=10, rule="b")
    check.case("s", "slow", lambda: time.sleep(5), cap_s=0.3, rule="c")
    check.case("s", "late", lambda: {"x": 2}, cap_s=10, need_s=1e6, rule="d")
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["s"]
    assert [r["rule"] for r in rows] == ["a", "b", "c", "d"]
    assert rows[0]["x"] == 1 and "error" not in rows[0]
    assert rows[1]["error"] == "ValueError: boom"
    assert rows[2]["error"].startswith("timeout") and rows[2]["case_s"] < 2
    assert rows[3]["error"].startswith("skipped") and "x" not in rows[3]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "Traceback" in log and "second line" in log
    assert (tmp_path / "gpu_check.md").exists() and isinstance(gpu_check.summary(check.data), str)


def test_memory_extrapolates_linearly_to_the_shape_depth(tmp_path):
    """X(D) = X(2) + (D − 2)·(X(3) − X(2)) for base and peak (the first layer carries one-time
    allocations, so the slope starts at 2); the 4-layer check is the measured 4-layer peak minus
    that line's value at 4."""
    check = gpu_check.Check(tmp_path, budget_s=60, device="cpu")
    check.data["config"] = {"shape": "small"}
    check.rows("memory build").extend([{"layers": 2, "weights": 1000}, {"layers": 3, "weights": 1400}])
    check.rows("memory").extend([
        {"case": "ppl", "length": 256, "layers": 2, "base": 5 * 2**20, "peak": 9 * 2**20, "trainable": 0},
        {"case": "ppl", "length": 256, "layers": 3, "base": 7 * 2**20, "peak": 12 * 2**20, "trainable": 0},
        {"case": "ppl", "length": 256, "layers": 4, "base": 9 * 2**20, "peak": 16 * 2**20, "trainable": 0},
    ])
    gpu_check.extrapolate(check, depth=32, dtype=torch.float32)
    (row,) = check.data["sections"]["memory at depth"]
    assert row["peak"] == (9 + 30 * 3) * 2**20 and row["base"] == (5 + 30 * 2) * 2**20
    assert row["peak_per_layer"] == 3 * 2**20
    assert row["check-depth error MiB"] == pytest.approx(16 - 15)
    assert row["floor"] > row["base"] and row["peak/floor"] == row["peak"] / row["floor"]

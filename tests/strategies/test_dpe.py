"""DPE (``ropescale/strategies/dpe.py``): its relative positions against the formula written per (i, j, pair
group); the kernels (fused with backward, blocked, naive) against a float64 oracle that turns every pair by
its own group's distance, with gradients; the authors' code (recorded golden, ``tests/data/authors/dpe.json``)
on the same tiny Llama, prompt and decoding; cached decoding against full forwards; the registry (presets,
ranges, search space), ``inspect`` and the engines' refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

import ropescale
from ropescale.strategies import get_strategy
from ropescale.strategies.dpe import DPE_PRESETS, dpe
from ropescale.strategies.relative import pair_groups, self_extend
from tests.conftest import with_cache
from tests.strategies.rules2025 import (
    assert_fused_grads_equal_naive,
    golden,
    inputs,
    pair_logits,
    paths_match_oracle,
    refused_by_static_engines,
    softmax_attention,
    tiny_llama,
)

SCALES = [2, 16, 8, 4, 1, 2, 16, 4]


def rule(window=16, scales=SCALES):
    return dpe(window, "llama3.1-8b", *scales)


def formula(i: int, j: int, g: int, window: int, scales) -> float:
    """The paper's distance of pair group g, written with Python numbers."""
    s = scales[g]
    return i - j if i - j < window else i // s - j // s + window - window / s


@pytest.mark.parametrize("window,scales", [(16, SCALES), (5, [3, 7, 1, 2, 9, 4, 6, 5]), (1, [1] * 8)])
def test_relative_positions_are_the_formula_per_pair_group(window, scales):
    pos = torch.arange(60.0)[None]
    p = rule(window, scales).relative_positions(pos, pos)[0]  # [60, 60, 8]
    assert p.shape == (60, 60, 8)
    for i in range(60):
        for j in range(i + 1):
            assert p[i, j].tolist() == pytest.approx([formula(i, j, g, window, scales) for g in range(8)]), (i, j)


def test_pair_groups_are_the_authors_contiguous_ranges():
    assert pair_groups(64, 8).tolist() == [g for g in range(8) for _ in range(8)]  # dimension_groups_range
    assert pair_groups(8, 8).tolist() == list(range(8))  # the tiny Llama: one pair per group
    assert pair_groups(12, 8).tolist() == [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7]


def test_one_scale_everywhere_is_self_extend_and_scale_one_is_vanilla():
    """All groups at G: SelfExtend's rule (W − W/G = W − ⌊W/G⌋ when G divides W), logits bit for bit; all at 1:
    the true distance everywhere, so the unpatched model."""
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(ids).logits
        with ropescale.patch(model, "self_extend", window=16, group_size=4):
            se = model(ids).logits
        with ropescale.patch(model, "dpe", window=16, **{f"scale_{g}": 4 for g in range(8)}):
            assert torch.equal(model(ids).logits, se)
        with ropescale.patch(model, "dpe", window=16, **{f"scale_{g}": 1 for g in range(8)}):
            torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=1e-12)


@pytest.mark.parametrize("s_k,cached,n_kv,d", [(45, 0, 2, 16), (40, 13, 1, 16), (33, 32, 2, 12)])
def test_kernels_equal_a_per_pair_float64_oracle_with_gradients(s_k, cached, n_kv, d):
    """Outputs and q, k, v gradients of every path against softmax(q·R(p_g(i, j))k) with p_g from the formula
    per (i, j, pair): GQA, a KV-cache split, partial rotary (12 of 16 channels: 6 pairs in 8 groups)."""
    window, scales = 7, [3, 5, 2, 1, 4, 6, 2, 3]
    s_q = s_k - cached
    q, k, v = inputs(2, 4, n_kv, s_q, s_k, 16, seed=s_k)
    inv = (1.0 / (100 ** (torch.arange(0, d, 2) / d))).float().double()  # float32-exact frequencies
    group = pair_groups(d // 2, 8).tolist()
    p = torch.tensor([[[formula(i, j, group[f], window, scales) if j <= i else 0.0 for f in range(d // 2)]
                       for j in range(s_k)] for i in range(cached, s_k)], dtype=torch.float64)  # [s_q, s_k, d/2]
    kk, vv = (x.repeat_interleave(4 // n_kv, 1) for x in (k, v))
    want = softmax_attention(pair_logits(q, kk, p, inv) * 0.3, vv)
    pos = torch.arange(s_k, dtype=torch.float64)[None].expand(2, -1)
    paths_match_oracle(rule(window, scales), want, q, k, v, pos[:, cached:], pos, inv, scale=0.3, tol=1e-6)


GOLDEN, PROVENANCE = golden("dpe")
PARAMS = {"window": GOLDEN["window"], **{f"scale_{g}": s for g, s in enumerate(GOLDEN["scales"])}}


def test_golden_provenance_is_recorded():
    assert PROVENANCE["commit"].startswith("46b85de") and PROVENANCE["file"] == "dpe_for_llama.py"
    assert GOLDEN["scales"] == SCALES and PROVENANCE["transformers"] == "4.47.0"


@pytest.mark.parametrize("path", ["fused", "blocked", "flex", "naive"])
def test_equals_the_authors_dpe_flash_forward_on_the_tiny_llama(path):
    """The authors' prefill (``dpe_flash_forward``, q_len = kv_seq_len) on a 100-token prompt, 6 pairs of
    windows past T = 64: logits within 1e-5 (measured 1.3e-6 on the float32-angle paths, 6e-6 on naive,
    whose angles are float64 relative distances; the authors' merge weights come from flash-attn's float32
    log-sum-exp: with a float64 one the gap is 2.2e-7, the model's float32 RMSNorm)."""
    model, n = tiny_llama(), GOLDEN["prompt"]
    with torch.no_grad(), ropescale.patch(model, "dpe", attention_path=path, **PARAMS):
        got = model(GOLDEN["ids"][:, :n]).logits
    assert (got - GOLDEN["prompt_logits"]).abs().max() < (2e-5 if path == "naive" else 1e-5)
    with torch.no_grad():  # the rule matters: vanilla is far off
        assert (model(GOLDEN["ids"][:, :n]).logits - GOLDEN["prompt_logits"]).abs().max() > 1.0


def test_cached_decoding_equals_the_authors_decoding_and_full_forwards():
    """Six one-token steps from the prompt's cache: each equals the authors' q_len = 1 branch (keys turned back by
    −p, the query at 0; within 1e-5, measured 2.9e-6) and a full forward of the same tokens (≤ 1e-12)."""
    model, n, ids = tiny_llama(), GOLDEN["prompt"], GOLDEN["ids"]
    with torch.no_grad(), ropescale.patch(model, "dpe", **PARAMS):
        cache = DynamicCache(config=model.config)
        model(ids[:, :n], **with_cache(cache), use_cache=True)
        for t in range(GOLDEN["decode"]):
            step = model(ids[:, n + t : n + t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            assert (step - GOLDEN["step_logits"][t]).abs().max() < 1e-5
            assert (step - model(ids[:, : n + t + 1]).logits[:, -1]).abs().max() < 1e-12


def test_training_step_gradients_equal_the_naive_path():
    model, ids = tiny_llama(), GOLDEN["ids"][:, :80]
    assert_fused_grads_equal_naive(model, "dpe", ids, **PARAMS)


def test_registry_presets_ranges_and_search_space():
    strat = get_strategy("dpe")
    assert strat.kind == "attention" and "2504.18857" in strat.source and "46b85de" in strat.source
    assert strat.validate({})["window"] == 1024
    for preset, scales in DPE_PRESETS.items():
        r = get_strategy("dpe").compute({}, strat.validate({"preset": preset, "window": 8}))
        far = r.relative_positions(torch.tensor([[4096.0]]), torch.zeros(1, 1))[0, 0, 0]
        assert far.tolist() == [4096 // s + 8 - 8 / s for s in scales]
    r = strat.compute({}, strat.validate({"scale_3": 64}))  # one given, the others the preset's
    assert r.relative_positions(torch.tensor([[5000.0]]), torch.zeros(1, 1))[0, 0, 0, 3] == 5000 // 64 + 1024 - 16
    with pytest.raises(ValueError, match=r"dpe: parameter scale_0=0 is out of range; allowed: >= 1 and <= 1024"):
        strat.validate({"scale_0": 0})
    with pytest.raises(ValueError, match=r"preset='gpt'.*is not a choice"):
        strat.validate({"preset": "gpt"})
    from eval.search.space import search_space

    dims = {d.name: d for d in search_space("dpe")}
    assert set(dims) == {"window", *(f"scale_{g}" for g in range(8))}
    assert (dims["scale_5"].low, dims["scale_5"].high, dims["scale_5"].log, dims["scale_5"].kind) == (1, 1024, True,
                                                                                                      "int")


def test_inspect_shows_each_pair_groups_positions(tmp_path):
    from cli import main

    res = CliRunner().invoke(main, ["inspect", "--model", "reference", "--strategy", "dpe:window=16,scale_7=64",
                                    "--length", "512", "-o", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "summary.json").read_text())["strategies"][0]
    scales = [*DPE_PRESETS["llama3.1-8b"][:7], 64]
    assert row["max_relative_position_per_group"] == [max(511 // s + 16 - 16 / s, 15) for s in scales]
    assert "per pair group, fastest first: 263, 30.5" in res.output
    assert (tmp_path / "relative_positions.png").stat().st_size > 10_000


def test_every_static_engine_refuses_it_in_one_line():
    assert {"vllm", "llama.cpp", "mlx", "sglang"} <= set(refused_by_static_engines("dpe", PARAMS))


def test_self_extend_is_untouched():
    """The grouped maps are an addition: an existing rule still has one position per token."""
    r = self_extend(4, 8)
    assert r.groups == 1
    assert r.relative_positions(torch.arange(20.0)[None], torch.arange(20.0)[None]).shape == (1, 20, 20)

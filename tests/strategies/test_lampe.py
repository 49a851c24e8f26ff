"""LaMPE (``ropescale/strategies/lampe.py``): U(N) against the authors' ``remap_uselen``; relative positions
against the three-region formula written here from the paper's definitions (m(p) = ⌊p·U/(N − 1)⌋, β₁, β₂, R
computed by this file, not by the module); the kernels (fused with backward, blocked, naive) against a float64
oracle with gradients; the authors' code (recorded golden, ``tests/data/authors/lampe.json``: their
``llama_cache1.py`` @ 4e3c91f run in float32, which their cache allocator requires) on the same tiny Llama and
prompts; cached decoding against full forwards; the registry (fits, ranges, search space), ``inspect`` and the
engines' refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

import ropescale
from ropescale.errors import InvalidInput
from ropescale.strategies import get_strategy
from ropescale.strategies.lampe import LAMPE_FITS, lampe, lampe_use_length
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

FACTOR = 0.1 * math.log(2) + 1
GOLDEN, PROVENANCE = golden("lampe")


def rule(n, head, tail, use, prefill="paper"):
    return lampe(n, head, tail, "llama3", None, None, None, use, None, prefill)


def formula(n: int, head: int, tail: int, use: int):
    """p(i, j) of the paper as a Python function: true distance below H, the mapped middle, the shifted tail."""
    m = [p * use // (n - 1) for p in range(n)]  # exact integer floor
    r = tail
    while r + 1 < n and m[r] == m[r + 1]:  # the tail reaches the end of the run of equal m holding it
        r += 1
    b1 = head - (m[head] + 1)
    b2 = (n - 1 - r) - m[n - 1 - r] - b1

    def p(i: int, j: int) -> int:
        if i - j < head:
            return i - j
        if i - j < n - r:
            return m[i] + b1 - m[j]
        return i - b2 - j
    return p


@pytest.mark.parametrize("n,head,tail,use", [(100, 8, 5, 40), (90, 12, 20, 1536), (64, 4, 9, 17), (300, 16, 7, 120)])
def test_relative_positions_are_the_formula(n, head, tail, use):
    pos = torch.arange(float(n))[None]
    got = rule(n, head, tail, use).relative_positions(pos, pos)[0]
    p = formula(n, head, tail, use)
    want = torch.tensor([[p(i, j) if j <= i else i - j for j in range(n)] for i in range(n)], dtype=got.dtype)
    assert torch.equal(got, want)


def test_use_length_is_the_authors_remap_uselen():
    for fit, table in GOLDEN["remap"].items():
        assert {n: lampe_use_length(n, fit) for n in table} == table, fit
    a, b, _, _ = LAMPE_FITS["llama3"]
    assert lampe_use_length(20000, "llama3", c=100.0) == int(100 / (1 + math.exp(-(a * 20000 + b))))


def test_golden_provenance_is_recorded():
    assert PROVENANCE["commit"].startswith("4e3c91f") and PROVENANCE["file"] == "llama_cache1.py"
    assert PROVENANCE["transformers"] == "4.43.3" and PROVENANCE["dtype"] == "float32"


@pytest.mark.parametrize("k", range(3), ids=["compressed", "remap_uselen", "short"])
@pytest.mark.parametrize("path", ["fused", "naive"])
def test_equals_the_authors_forward_on_the_tiny_llama(k, path):
    """Their prefill (``forward`` under ``flashdecoding_forward``, float32) against ropescale's ``prefill=authors``
    in float64: within 2e-5 on the fused path (float32 rounding of the golden; its angles are float32 of absolute
    positions, as theirs), 1e-4 on naive (float64 angles of relative positions: the remap_uselen prompt maps
    queries near 1536, where a float32 angle is off by ~1e-4). ``prefill=paper`` counts each key once, so it
    departs where their windows overlap (distances H and N − R), except for the short prompt (plain RoPE)."""
    p = GOLDEN["prompts"][k]
    model, ids = tiny_llama(), GOLDEN["ids"][:, : p["n"]]
    params = {"prompt_length": p["n"], "head": p["head"], "tail": p["tail"], "use_length": p["use_length"]}
    want = p["logits"].double()
    with torch.no_grad():
        with ropescale.patch(model, "lampe", attention_path=path, prefill="authors", **params):
            got = model(ids).logits
        tol = 2e-5 if path == "fused" else 1e-4
        assert (got - want).abs().max() < tol
        with ropescale.patch(model, "lampe", attention_path=path, **params):
            paper = model(ids).logits
        assert ((paper - want).abs().max() < tol) == (k == 2)
        assert (model(ids).logits - want).abs().max() > 0.1  # the rule matters: vanilla is off


@pytest.mark.parametrize("s_k,cached,n_kv,d", [(50, 0, 2, 16), (50, 21, 1, 12)])
def test_kernels_equal_a_float64_oracle_with_gradients(s_k, cached, n_kv, d):
    """Outputs and q, k, v gradients of every path against softmax(q·R(p(i, j))k·1.069²) with p from the
    formula: GQA, a KV-cache split, partial rotary."""
    n, head, tail, use = 50, 6, 4, 19
    s_q = s_k - cached
    q, k, v = inputs(1, 4, n_kv, s_q, s_k, 16, seed=s_k + cached)
    inv = (1.0 / (100 ** (torch.arange(0, d, 2) / d))).float().double()
    f = formula(n, head, tail, use)
    p = torch.tensor([[[f(i, j) if j <= i else 0.0] * (d // 2) for j in range(s_k)] for i in range(cached, s_k)],
                     dtype=torch.float64)
    kk, vv = (x.repeat_interleave(4 // n_kv, 1) for x in (k, v))
    want = softmax_attention(pair_logits(q, kk, p, inv, FACTOR) * 0.25, vv)
    pos = torch.arange(s_k, dtype=torch.float64)[None]
    paths_match_oracle(rule(n, head, tail, use), want, q, k, v, pos[:, cached:], pos, inv, scale=0.25, tol=1e-6,
                       factor=FACTOR)


def test_cached_decoding_equals_full_forwards_and_training_gradients_the_naive_path():
    model, ids = tiny_llama(), GOLDEN["ids"]
    params = {"prompt_length": 100, "head": 8, "tail": 5, "use_length": 40}
    with torch.no_grad(), ropescale.patch(model, "lampe", **params):
        cache = DynamicCache(config=model.config)
        model(ids[:, :94], **with_cache(cache), use_cache=True)
        for t in range(94, 100):
            step = model(ids[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            assert (step - model(ids[:, : t + 1]).logits[:, -1]).abs().max() < 1e-12
    assert_fused_grads_equal_naive(model, "lampe", ids[:, :60], **params)


def test_registry_fits_ranges_search_space_and_refusals():
    strat = get_strategy("lampe")
    assert strat.kind == "attention" and "2508.02308" in strat.source and "4e3c91f" in strat.source
    v = strat.validate({"prompt_length": 9000})
    assert (v["head"], v["tail"], v["fit"]) == (512, 200, "llama3")
    with pytest.raises(ValueError, match=r"lampe: parameter head=0 is out of range"):
        strat.validate({"prompt_length": 9000, "head": 0})
    with pytest.raises(ValueError, match=r"fit='gpt'.*is not a choice"):
        strat.validate({"prompt_length": 9000, "fit": "gpt"})
    with pytest.raises(InvalidInput, match=r"^lampe: the tail starts at distance \d+, inside the head \(head=40\)"):
        rule(100, 40, 70, 30)
    from eval.search.space import search_space

    dims = {d.name: d for d in search_space("lampe", fixed={"prompt_length": 9000})}
    assert {"a", "b", "c", "head", "tail"} <= set(dims)
    assert (dims["a"].low, dims["a"].high, dims["a"].log) == (1e-8, 1e-2, True)


def test_inspect_shows_it(tmp_path):
    from cli import main

    res = CliRunner().invoke(main, ["inspect", "--model", "reference", "--strategy",
                                    "lampe:prompt_length=256,head=16,tail=8,use_length=64", "--length", "256", "-o",
                                    str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "summary.json").read_text())["strategies"][0]
    f = formula(256, 16, 8, 64)
    assert row["max_relative_position"] == max(f(255, j) for j in range(256))


def test_every_static_engine_refuses_it_in_one_line():
    params = {"prompt_length": 100, "head": 8, "tail": 5}
    assert {"vllm", "llama.cpp", "mlx", "sglang"} <= set(refused_by_static_engines("lampe", params))

"""GALI (``ropescale/strategies/gali.py``): its positions against the authors' ``construct_new_pi`` (recorded) and a
Python loop; the kernels (fused with backward, blocked, naive) against a float64 oracle that interpolates each
logit between its two integer distances, with gradients; the authors' code (recorded golden,
``tests/data/authors/gali.json``) on the same tiny Llama and prompts; cached decoding against full forwards; the
registry (ranges, search space), ``inspect`` and the engines' refusals."""

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
from ropescale.strategies.gali import gali, gali_positions
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

GOLDEN, PROVENANCE = golden("gali")


def new_pi(n: int, t: int, w: int) -> list[float]:
    """The positions of n tokens as a Python loop: g slots per early position until n fit, then unit steps."""
    g = math.ceil((n - w) / (t - w))
    early, i = [], 0
    while t - i + len(early) < n:
        early += [i + k * (1 / g) for k in range(g)]
        i += 1
    tail = list(range(i, t))
    return early[: n - len(tail)] + tail


def test_golden_provenance_is_recorded():
    assert PROVENANCE["commit"].startswith("5a3e947") and PROVENANCE["licence"] == "MIT"
    assert PROVENANCE["transformers"] == "4.46.2" and "attention_score_approximate" in PROVENANCE["functions"]


@pytest.mark.parametrize("k", range(5))
def test_positions_are_construct_new_pi(k):
    """The authors' positions (float32, recorded) and the loop above, for tiny and Llama-sized windows."""
    row = GOLDEN["positions"][k]
    n, t, w = row["n"], row["t"], row["local_window"]
    mine = gali_positions(torch.arange(n, dtype=torch.float64), n, t, w)
    assert torch.equal(mine.float(), row["pi"].float())
    assert mine.tolist() == new_pi(n, t, w)
    assert mine[-1] == t - 1 and (mine[-(w + 1):].diff() == 1).all()


@pytest.mark.parametrize("s_k,cached,n_kv,d", [(40, 13, 1, 16), (33, 32, 2, 12)])
def test_kernels_equal_an_interpolated_logit_oracle_with_gradients(s_k, cached, n_kv, d):
    """Outputs and q, k, v gradients of every path against softmax((1 − r)·A(⌊d⌋) + r·A(⌊d⌋ + 1)), d =
    ⌈f(i)⌉ − f(j), f from the loop, T = 20, w = 4: GQA, a KV-cache split, one decoded query with partial rotary
    (12 of 16 channels)."""
    f = torch.tensor(new_pi(s_k, 20, 4), dtype=torch.float64)
    dist = f.ceil()[cached:, None] - f[None, :]  # [s_q, s_k]
    n, r = dist.floor(), dist - dist.floor()
    q, k, v = inputs(2, 4, n_kv, s_k - cached, s_k, 16, seed=s_k)
    inv = (1.0 / (100 ** (torch.arange(0, d, 2) / d))).float().double()
    kk, vv = (x.repeat_interleave(4 // n_kv, 1) for x in (k, v))
    at = lambda p: pair_logits(q, kk, p[..., None].expand(*p.shape, d // 2), inv)
    want = softmax_attention(((1 - r) * at(n) + r * at(n + 1)) * 0.3, vv)
    pos = torch.arange(s_k, dtype=torch.float64)[None].expand(2, -1)
    paths_match_oracle(gali(s_k, 4, 20, chunk=0), want, q, k, v, pos[:, cached:], pos, inv, scale=0.3, tol=1e-6)


@pytest.mark.parametrize("path,k", [(path, k) for path in ("fused", "blocked", "flex") for k in range(3)]
                         + [("naive", 0)])
def test_equals_the_authors_attention_score_approximate_on_the_tiny_llama(path, k):
    """Their forward (``dpi_llamamodel_forward`` → ``attention_score_approximate``, noise off) on prompts of 100,
    200 and 150 tokens past T = 64 (g = 2, 4, 3; naive, the slowest path, on the first): logits within 1e-5 of
    theirs (measured ≤ 2.1e-6 on fused and blocked, 3.9e-6 on naive, whose angles are float64 distances; their
    positions and interpolation weights are float32)."""
    p = GOLDEN["prompts"][k]
    model, ids = tiny_llama(), GOLDEN["ids"][:, : p["n"]]
    with torch.no_grad(), ropescale.patch(model, "gali", attention_path=path, prompt_length=p["n"],
                                          local_window=p["local_window"], chunk=0):
        got = model(ids).logits
    assert (got - p["logits"]).abs().max() < 1e-5
    with torch.no_grad():  # the rule matters: vanilla is far off
        assert (model(ids).logits - p["logits"]).abs().max() > 0.1


def test_within_the_window_it_is_vanilla_and_a_local_window_of_t_is_refused():
    model, ids = tiny_llama(), GOLDEN["ids"][:, :50]
    with torch.no_grad():
        base = model(ids).logits
        with ropescale.patch(model, "gali", prompt_length=64):
            assert torch.equal(model(ids).logits, base)
    with pytest.raises(InvalidInput, match=r"^gali: local_window=64 must be below the training window T = 64$"), \
            ropescale.patch(tiny_llama(), "gali", prompt_length=100, local_window=64):
        pass


def test_cached_decoding_equals_full_forwards():
    """chunk = 0: three one-token steps from a 100-token prompt's cache, each equal to a full forward of the same
    tokens (the map is f_N for N = 100, continued at unit spacing past N)."""
    model, n, ids = tiny_llama(), 100, GOLDEN["ids"]
    with torch.no_grad(), ropescale.patch(model, "gali", prompt_length=n, local_window=16, chunk=0):
        cache = DynamicCache(config=model.config)
        model(ids[:, :n], **with_cache(cache), use_cache=True)
        for t in range(3):
            step = model(ids[:, n + t : n + t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            assert (step - model(ids[:, : n + t + 1]).logits[:, -1]).abs().max() < 1e-12


def test_training_step_gradients_equal_the_naive_path():
    model, ids = tiny_llama(), GOLDEN["ids"][:, :72]
    assert_fused_grads_equal_naive(model, "gali", ids, prompt_length=72, local_window=16, chunk=0)
    assert_fused_grads_equal_naive(tiny_llama(), "gali", ids, local_window=16, chunk=5)  # pieces of 64, 5, 3


def test_registry_ranges_and_search_space():
    strat = get_strategy("gali")
    assert strat.kind == "attention" and "2502.02659" in strat.source and "5a3e947" in strat.source
    assert strat.validate({"prompt_length": 9000})["local_window"] is None
    params = strat.validate({"prompt_length": 9000})
    for t, w in ((4096, 128), (64, 32)):  # the default w = min(128, T // 2): the last w tokens at T − w … T − 1
        rule = strat.compute({"original_max_position_embeddings": t}, params | {"chunk": 0})
        assert rule.regions[0].q_at(torch.tensor([[9000.0 - w]])).item() == t - w
    with pytest.raises(ValueError, match=r"gali: parameter local_window=-1 is out of range; allowed: >= 0"):
        strat.validate({"prompt_length": 9000, "local_window": -1})
    from eval.search.space import search_space

    dims = {d.name: d for d in search_space("gali", fixed={"prompt_length": 9000})}
    assert set(dims) == {"local_window", "chunk"} and dims["local_window"].low == 0


def test_inspect_shows_it(tmp_path):
    from cli import main

    res = CliRunner().invoke(main, ["inspect", "--model", "reference", "--strategy",
                                    "gali:prompt_length=256,local_window=32", "--length", "256", "-o",
                                    str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "summary.json").read_text())["strategies"][0]
    assert row["max_relative_position"] == pytest.approx(127)  # ⌈f(255)⌉ − f(0) = T − 1


def test_every_static_engine_refuses_it_in_one_line():
    assert {"vllm", "llama.cpp", "mlx", "sglang"} <= set(refused_by_static_engines("gali", {"prompt_length": 100,
                                                                                           "local_window": 16}))


def chunk_sizes(n: int, t: int, chunk: int) -> list[int]:
    """The authors' ``get_chunk_size_list`` (int ``chunk_coe``) as a loop: T, then chunks of ``chunk``, the last cut
    to end at n."""
    sizes, total = [t], t
    while total < n:
        sizes.append(chunk)
        total += chunk
    sizes[-1] -= total - n
    return sizes


def authors_prefill(model, ids: torch.Tensor, sizes: list[int], w: int, decode: int = 0,
                    path: str = "fused") -> torch.Tensor:
    """Their ``dpi_sample`` as a loop of cached calls: each chunk (then each of ``decode`` one-token steps) fed
    under one map f_e for the length e it ends at (``prompt_length`` = e, ``chunk`` = 0: the one-map rule checked
    against their ``attention_score_approximate`` above), every key through the same cache → the logits of
    every fed token ``[1, Σ sizes + decode, V]``."""
    cache, out, e = DynamicCache(config=model.config), [], 0
    for size in sizes + [1] * decode:
        with ropescale.patch(model, "gali", prompt_length=e + size, local_window=w, chunk=0, attention_path=path):
            out.append(model(ids[:, e : e + size], **with_cache(cache), use_cache=True).logits)
        e += size
    return torch.cat(out, 1)


def test_pieces_cut_at_t_then_every_chunk():
    """A call's queries are cut where the authors cut the prompt: at slots T, T + c, …; a decoded token is a piece
    of its own whose map is built for the length it ends at."""
    rule = gali(1000, 16, 64, chunk=40)
    assert [(a, b) for a, b, _ in rule.split(200, 200)] == [(0, 64), (64, 104), (104, 144), (144, 184), (184, 200)]
    assert [b - a for a, b, _ in rule.split(200, 200)] == chunk_sizes(200, 64, 40)
    assert [(a, b) for a, b, _ in rule.split(30, 130)] == [(0, 4), (4, 30)]  # keys 100…129: cut at slot 104
    (a, b, one), = rule.split(1, 131)
    assert (a, b) == (0, 1) and one.regions[0].q_at(torch.tensor([[130.0]])).item() == 63  # f_131(130) = T − 1
    assert rule.split(50, 50)[0][2].regions == (gali(1000, 16, 64, chunk=0).regions[0].__class__(0, None),)


@pytest.mark.parametrize("path,n,chunk", [("fused", 200, 40), ("blocked", 150, 30), ("naive", 100, 3000)])
def test_one_forward_equals_the_authors_chunked_prefill(path, n, chunk):
    """chunk > 0: one forward of n tokens gives the logits of the authors' chunked prefill (T plain, then chunks
    under growing maps), fed chunk by chunk through a cache on the same path; the first T tokens are plain RoPE
    (vanilla's logits)."""
    model, ids = tiny_llama(), GOLDEN["ids"][:, :n]
    with torch.no_grad():
        want = authors_prefill(model, ids, chunk_sizes(n, 64, chunk), 16, path=path)
        with ropescale.patch(model, "gali", attention_path=path, local_window=16, chunk=chunk):
            got = model(ids).logits
        assert (got - want).abs().max() < 1e-10
        assert (got[:, :64] - model(ids[:, :64]).logits).abs().max() < 1e-5  # vanilla's angles are float32
        with ropescale.patch(model, "gali", prompt_length=n, local_window=16, chunk=0):  # one map differs
            assert (model(ids).logits - want).abs().max() > 1e-3


def test_cached_chunks_and_decoding_equal_the_authors_loop():
    """A prompt fed in two cached calls (cut on the chunk grid, at slot T + 40) and three decoded tokens, under
    chunk = 40, equal the authors' loop: prefill chunks T, 40, 40, 16 and a map rebuilt for each decoded token.
    A call cut off the grid is a piece of its own (its queries under the map of the length it ends at)."""
    model, ids = tiny_llama(), GOLDEN["ids"][:, :163]
    with torch.no_grad():
        want = authors_prefill(model, ids, chunk_sizes(160, 64, 40), 16, decode=3)
        with ropescale.patch(model, "gali", local_window=16, chunk=40):
            cache = DynamicCache(config=model.config)
            got = [model(ids[:, :104], **with_cache(cache), use_cache=True).logits,
                   model(ids[:, 104:160], **with_cache(cache), use_cache=True).logits]
            got += [model(ids[:, t : t + 1], **with_cache(cache), use_cache=True).logits for t in range(160, 163)]
    assert (torch.cat(got, 1) - want).abs().max() < 1e-10


def test_sliding_window_layers_count_tokens_not_cache_slots():
    """Gemma 3's sliding layers keep W − 1 keys: their pieces are still cut by the tokens seen, so calls cut on
    the chunk grid through a cache equal one forward (on the code that counted slots: 0.44 apart)."""
    from transformers import Gemma3ForCausalLM

    from tests.conftest import build, tiny_gemma3_config

    model, ids = build(Gemma3ForCausalLM, tiny_gemma3_config()), GOLDEN["ids"][:, :144] % 256
    assert model.config.sliding_window < 64 < 144 and model.config.max_position_embeddings == 64
    with torch.no_grad(), ropescale.patch(model, "gali", local_window=4, chunk=40):
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        got = torch.cat([model(ids[:, :104], **with_cache(cache), use_cache=True).logits,
                         model(ids[:, 104:], **with_cache(cache), use_cache=True).logits], 1)
    assert (got - full).abs().max() < 1e-10


def test_a_padded_batch_is_refused_in_one_line():
    model, ids = tiny_llama(), GOLDEN["ids"][:, :100].repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with ropescale.patch(model, "gali", local_window=16, chunk=40), \
            pytest.raises(InvalidInput, match=r"padded or masked batches are not supported; run one sequence at a "
                                              r"time, or chunk=0$"):
        model(ids, attention_mask=mask)


def test_a_shared_prefix_cache_is_cropped_to_the_last_piece_cut():
    """Retrieval's PrefixCache under chunk = 40: a prompt after one sharing its first 180 (or 150) tokens gives
    the log-probabilities of that prompt run whole (the cache is cropped to the last cut, 144)."""
    from eval.tasks.retrieval import PrefixCache

    model, base = tiny_llama(), GOLDEN["ids"][0, :180].tolist()
    for first, second in ((base + [5, 6, 7], base + [9]), (base + [5, 6, 7], base[:150] + [9, 9])):
        with torch.no_grad(), ropescale.patch(model, "gali", local_window=16, chunk=40):
            shared = PrefixCache(model, "cpu", share=True)
            shared.run(first)
            after, _ = shared.run(second)
            alone, _ = PrefixCache(model, "cpu", share=False).run(second)
        assert (after - alone).abs().max() < 1e-10


def test_inspect_draws_each_query_under_its_pieces_map():
    """The relative-position map of a strided grid (as ``inspect`` draws it) puts each query under the map of
    the piece holding its position in one forward of L tokens: the contiguous forward's rows, sampled."""
    rule, n = gali(None, 16, 64, chunk=40), 200
    pos = torch.arange(n, dtype=torch.float64)[None]
    full = torch.cat([r.relative_positions(pos[:, a:e], pos) for a, e, r in rule.split(n, n)], 1)  # [1, n, n]
    grid = pos[:, ::7]
    assert torch.equal(rule.relative_positions(grid, pos), full[:, ::7])
    assert torch.equal(rule.relative_positions(pos, pos), full)

"""PoSE (arXiv:2309.10400 §3.2): properties of the position ids, the default sampling against the
authors' code (dwzhu-pku/PoSE src/train_pose.py, written out below), the paper's cumulative skip
distribution, coverage of relative distances, and chunks that really attend to each other."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from ropescale.training.loop import causal_lm_loss
from ropescale.training.pose import chunk_lengths, sample_pose, source_span
from tests.conftest import build, tiny_llama_config


@settings(max_examples=300, deadline=None)
@given(T=st.integers(1, 64), extra=st.integers(1, 300), chunks=st.integers(1, 5),
       content=st.sampled_from(["random", "aligned", "contiguous"]), seed=st.integers(0, 2**31),
       slack=st.integers(0, 50))
@pytest.mark.parametrize("sampling", ["authors", "paper"])
def test_position_ids_properties(T, extra, chunks, content, seed, slack, sampling):
    chunks = min(chunks, T) if sampling == "paper" else 2
    if chunks > T:
        return
    L = T + extra
    span = L + slack
    s = sample_pose(T, L, np.random.default_rng(seed), chunks=chunks, content=content, span=span, sampling=sampling)
    pos, idx = s.position_ids.tolist(), s.content_index.tolist()
    assert len(pos) == len(idx) == T
    assert sum(s.lengths) == T and len(s.lengths) == chunks and min(s.lengths) >= 1
    assert pos[0] == 0 and max(pos) < L
    assert all(b > a for a, b in zip(pos, pos[1:]))  # strictly increasing: chunks never overlap
    assert s.skips[0] == 0 and all(b >= a for a, b in zip(s.skips, s.skips[1:])) and s.skips[-1] <= L - T
    # inside a chunk positions are contiguous; at the boundary into chunk i they jump by u_i - u_{i-1} + 1
    edges = np.cumsum(s.lengths)[:-1]
    for i, e in enumerate(edges, start=1):
        assert pos[e] - pos[e - 1] == s.skips[i] - s.skips[i - 1] + 1
    steps = [b - a for a, b in zip(pos, pos[1:])]
    assert sum(x != 1 for x in steps) <= chunks - 1
    assert idx[0] == 0 and max(idx) < span and all(b > a for a, b in zip(idx, idx[1:]))
    if content == "aligned":
        assert idx == pos
    if content == "contiguous":
        assert idx == list(range(T))


def test_cumulative_skip_distribution_matches_the_paper():
    """u_0 = 0, u_1 ~ U{0..M}, u_2 ~ U{u_1..M} (M = L − T): the marginal of u_2 computed exactly
    from that definition, against 30000 draws."""
    T, L, M, n = 6, 10, 4, 30000
    rng = np.random.default_rng(0)
    u1 = np.zeros(M + 1)
    u2 = np.zeros(M + 1)
    for _ in range(n):
        s = sample_pose(T, L, rng, chunks=3, content="contiguous", sampling="paper")
        u1[s.skips[1]] += 1
        u2[s.skips[2]] += 1
    expected_u2 = [sum(1 / (M + 1) / (M - a + 1) for a in range(b + 1)) for b in range(M + 1)]
    np.testing.assert_allclose(u1 / n, [1 / (M + 1)] * (M + 1), atol=0.015)
    np.testing.assert_allclose(u2 / n, expected_u2, atol=0.015)


def test_chunk_lengths_uniform_over_compositions():
    """Two chunks: l_0 uniform over 1 … T−1."""
    rng = np.random.default_rng(1)
    T, n = 5, 20000
    counts = np.bincount([chunk_lengths(T, 2, rng)[0] for _ in range(n)], minlength=T)[1:]
    np.testing.assert_allclose(counts / n, [1 / (T - 1)] * (T - 1), atol=0.015)


def test_every_relative_distance_up_to_the_target_length_occurs():
    T, L = 8, 40
    rng = np.random.default_rng(2)
    seen = set()
    for _ in range(3000):
        p = sample_pose(T, L, rng).position_ids  # the authors' sampling (default)
        seen |= set((p[:, None] - p[None, :]).flatten().tolist())
    assert set(range(1, L)) <= seen  # every distance 1 … L−1, although each example has only T tokens


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 16, "target_length": 16}, "above the training window"),
    ({"window": 4, "target_length": 16, "chunks": 5}, "cannot split"),
    ({"window": 4, "target_length": 16, "content": "aligned", "span": 8}, "shorter than 16"),
    ({"window": 4, "target_length": 16, "chunks": 3}, "exactly 2 chunks"),
    ({"window": 4, "target_length": 16, "sampling": "code"}, "choose one of authors, paper"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_pose(rng=np.random.default_rng(0), **kwargs)


def test_chunks_attend_to_each_other_as_tokens_at_those_positions_would():
    """Oracle: the T tokens placed at their PoSE positions in a longer sequence of filler slots, with
    an explicit 4-D mask letting each token see only the real tokens before it. The training loss
    function must give the same logits (and so the same loss); a forward with position_ids but no
    attention mask does not — transformers then reads the jump as a new packed sequence."""
    model = build(LlamaForCausalLM, tiny_llama_config())
    T, L = 16, 60
    s = sample_pose(T, L, np.random.default_rng(5))
    assert s.skips[1] > 0
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(0))
    pos = s.position_ids[None]
    n = int(pos.max()) + 1
    full = torch.zeros(1, n, dtype=torch.long)
    full[0, pos[0]] = ids[0]
    real = torch.zeros(n, dtype=torch.bool)
    real[pos[0]] = True
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool)) & real[None, :]  # [q, k]
    with torch.no_grad():
        oracle = model(input_ids=full, attention_mask=keep[None, None]).logits[0, pos[0]]  # [T, V]
        got = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos).logits[0]
        unmasked = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # as in training
        loss = causal_lm_loss(model, {"input_ids": ids, "position_ids": pos})
    torch.testing.assert_close(got, oracle, rtol=0, atol=1e-5)
    expected = torch.nn.functional.cross_entropy(oracle[:-1], ids[0, 1:])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    second = slice(s.lengths[0], T)
    assert (unmasked[second] - oracle[second]).abs().max() > 1e-3  # the pitfall the mask avoids


# ---- the default sampling against the authors' code ---------------------------------------------

def authors_pose(ids, scaled_max_position_embeddings, model_max_position_embeddings, random):
    """dwzhu-pku/PoSE src/train_pose.py ``train_preprocess_function_pose`` (commit a3d4ba8) for one
    already tokenized document ``ids`` (their loop body, unchanged but for the tokenizer call, which
    cut the document at 5T tokens: the caller passes at most 5T ids). ``random``: anything with
    ``randint(a, b)`` (both ends included)."""
    len_chunk = min(len(ids), model_max_position_embeddings)
    len_input = len(ids)
    lt1 = 0
    rt1 = random.randint(1, (len_chunk + 1) // 2)
    rt2 = random.randint(lt1 + len_chunk, len_input)
    lt2 = rt2 - (len_chunk - (rt1 - lt1))
    chunked_ids = ids[lt1:rt1] + ids[lt2:rt2]
    pos_ids = torch.arange(len(chunked_ids), dtype=torch.long)
    len_pos_ids = len(pos_ids)
    lt = 0
    rt = random.randint(lt, scaled_max_position_embeddings - len_pos_ids)
    pos_ids[:rt1 - lt1] += lt
    pos_ids[rt1 - lt1:] += rt
    return chunked_ids, pos_ids


class NumpyRandint:
    """Python's ``random.randint`` on a numpy Generator: the same draws the library makes."""

    def __init__(self, rng):
        self.rng = rng

    def randint(self, a, b):
        return int(self.rng.integers(a, b + 1))


@pytest.mark.parametrize("T,L,span", [(128, 512, 640), (128, 512, 300), (2048, 16384, 10240), (2, 9, 10), (3, 4, 3)])
def test_authors_sampling_is_their_function_draw_for_draw(T, L, span):
    """Same Generator state → the same example: token for token and position for position."""
    ids = list(range(span))  # a document of `span` tokens: its token ids are the content indices
    for seed in range(300):
        got = sample_pose(T, L, np.random.default_rng(seed), span=span)
        chunked, pos = authors_pose(ids, L, T, NumpyRandint(np.random.default_rng(seed)))
        assert got.content_index.tolist() == chunked
        assert got.position_ids.tolist() == pos.tolist()
    assert source_span(T, L) == 5 * T  # their tokenizer's max_length=model_max_position_embeddings*5


def _ks(a, b) -> float:
    """Two-sample Kolmogorov–Smirnov statistic D of integer samples."""
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


@pytest.mark.parametrize("sampling,passes", [("authors", True), ("paper", False)])
def test_sampled_distributions_match_the_authors_code_run_with_pythons_random(sampling, passes):
    """Their function driven by Python's own ``random`` (independent of the library's RNG) against
    ours: two-sample KS on the first chunk's length l_0, the skip u_1 and the text offset v_1, and
    the share of tokens in the skipped chunk. n = 20000 each: D's critical value at α = 1e-6 is
    about 2.7·√(2/n) = 0.027. The paper's (ropescale's former) sampling must fail (D ≈ 0.5 on l_0)."""
    T, L, n = 128, 512, 20000
    S = 5 * T
    rnd, ids = random.Random(12345), list(range(S))
    theirs = {"l0": [], "u1": [], "v1": []}
    for _ in range(n):
        chunked, pos = authors_pose(ids, L, T, rnd)
        l0 = int(np.flatnonzero(np.diff(pos.numpy()) != 1)[0]) + 1 if (np.diff(pos.numpy()) != 1).any() else None
        # a zero skip leaves no jump in the positions; read l_0 from the text, which always jumps unless rt2 = T
        jumps = np.flatnonzero(np.diff(chunked) != 1)
        if l0 is None:
            l0 = int(jumps[0]) + 1 if len(jumps) else None
        if l0 is None:  # neither jumps (u_1 = 0 and v_1 = 0, p ≈ 1e-5): l_0 unreadable, skip the draw
            continue
        theirs["l0"].append(l0)
        theirs["u1"].append(int(pos[-1]) - (T - 1))
        theirs["v1"].append(chunked[-1] - (T - 1))
    rng = np.random.default_rng(7)
    ours = {"l0": [], "u1": [], "v1": []}
    for _ in range(n):
        s = sample_pose(T, L, rng, span=S, sampling=sampling)
        ours["l0"].append(s.lengths[0])
        ours["u1"].append(s.skips[1])
        ours["v1"].append(int(s.content_index[-1]) - (T - 1))
    d = {k: _ks(np.array(theirs[k]), np.array(ours[k])) for k in theirs}
    shifted = {"theirs": 1 - np.mean(theirs["l0"]) / T, "ours": 1 - np.mean(ours["l0"]) / T}
    if passes:
        assert max(d.values()) < 0.027, d
        assert abs(shifted["theirs"] - shifted["ours"]) < 0.01 and abs(shifted["theirs"] - 0.75) < 0.01, shifted
    else:
        assert d["l0"] > 0.4, d  # uniform over 1 … T−1 against 1 … T/2
        assert abs(shifted["ours"] - 0.5) < 0.01, shifted

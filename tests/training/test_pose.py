"""PoSE (arXiv:2309.10400 §3.2): properties of the position ids, the paper's cumulative skip
distribution, coverage of relative distances, and chunks that really attend to each other."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from ropescale.training.loop import causal_lm_loss
from ropescale.training.pose import chunk_lengths, sample_pose
from tests.conftest import build, tiny_llama_config


@settings(max_examples=300, deadline=None)
@given(T=st.integers(1, 64), extra=st.integers(1, 300), chunks=st.integers(1, 5),
       content=st.sampled_from(["random", "aligned", "contiguous"]), seed=st.integers(0, 2**31), slack=st.integers(0, 50))
def test_position_ids_properties(T, extra, chunks, content, seed, slack):
    chunks = min(chunks, T)
    L = T + extra
    span = L + slack
    s = sample_pose(T, L, np.random.default_rng(seed), chunks=chunks, content=content, span=span)
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
        s = sample_pose(T, L, rng, chunks=3, content="contiguous")
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
        p = sample_pose(T, L, rng).position_ids
        seen |= set((p[:, None] - p[None, :]).flatten().tolist())
    assert set(range(1, L)) <= seen  # every distance 1 … L−1, although each example has only T tokens


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 16, "target_length": 16}, "above the training window"),
    ({"window": 4, "target_length": 16, "chunks": 5}, "cannot split"),
    ({"window": 4, "target_length": 16, "content": "aligned", "span": 8}, "shorter than 16"),
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

"""Truncation rules' relative positions against the rules written out per (i, j); Dual Chunk
Attention's and STRING's position maps against the papers' figures and formulas, their
defaults, temperatures and refusals (moved from tests/test_dca_string.py)."""

import math

import pytest
import torch

import ropescale
from ropescale.strategies import get_strategy
from ropescale.strategies.relative import dca, leaky_rerope, rerope, self_extend, string
from tests.families import family_model

POS = torch.arange(40).float()[None]


def matrix(rule):
    return rule.relative_positions(POS, POS)[0]


def check(rule, expected):
    got = matrix(rule)
    for i in range(40):
        for j in range(i + 1):
            assert got[i, j].item() == pytest.approx(expected(i, j)), (i, j)


@pytest.mark.parametrize("w", [1, 7, 16, 100])
def test_rerope_clips_at_window(w):
    check(rerope(w), lambda i, j: min(i - j, w))


@pytest.mark.parametrize("w,k", [(8, 16.0), (10, 2.5)])
def test_leaky_rerope_leaks_past_window(w, k):
    check(leaky_rerope(w, k, None, 64), lambda i, j: i - j if i - j < w else w + (i - j - w) / k)


def test_leaky_rerope_target_length_maps_longest_distance_to_training_window():
    rule = leaky_rerope(16, None, 256.0, 64)  # k = (255 - 16) / (63 - 16)
    far = rule.relative_positions(torch.tensor([[255.0]]), torch.tensor([[0.0]]))
    assert far.item() == pytest.approx(63.0)
    with pytest.raises(ValueError, match="no room"):
        leaky_rerope(64, None, 256.0, 64)
    with pytest.raises(ValueError, match="not both"):
        get_strategy("leaky_rerope").validate({"k": 2.0, "target_length": 100})


@pytest.mark.parametrize("g,w", [(4, 8), (8, 16), (3, 10)])
def test_self_extend_groups_far_positions(g, w):
    check(self_extend(g, w), lambda i, j: i - j if i - j < w else i // g - j // g + w - w // g)


def test_window_defaults_to_half_the_training_window_in_sweeps():
    assert get_strategy("rerope").resolve({}, length=4096, train_length=128)["window"] == 64
    assert get_strategy("rerope").validate({})["window"] == 512


# --- the papers' position maps, written per (i, j) with Python integers -------------------------

def dca_pair(i: int, j: int, chunk_size: int, local_window: int) -> tuple[int, int]:
    """(query position, key position) of Dual Chunk Attention for query i, key j ≤ i (An et al.
    2024 §3, as ChunkLlama's chunkllama_attn_replace.py places them): chunks of c = chunk_size −
    local_window; keys at j mod c; queries at i mod c (same chunk), min(i mod c + c, chunk_size)
    (previous chunk), min(2c − 1, chunk_size) (earlier chunks)."""
    c = chunk_size - local_window
    gap = i // c - j // c
    q = i % c if gap == 0 else min(i % c + c, chunk_size) if gap == 1 else min(2 * c - 1, chunk_size)
    return q, j % c


def string_pair(i: int, j: int, shifted_offset: int, local_window: int) -> tuple[int, int]:
    """STRING (An et al. 2024, arXiv:2410.18745, Fig. 1b): p = i − j below S, i − j − S + W from S."""
    return (i, j) if i - j < shifted_offset else (i - shifted_offset + local_window, j)


def test_dca_positions_match_the_papers_figure():
    """The paper's example (pretraining length 10, chunk length s = 6, w = 4 exact successive
    positions: successive queries at 6, 7, 8, 9, 9, 9 and inter queries at 9) is chunk_size = 9,
    local_window = 3 in ChunkLlama's parametrisation (chunk length = chunk_size − local_window)."""
    rule = dca(9, 3, 1.0, False, 12)
    pos = torch.arange(18.0)[None]
    p = rule.relative_positions(pos, pos)[0]
    assert [p[6 + r, 0].item() for r in range(6)] == [6, 7, 8, 9, 9, 9]  # successive: key 0 at 0
    assert [p[12 + r, 3].item() for r in range(6)] == [6, 6, 6, 6, 6, 6]  # inter: queries at 9, key at 3
    assert [p[15, j].item() for j in range(12, 16)] == [3, 2, 1, 0]  # intra: exact
    assert p.max().item() == 9  # never beyond the largest trained position used


def test_string_positions_match_the_papers_figure():
    """Fig. 1b: S = 42K, W = 128, L = 128K: distance 42K − 1 stays, 42K becomes 128 and the
    largest, 128K − 1, becomes 86K + 127."""
    k = 1024
    rule = string(42 * k, 128, None, 128 * k)
    q = torch.tensor([[42 * k - 1.0, 42 * k, 128 * k - 1.0]])
    got = rule.relative_positions(q, torch.zeros(1, 1))[0, :, 0]
    assert got.tolist() == [42 * k - 1, 128, 86 * k + 127]


@pytest.mark.parametrize("chunk_size,local_window", [(9, 3), (24, 4), (10, 0), (7, 6)])
def test_dca_map_is_the_papers_formula_everywhere(chunk_size, local_window):
    rule = dca(chunk_size, local_window, 1.0, False, 64)
    pos = torch.arange(60.0)[None]
    p = rule.relative_positions(pos, pos)[0]
    for i in range(60):
        for j in range(i + 1):
            a, b = dca_pair(i, j, chunk_size, local_window)
            assert p[i, j].item() == a - b, (i, j)


@pytest.mark.parametrize("s,w", [(20, 3), (5, 0), (30, 29)])
def test_string_map_is_the_papers_formula_everywhere(s, w):
    p = string(s, w, None, 64).relative_positions(torch.arange(60.0)[None], torch.arange(60.0)[None])[0]
    for i in range(60):
        for j in range(i + 1):
            a, b = string_pair(i, j, s, w)
            assert p[i, j].item() == a - b, (i, j)


def test_defaults_are_the_authors():
    assert get_strategy("dca").validate({}) == {"chunk_size": None, "local_window": None, "scale": 1.0,
                                               "vllm_temperature": False}
    rule = dca(None, None, 1.0, False, 4096)  # ChunkLlama: chunk_size 3T/4 = 3072, local_window T/8 = 512
    pos = torch.tensor([[10_000.0]])
    c = 3072 - 512
    assert rule.relative_positions(pos, torch.tensor([[0.0]])).item() == 3072  # inter: min(2c − 1, 3072) − 0
    assert rule.relative_positions(pos, torch.tensor([[10_000.0 - c]])).item() == min(10_000 % c + c, 3072) - (
        (10_000 - c) % c)
    s = string(None, None, None, 131072)  # the authors' S = int(0.33 L), W = 128, factor 0.1 ln 2 + 1
    assert s.window == int(0.33 * 131072)
    assert s.relative_positions(torch.tensor([[131071.0]]), torch.zeros(1, 1)).item() == 131071 - 43253 + 128
    assert s.attention_factor == pytest.approx(0.1 * math.log(2) + 1)


def test_temperatures():
    assert dca(24, 4, 1.0, False, 32).attention_factor == 1.0
    assert dca(24, 4, 8.0, False, 32).attention_factor == pytest.approx(0.05 * math.log(8) + 1)  # ChunkLlama
    assert dca(24, 4, 8.0, True, 32).attention_factor == pytest.approx(0.1 * math.log(8) + 1)  # vLLM
    assert get_strategy("dca").resolve({}, length=512, train_length=128)["scale"] == 4.0  # a sweep: L / T


@pytest.mark.parametrize("strategy,params,match", [
    ("dca", {"chunk_size": 8, "local_window": 8}, "below chunk_size"),
    ("string", {"shifted_offset": 8, "local_window": 8}, "below shifted_offset"),
])
def test_bad_sizes_are_one_line(strategy, params, match):
    model = family_model("llama")
    with pytest.raises(ValueError, match=match):
        ropescale.patch(model, strategy, **params)


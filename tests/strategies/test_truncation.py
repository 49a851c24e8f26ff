"""Truncation rules' relative positions against the rules written out per (i, j)."""

import pytest
import torch

from ropescale.strategies import get_strategy
from ropescale.strategies.truncation import leaky_rerope, rerope, self_extend

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

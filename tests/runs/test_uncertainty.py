"""Uncertainty: the block bootstrap of perplexity against the normal approximation written out by hand and
against degenerate cases; the block sums ``window_nll(block=…)`` keeps against a plain per-token loop;
Wilson's interval against published values."""

import math

import pytest
import torch
import torch.nn.functional as F

from ropescale.runs.scoring import combine_windows, window_nll
from ropescale.runs.uncertainty import block_bootstrap_ppl, wilson
from ropescale.runs.windows import make_windows


def test_wilson_equals_published_values():
    # Brown, Cai & DasGupta (2001), Table: x = 0 of n = 20 → (0, 0.161); Newcombe (1998) example 81/263
    assert wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_the_bootstrap_interval_matches_the_normal_approximation_on_independent_blocks():
    g = torch.Generator().manual_seed(3)
    m, size = 400, 64
    mean_nll = 2.0 + 0.5 * torch.randn(m, generator=g, dtype=torch.float64)  # per-token NLL of each block
    nll, tokens = mean_nll * size, torch.full((m,), float(size), dtype=torch.float64)
    low, high = block_bootstrap_ppl(nll, tokens, resamples=4000, seed=1)
    # by hand: equal blocks, so the mean NLL is a plain mean of m independent block means
    centre, se = float(mean_nll.mean()), float(mean_nll.std()) / math.sqrt(m)
    want = (math.exp(centre - 1.959964 * se), math.exp(centre + 1.959964 * se))
    assert low == pytest.approx(want[0], rel=0.01) and high == pytest.approx(want[1], rel=0.01)
    assert low < math.exp(centre) < high


def test_identical_blocks_give_a_point_and_too_few_blocks_give_none():
    nll, tokens = torch.full((50,), 64 * 1.5, dtype=torch.float64), torch.full((50,), 64.0, dtype=torch.float64)
    low, high = block_bootstrap_ppl(nll, tokens)
    assert low == pytest.approx(math.exp(1.5)) and high == pytest.approx(math.exp(1.5))
    assert block_bootstrap_ppl(nll[:1], tokens[:1]) is None
    # blocks with no scored token (a sliding window's context) do not count
    assert block_bootstrap_ppl(torch.tensor([3.0, 0.0]), torch.tensor([2.0, 0.0])) is None


def test_the_interval_is_reproducible_and_widens_with_fewer_blocks():
    g = torch.Generator().manual_seed(0)
    nll = (2.0 + torch.rand(256, generator=g, dtype=torch.float64)) * 32
    tokens = torch.full((256,), 32.0, dtype=torch.float64)
    many = block_bootstrap_ppl(nll, tokens, seed=5)
    assert many == block_bootstrap_ppl(nll, tokens, seed=5)
    few = block_bootstrap_ppl(nll[:16], tokens[:16], seed=5)
    assert few[1] - few[0] > 2 * (many[1] - many[0])


@torch.no_grad()
def _token_nll(model, doc, w):
    """Per-token NLL of a window's targets by hand, full logits in float64: ``[n-1]``."""
    ids = doc[w.start:w.end]
    logp = F.log_softmax(model(ids[None]).logits[0].double(), -1)  # [n, V]
    return -logp[:-1].gather(-1, ids[1:, None])[:, 0]


def test_block_sums_are_the_per_token_nll_of_consecutive_targets(tiny_llama):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (150, 90)]
    windows = make_windows([len(d) for d in docs], 40)
    parts = window_nll(tiny_llama, docs, windows, length=40, buckets=4, block=16)
    score = combine_windows(parts, 40, 4, blocks=True)
    want_nll, want_tok = [], []
    for w in windows:
        per = _token_nll(tiny_llama, docs[w.doc], w)  # targets at window index 1 … 39
        for k in range(3):  # blocks of targets [1, 17), [17, 33), [33, 40)
            want_nll.append(float(per[16 * k: 16 * (k + 1)].sum()))
            want_tok.append(min(16, 39 - 16 * k))
    assert score.block_tokens.tolist() == want_tok
    assert score.block_nll.tolist() == pytest.approx(want_nll, rel=1e-5)
    assert float(score.block_nll.sum()) == pytest.approx(score.nll, rel=1e-9)  # the blocks partition the targets
    plain = combine_windows(window_nll(tiny_llama, docs, windows, length=40, buckets=4), 40, 4)
    assert plain.nll == pytest.approx(score.nll, rel=1e-12) and plain.ppl_interval() is None
    low, high = score.ppl_interval()
    assert low < math.exp(score.mean_nll) < high

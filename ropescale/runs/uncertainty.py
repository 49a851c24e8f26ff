"""Uncertainty of a measured number: a block bootstrap for perplexity, Wilson's interval for a success rate.

Perplexity is a ratio of sums over correlated tokens (neighbouring tokens share their context), so its
interval comes from a **block bootstrap** (Künsch 1989; Efron & Tibshirani 1993 §8.6): the scored tokens
are cut into blocks of consecutive tokens (``ci_block`` of a window's positions), the blocks are drawn
with replacement ``resamples`` times, and each draw gives exp(Σ NLL / Σ tokens); the interval is the
2.5th and 97.5th percentiles of those draws (the percentile interval). Blocks long against the reach of
the correlation keep it inside a block; what varies across documents is covered only as far as the
measured windows span documents — a cell of one 32k window describes that window's text.

A success rate (retrieval accuracy) gets the **Wilson score interval** (Wilson 1927; Brown, Cai &
DasGupta 2001), which stays inside [0, 1] and keeps its coverage at few trials.

Shapes: m = blocks, R = resamples.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BOOTSTRAP_RESAMPLES", "Z95", "block_bootstrap_ppl", "wilson"]

Z95 = 1.959963984540054  # standard normal quantile at 0.975
BOOTSTRAP_RESAMPLES = 2000


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval ``(low, high)`` for ``successes`` out of ``trials``.

    Raises ``ValueError`` for no trials."""
    if trials <= 0:
        raise ValueError("wilson interval needs at least one trial")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def block_bootstrap_ppl(nll: torch.Tensor, tokens: torch.Tensor, *, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of the perplexity exp(Σ nll / Σ tokens) under a bootstrap over blocks.

    Args:
        nll: summed NLL of each block ``[m]`` [nats].
        tokens: scored tokens of each block ``[m]`` (blocks with none are left out).
        resamples: bootstrap draws R.
        seed: the draws' seed (the interval is reproducible).
        level: the interval's coverage.

    Returns:
        ``(low, high)``, or None with fewer than two blocks (no spread to resample).
    """
    keep = tokens > 0
    nll, tokens = nll[keep].double(), tokens[keep].double()
    m = int(nll.numel())
    if m < 2:
        return None
    gen = torch.Generator().manual_seed(seed)
    step = max(1, (1 << 22) // m)  # draws per batch: at most ~4M indices in memory at once
    ppl = []
    for start in range(0, resamples, step):
        draws = torch.randint(0, m, (min(step, resamples - start), m), generator=gen)  # [r, m] with replacement
        ppl.append((nll[draws].sum(1) / tokens[draws].sum(1)).exp())  # [r]
    ppl = torch.cat(ppl)  # [R]
    tail = (1 - level) / 2
    low, high = torch.quantile(ppl, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high

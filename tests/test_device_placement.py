"""Every tensor an attention path makes for itself lives on its inputs' device. Measured on an H100 (issue 31):
the naive oracle built its causal mask on the CPU, so every CUDA oracle check failed with "expected self and
mask to be on the same device". Here the inputs sit on the meta device: a helper tensor made on the CPU
meets them and fails the same way, on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from ropescale.attention.truncated import blocked_attention, naive_attention
from ropescale.strategies import get_strategy


@pytest.mark.parametrize("path", [naive_attention, blocked_attention])
@pytest.mark.parametrize("rule", ["rerope", "dca"])
@pytest.mark.parametrize("padded", [False, True])
def test_the_path_makes_its_masks_on_the_inputs_device(path, rule, padded):
    strat = get_strategy(rule)
    params = strat.validate({"window": 8} if rule == "rerope" else {"chunk_size": 12, "local_window": 2})
    r = strat.compute({"dim": 16, "rope_theta": 1e4, "original_max_position_embeddings": 16}, params)
    meta = torch.device("meta")
    q = torch.empty(2, 4, 20, 16, device=meta)
    k = v = torch.empty(2, 2, 20, 16, device=meta)
    pos = torch.arange(20, device=meta).float()[None].expand(2, -1)
    keep = torch.ones(2, 1, 1, 20, dtype=torch.bool, device=meta) if padded else None
    out = path(q, k, v, pos, pos, r, torch.ones(8, device=meta), 1.0, keep=keep, scale=0.25)
    assert out.device == meta and out.shape == (2, 4, 20, 16)

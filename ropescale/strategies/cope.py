"""CoPE: clipped RoPE — the lowest frequencies softly clipped toward zero.

Notation: d = rotary dim, b = ``rope_theta``, θ_i = b^(−2i/d) [radians per token], λ_i = 2π/θ_i its
wavelength [tokens], T = ``original_max_position_embeddings``, n = d/2 pairs, c = ``clip``.

Pairs whose wavelength exceeds the training window never turn a full period in training, and past it
their angles leave the range the model saw; CoPE multiplies the last c frequencies by a raised-cosine
(Hann) taper, 1 at the boundary pair down to 0 at the slowest, instead of a hard cut (which leaks
spectrally: oscillating attention over distance).
"""

from __future__ import annotations

import math

import torch

from ropescale.strategies.frequency import rope_inv_freq
from ropescale.strategies.registry import Param, RopeFrequencies, register

__all__ = ["cope", "cope_taper"]

CLIP = Param("clip", None, kind=int, low=0, high=512,
             help="pairs clipped, slowest first; default: those whose wavelength 2π/θ_i exceeds T")


def cope_taper(n: int, clip: int) -> torch.Tensor:
    """The multiplier of each pair's frequency ``[n]`` float32: 1 for the first n − c pairs, then
    0.5·(1 + cos t) for t = 0 … π in c even steps (the authors' ``smooth_mask``), c = min(``clip``, n)."""
    clip = min(clip, n)
    mask = torch.ones(n, dtype=torch.float32)
    if clip > 0:
        mask[n - clip:] = 0.5 * (1.0 + torch.cos(torch.linspace(0.0, math.pi, steps=clip, dtype=torch.float32)))
    return mask


@register("cope", params=(CLIP,),
          source="Li et al. 2026, CoPE: Clipped RoPE, arXiv:2602.05258 (github.com/hrlics/CoPE modeling_cope.py "
                 "@ ed52ba5)")
def cope(dim: int, rope_theta: float, original_max_position_embeddings: int, clip: int | None) -> RopeFrequencies:
    """θ_i × taper_i (``cope_taper``), attention factor 1. ``clip`` None: the pairs with λ_i > T
    (the authors fix c = 20 of 64 for Llama 3 8B, whose window leaves 29 such pairs)."""
    theta = rope_inv_freq(dim, rope_theta)
    if clip is None:
        clip = int((2 * math.pi / theta.double() > original_max_position_embeddings).sum())
    return RopeFrequencies(theta * cope_taper(theta.numel(), clip), 1.0)

"""DPE: dimension-wise positional embeddings manipulation — SelfExtend with one group size per
group of rotary pairs.

Notation: i, j query and key positions [tokens], W the neighbour window [tokens], P = d/2 rotary
pairs cut into G = 8 contiguous groups (group g = pairs f with ⌊f·G/P⌋ = g: 8 groups of 8 for a
128-dim head, group 0 the fastest pairs), s_g the scale of group g.

Inside the window (i − j < W) every pair sees the true distance; from W on, pair group g sees

    p_g(i, j) = ⌊i/s_g⌋ − ⌊j/s_g⌋ + W − W/s_g,

queries at ⌊i/s_g⌋ + W − W/s_g and keys at ⌊j/s_g⌋ per group, the two regions merged by
log-sum-exp (``ropescale.attention.regions``): one region kernel whose far region turns each
pair by its own group's position (``RelativeRule.groups``).

Source: "Effective Length Extrapolation via Dimension-Wise Positional Embeddings Manipulation" (DPE,
COLM 2025), arXiv:2504.18857; reference code github.com/LuLuLuyi/DPE
``dpe_for_llama.py::dpe_flash_forward`` @ 46b85de (no licence file: read, not copied), defaults
``config/dpe_config.yaml`` (W = 1024 and the scales below, found per model by a needle sweep per
group). Their prefill computes W − W/s_g in floating point and their decoding W − ⌊W/s_g⌋; the two
agree whenever s_g divides W, as in every published setting, and ropescale follows the prefill.
Not implemented: their optional top-k dimension selection (only the 48 pairs with the largest
‖q‖·‖k‖ per head scaled, from a per-model file; off in their quick start).
"""

from __future__ import annotations

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register
from ropescale.strategies.relative import Region, RelativeRule

__all__ = ["DPE_PRESETS", "dpe", "dpe_scales"]

GROUPS = 8  # pair groups: the authors' dimension_groups_range [0, 8, …, 64] of a 128-dim head

DPE_PRESETS: dict[str, tuple[int, ...]] = {  # config/dpe_config.yaml @ 46b85de: scale_factors per model
    "llama3.1-8b": (2, 32, 32, 2, 2, 2, 2, 1),  # Meta-Llama-3.1-8B-Instruct
    "llama3-8b": (2, 8, 2, 8, 32, 32, 32, 4),  # Meta-Llama-3-8B-Instruct
    "qwen2.5-7b": (2, 16, 8, 8, 32, 8, 2, 4),  # Qwen2.5-7B-Instruct
    "mistral-7b": (4, 16, 2, 16, 32, 16, 16, 2),  # Mistral-7B-Instruct-v0.2
}


def _scale(g: int) -> Param:
    return Param(f"scale_{g}", None, kind=int, low=1, high=1024, log=True,
                 help=f"s_{g}: group size of pair group {g} (of 8, the fastest pairs first) beyond the window; "
                      "default the preset's")


def dpe_scales(preset: str, given: list[int | None]) -> list[int]:
    """The 8 group sizes s_g: each given one, else the preset's (``DPE_PRESETS``).

    Args:
        preset: a key of ``DPE_PRESETS``.
        given: 8 entries, None where not given.

    Returns:
        The 8 scales, group 0 (fastest pairs) first.
    """
    if preset not in DPE_PRESETS:
        raise InvalidInput(f"dpe: preset={preset!r}; choose one of {', '.join(DPE_PRESETS)}")
    return [DPE_PRESETS[preset][g] if s is None else int(s) for g, s in enumerate(given)]


@register("dpe", kind="attention", params=(
    Param("window", 1024, kind=int, low=1, high=2**24, log=True,
          help="W: distances below W are exact in every pair [tokens]; the authors' 1024"),
    Param("preset", "llama3.1-8b", kind=str, choices=tuple(DPE_PRESETS),
          help="the authors' scales for one model (config/dpe_config.yaml); each scale_g given wins"),
    *(_scale(g) for g in range(GROUPS)),
), source="Effective Length Extrapolation via Dimension-Wise Positional Embeddings Manipulation (DPE, COLM "
          "2025), arXiv:2504.18857 (github.com/LuLuLuyi/DPE dpe_for_llama.py::dpe_flash_forward and "
          "config/dpe_config.yaml @ 46b85de)")
def dpe(window: int, preset: str, scale_0: int | None, scale_1: int | None, scale_2: int | None,
        scale_3: int | None, scale_4: int | None, scale_5: int | None, scale_6: int | None,
        scale_7: int | None) -> RelativeRule:
    """DPE: p(i, j) = i − j for i − j < W, else ⌊i/s_g⌋ − ⌊j/s_g⌋ + W − W/s_g in pair group g of 8.

    SelfExtend with one group size per group of rotary pairs (group 0 the fastest): far queries
    at ⌊i/s_g⌋ + W − W/s_g and keys at ⌊j/s_g⌋ ``[b, s, 8]``, so each group's distances continue from
    W at the window's edge; s_g = 1 leaves a group's distances exact. Scales default to the
    preset's (Llama-3.1-8B's [2, 32, 32, 2, 2, 2, 2, 1]).
    """
    scales = dpe_scales(preset, [scale_0, scale_1, scale_2, scale_3, scale_4, scale_5, scale_6, scale_7])
    s = torch.tensor(scales, dtype=torch.float32)  # [8]
    shift = torch.tensor([window - window / g for g in scales], dtype=torch.float64)  # W − W/s_g, [8]

    def far_q(i: torch.Tensor) -> torch.Tensor:  # [b, n] → [b, n, 8]
        return torch.div(i[..., None], s.to(i), rounding_mode="floor") + shift.to(i)

    def far_k(j: torch.Tensor) -> torch.Tensor:
        return torch.div(j[..., None], s.to(j), rounding_mode="floor")

    return RelativeRule((Region(0, window), Region(window, None, far_q, far_k)))

"""Truncation rules: change the relative position attention sees, not the frequencies.

Each rule is one relative-position function p(i, j) of query position i and key position
j ≤ i, split into two regions. Inside the neighbour window (i − j < w) it is the ordinary
i − j. Beyond it, p(i, j) = f_q(i) − f_k(j), so the far region is ordinary RoPE attention with
queries rotated to f_q(i) and keys to f_k(j). That split is what lets ``ropescale.attention``
compute it exactly in O(n) memory.

Positions are in tokens; f_q, f_k map ``[b, s]`` float positions to ``[b, s]`` float positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register

__all__ = ["RelativeRule", "leaky_rerope", "rerope", "self_extend"]

_WINDOW = Param("window", 512, kind=int, low=1, auto="half_train", log=True,
                help="neighbour window w [tokens]; a sweep uses L_train / 2")


@dataclass(frozen=True)
class RelativeRule:
    """p(i, j) = i − j for i − j < ``window``, else ``far_q(i) − far_k(j)``."""

    window: int
    far_q: Callable[[torch.Tensor], torch.Tensor]
    far_k: Callable[[torch.Tensor], torch.Tensor]

    def relative_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The explicit matrix p ``[b, s_q, s_k]`` (for the naive reference path and tests)."""
        near = q_pos[:, :, None] - k_pos[:, None, :]
        far = self.far_q(q_pos)[:, :, None] - self.far_k(k_pos)[:, None, :]
        return torch.where(near < self.window, near, far)


@register("rerope", kind="attention", params=(_WINDOW,),
          source="Su 2023, ReRoPE (kexue.fm/archives/9708; github.com/bojone/rerope)")
def rerope(window: int) -> RelativeRule:
    """ReRoPE: p(i, j) = min(i − j, w): relative positions beyond the window are clipped to w."""
    return RelativeRule(window, lambda i: torch.full_like(i, float(window)), torch.zeros_like)


def _leaky_check(p: dict) -> None:
    if p["k"] is not None and p["target_length"] is not None:
        raise InvalidInput("leaky_rerope: give k or target_length, not both")


@register("leaky_rerope", kind="attention", params=(
    _WINDOW,
    Param("k", None, low=1.0, log=True, help="leak: positions beyond w advance 1/k per token (default 16)"),
    Param("target_length", None, low=2.0, auto=None,
          help="instead of k: longest sequence [tokens], mapped onto L_train"),
), check=_leaky_check, source="Su 2023, Leaky ReRoPE (kexue.fm/archives/9708; github.com/bojone/rerope)")
def leaky_rerope(window: int, k: float | None, target_length: float | None,
                 original_max_position_embeddings: int) -> RelativeRule:
    """Leaky ReRoPE: p(i, j) = i − j for i − j < w, else w + (i − j − w)/k.

    With ``target_length`` L, k = (L − 1 − w)/(L_train − 1 − w), so the largest relative position
    L − 1 lands on L_train − 1 (k ≥ 1). Raises ``ValueError`` when w ≥ L_train − 1 then.
    """
    if target_length is not None:
        room = original_max_position_embeddings - 1 - window
        if room <= 0:
            raise InvalidInput(f"leaky_rerope: window={window} leaves no room below L_train="
                             f"{original_max_position_embeddings} for target_length")
        k = max(1.0, (target_length - 1 - window) / room)
    k = 16.0 if k is None else k
    return RelativeRule(window, lambda i: i / k + window * (1 - 1 / k), lambda j: j / k)


@register("self_extend", kind="attention", params=(
    Param("group_size", 8, kind=int, low=1, log=True, help="G: far positions are floor(position / G)"),
    _WINDOW,
), source="Jin et al. 2024, LLM Maybe LongLM (SelfExtend), arXiv:2401.01325 (github.com/datamllab/LongLM)")
def self_extend(group_size: int, window: int) -> RelativeRule:
    """SelfExtend: p(i, j) = i − j inside the window, else ⌊i/G⌋ − ⌊j/G⌋ + w − ⌊w/G⌋.

    Far queries sit at ⌊i/G⌋ + w − ⌊w/G⌋ and far keys at ⌊j/G⌋, so grouped distances continue
    from w at the window's edge; usable length ≈ (L_train − w)·G + w.
    """
    shift = window - window // group_size
    return RelativeRule(window, lambda i: torch.floor(i / group_size) + shift,
                        lambda j: torch.floor(j / group_size))

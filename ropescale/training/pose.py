"""PoSE: positional skip-wise training (Zhu et al. 2024, arXiv:2309.10400, §3.2).

Train at the original window T and still see every relative distance of the target length L:
the T tokens of a training example are split into N contiguous chunks c_0 … c_{N−1} of lengths
l_0 … l_{N−1} (Σ l_i = T), and the position ids of chunk i are shifted by a *skipping bias* u_i:

    Pos(c_i) = {u_i + st_i, …, u_i + st_i + l_i − 1},   st_i = Σ_{j<i} l_j            (paper eq. 3–4)
    u_0 = 0,   u_i ~ U({u_{i−1}, …, L − T})  for i ≥ 1                                (cumulative)

so position ids are strictly increasing, start at 0 and stay below L, and distances up to L − 1
occur. The chunk lengths are re-drawn per example too (the paper alters "these bias terms, as
well as the length of each chunk" per example; here uniformly over the compositions of T into N
positive parts). The text of chunk i is read from a source span x of ``span`` ≥ T tokens at

    c_i = x[v_i + st_i : v_i + st_i + l_i]                                              (paper eq. 5)

with ``content``: ``"random"`` — v_0 = 0, v_i ~ U({v_{i−1}, …, span − T}) (the paper's default),
``"aligned"`` — v_i = u_i (its ablation; text skipped exactly as positions are, so ``span`` ≥ L),
``"contiguous"`` — v_i = 0 (its other ablation: the first T tokens, uninterrupted). The paper
measured little difference between the three (its Table 4).

Shapes: T = ``window`` tokens of one example; all outputs are 1-D ``[T]`` int64.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

__all__ = ["PoseSample", "CONTENT_MODES", "sample_pose", "chunk_lengths", "skip_biases"]

CONTENT_MODES = ("random", "aligned", "contiguous")


class PoseSample(NamedTuple):
    """One PoSE example.

    position_ids: ``[T]`` int64, strictly increasing, first 0, last < ``target_length``.
    content_index: ``[T]`` int64, where in the source span each token is read (strictly increasing,
        < ``span``).
    lengths: the chunk lengths l_i (sum T).
    skips: the skipping biases u_i (u_0 = 0, non-decreasing, ≤ L − T).
    """

    position_ids: torch.Tensor
    content_index: torch.Tensor
    lengths: tuple[int, ...]
    skips: tuple[int, ...]


def chunk_lengths(window: int, chunks: int, rng: np.random.Generator) -> list[int]:
    """N positive chunk lengths summing to ``window`` (T), uniform over such compositions:
    N − 1 distinct cut points drawn from {1, …, T − 1}. Raises ``ValueError`` when N > T."""
    if not 1 <= chunks <= window:
        raise ValueError(f"PoSE: {chunks} chunks cannot split a window of {window} tokens (need 1 ≤ chunks ≤ T)")
    cuts = np.sort(rng.choice(np.arange(1, window), size=chunks - 1, replace=False)) if chunks > 1 else []
    edges = [0, *map(int, cuts), window]
    return [b - a for a, b in zip(edges, edges[1:])]


def skip_biases(chunks: int, max_skip: int, rng: np.random.Generator) -> list[int]:
    """u_0 = 0 and u_i ~ U({u_{i−1}, …, ``max_skip``}) (uniform over the integers, both ends
    included): the paper's cumulative skipping biases, max_skip = L − T."""
    skips = [0]
    for _ in range(chunks - 1):
        skips.append(int(rng.integers(skips[-1], max_skip + 1)))
    return skips


def sample_pose(window: int, target_length: int, rng: np.random.Generator, *, chunks: int = 2,
                content: Literal["random", "aligned", "contiguous"] = "random", span: int | None = None) -> PoseSample:
    """Draw one PoSE example (arXiv:2309.10400 §3.2): chunk lengths, skipping biases u_i and text
    offsets v_i (see the module docstring).

    Args:
        window: T, the original training window [tokens] (tokens the model sees per example).
        target_length: L > T, the context length to extend to [tokens].
        rng: numpy ``Generator`` (seed it per example for a reproducible data order).
        chunks: N, the chunk count (paper: 2).
        content: how the text of each chunk is chosen: ``random`` / ``aligned`` / ``contiguous``.
        span: tokens available in the source text (default L); ≥ T, and ≥ L for ``aligned``.

    Raises ``ValueError`` for L ≤ T, N outside 1 … T, an unknown ``content`` or a too-short span.
    """
    span = target_length if span is None else span
    if target_length <= window:
        raise ValueError(f"PoSE: target length {target_length} must be above the training window T = {window}")
    if content not in CONTENT_MODES:
        raise ValueError(f"PoSE: content {content!r}; choose one of {', '.join(CONTENT_MODES)}")
    need = target_length if content == "aligned" else window
    if span < need:
        raise ValueError(f"PoSE: a source span of {span} tokens is shorter than {need} (content {content!r})")
    lengths = chunk_lengths(window, chunks, rng)
    skips = skip_biases(chunks, target_length - window, rng)
    if content == "random":
        offsets = skip_biases(chunks, span - window, rng)
    elif content == "aligned":
        offsets = skips
    else:
        offsets = [0] * chunks
    local = np.arange(window)  # st_i + k for token k of chunk i
    chunk_of = np.repeat(np.arange(chunks), lengths)  # [T] chunk index of each token
    position_ids = local + np.asarray(skips)[chunk_of]
    content_index = local + np.asarray(offsets)[chunk_of]
    return PoseSample(torch.from_numpy(position_ids).long(), torch.from_numpy(content_index).long(),
                      tuple(lengths), tuple(skips))

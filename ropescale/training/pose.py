"""PoSE: positional skip-wise training (Zhu et al. 2024, arXiv:2309.10400, §3.2).

Train at the original window T and still see every relative distance of the target length L:
the T tokens of a training example are split into N contiguous chunks c_0 … c_{N−1} of lengths
l_0 … l_{N−1} (Σ l_i = T), and the position ids of chunk i are shifted by a *skipping bias* u_i:

    Pos(c_i) = {u_i + st_i, …, u_i + st_i + l_i − 1},   st_i = Σ_{j<i} l_j            (paper eq. 3–4)

so position ids are strictly increasing, start at 0 and stay below L, and distances up to L − 1
occur. The text of chunk i is read from a source span x of S ≥ T tokens (one document of the
packed stream, ``ropescale.training.data``) at

    c_i = x[v_i + st_i : v_i + st_i + l_i]                                              (paper eq. 5)

Two ways to draw l_i, u_i, v_i (``sampling``); they differ in how the T tokens are split:

- ``"authors"`` (the default): what the authors' training code does — GitHub dwzhu-pku/PoSE,
  ``src/train_pose.py``, ``train_preprocess_function_pose`` (commit a3d4ba8). Exactly N = 2
  chunks; with T = ``model_max_position_embeddings``, L = ``scaled_max_position_embeddings`` and
  each document tokenized to at most S = 5T tokens (``max_length=model_max_position_embeddings*5``)::

      rt1 = random.randint(1, (T + 1) // 2)        # l_0 ~ U{1, …, ⌈T/2⌉}, l_1 = T − l_0
      rt2 = random.randint(T, S)                   # v_1 = rt2 − T ~ U{0, …, S − T}  (v_0 = 0)
      rt  = random.randint(0, L - T)               # u_1 ~ U{0, …, L − T}            (u_0 = 0)

  (``random.randint`` includes both ends; the code draws in this order, and so does ours, from a
  numpy ``Generator``: ``rng.integers(a, b + 1)``). The first chunk is at most half the window, so
  on average 3/4 of the tokens sit at skipped positions. Source span S = 5T (the whole span when a
  document is shorter). The code's earlier revision also drew u_0; it is fixed at 0 there ("makes
  the coverage possibility more uniform for large relative positions").
- ``"paper"``: the paper's description (§3.2 and App. B), any N: the lengths uniform over the
  compositions of T into N positive parts (N − 1 distinct cut points in {1, …, T − 1}; for N = 2,
  l_0 ~ U{1, …, T − 1}: half the tokens skipped on average), and cumulative skips
  ``u_0 = 0, u_i ~ U({u_{i−1}, …, L − T})``; text offsets likewise ``v_i ~ U({v_{i−1}, …, S − T})``
  with S = L. This was ropescale's sampling before the authors' became the default.

``content`` picks the text of each chunk: ``"random"`` — the v_i above (both the paper's default
and the code's), ``"aligned"`` — v_i = u_i (the paper's ablation; text skipped exactly as positions
are, so S ≥ L), ``"contiguous"`` — v_i = 0 (its other ablation: the first T tokens). The paper
measured little difference between the three (its Table 4).

Shapes: T = ``window`` tokens of one example; all outputs are 1-D ``[T]`` int64. Units: tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

__all__ = [
    "AUTHORS_SPAN_WINDOWS",
    "CONTENT_MODES",
    "SAMPLINGS",
    "PoseSample",
    "PoseSampler",
    "chunk_lengths",
    "sample_pose",
    "skip_biases",
    "source_span",
]

CONTENT_MODES = ("random", "aligned", "contiguous")
SAMPLINGS = ("authors", "paper")
AUTHORS_SPAN_WINDOWS = 5  # the authors' code reads at most 5T tokens of a document (train_pose.py)


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
    N − 1 distinct cut points drawn from {1, …, T − 1} (``sampling: paper``). Raises
    ``ValueError`` when N > T."""
    if not 1 <= chunks <= window:
        raise ValueError(f"PoSE: {chunks} chunks cannot split a window of {window} tokens (need 1 ≤ chunks ≤ T)")
    cuts = np.sort(rng.choice(np.arange(1, window), size=chunks - 1, replace=False)) if chunks > 1 else []
    edges = [0, *map(int, cuts), window]
    return [b - a for a, b in zip(edges, edges[1:])]


def skip_biases(chunks: int, max_skip: int, rng: np.random.Generator) -> list[int]:
    """u_0 = 0 and u_i ~ U({u_{i−1}, …, ``max_skip``}) (uniform over the integers, both ends
    included): the paper's cumulative skipping biases, max_skip = L − T (``sampling: paper``)."""
    skips = [0]
    for _ in range(chunks - 1):
        skips.append(int(rng.integers(skips[-1], max_skip + 1)))
    return skips


def source_span(window: int, target_length: int, *, sampling: str = "authors", content: str = "random") -> int:
    """S, the tokens of source text one example reads from [tokens]: 5T under ``authors`` (their
    documents are cut at 5T tokens), L under ``paper``; ``aligned`` content needs at least L."""
    span = AUTHORS_SPAN_WINDOWS * window if sampling == "authors" else target_length
    return max(span, target_length) if content == "aligned" else span


def sample_pose(window: int, target_length: int, rng: np.random.Generator, *, chunks: int = 2,
                content: Literal["random", "aligned", "contiguous"] = "random", span: int | None = None,
                sampling: Literal["authors", "paper"] = "authors") -> PoseSample:
    """Draw one PoSE example (arXiv:2309.10400 §3.2): chunk lengths, skipping biases u_i and text
    offsets v_i (see the module docstring).

    Args:
        window: T, the original training window [tokens] (tokens the model sees per example).
        target_length: L > T, the context length to extend to [tokens].
        rng: numpy ``Generator`` (seed it per example for a reproducible data order).
        chunks: N, the chunk count (paper: 2; ``authors``: exactly 2).
        content: how the text of each chunk is chosen: ``random`` / ``aligned`` / ``contiguous``.
        span: tokens available in the source text (default ``source_span``); ≥ T, and ≥ L for
            ``aligned``.
        sampling: ``authors`` (dwzhu-pku/PoSE ``train_preprocess_function_pose``) or ``paper``.

    Raises ``ValueError`` for L ≤ T, N outside 1 … T (or N ≠ 2 with ``authors``), an unknown
    ``content`` or ``sampling``, or a too-short span.
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"PoSE: sampling {sampling!r}; choose one of {', '.join(SAMPLINGS)}")
    span = source_span(window, target_length, sampling=sampling, content=content) if span is None else span
    if target_length <= window:
        raise ValueError(f"PoSE: target length {target_length} must be above the training window T = {window}")
    if content not in CONTENT_MODES:
        raise ValueError(f"PoSE: content {content!r}; choose one of {', '.join(CONTENT_MODES)}")
    need = target_length if content == "aligned" else window
    if span < need:
        raise ValueError(f"PoSE: a source span of {span} tokens is shorter than {need} (content {content!r})")
    if not 1 <= chunks <= window:
        raise ValueError(f"PoSE: {chunks} chunks cannot split a window of {window} tokens (need 1 ≤ chunks ≤ T)")
    if sampling == "authors":
        if chunks != 2:
            raise ValueError(f"PoSE: sampling 'authors' draws exactly 2 chunks (dwzhu-pku/PoSE train_pose.py), "
                             f"not {chunks}; use sampling 'paper' for other chunk counts")
        first = int(rng.integers(1, (window + 1) // 2 + 1))  # rt1
        lengths = [first, window - first]
        offset = int(rng.integers(window, span + 1)) - window if content == "random" else 0  # rt2 − T
        skips = [0, int(rng.integers(0, target_length - window + 1))]  # rt
        offsets = {"random": [0, offset], "aligned": skips, "contiguous": [0, 0]}[content]
    else:
        lengths = chunk_lengths(window, chunks, rng)
        skips = skip_biases(chunks, target_length - window, rng)
        offsets = {"random": skip_biases(chunks, span - window, rng) if content == "random" else None,
                   "aligned": skips, "contiguous": [0] * chunks}[content]
    local = np.arange(window)  # st_i + k for token k of chunk i
    chunk_of = np.repeat(np.arange(chunks), lengths)  # [T] chunk index of each token
    position_ids = local + np.asarray(skips)[chunk_of]
    content_index = local + np.asarray(offsets)[chunk_of]
    return PoseSample(torch.from_numpy(position_ids).long(), torch.from_numpy(content_index).long(),
                      tuple(lengths), tuple(skips))


@dataclass(frozen=True)
class PoseSampler:
    """The PoSE draws of one run: T = ``window``, L = ``target_length``, N = ``chunks``,
    ``content`` and ``sampling`` as in ``sample_pose``. ``span`` is S, the source text per example
    [tokens] (``source_span``): the training stream is cut into spans of S tokens."""

    window: int
    target_length: int
    chunks: int = 2
    content: str = "random"
    sampling: str = "authors"

    @property
    def span(self) -> int:
        """Tokens of source text one PoSE example reads [tokens] (``source_span``)."""
        return source_span(self.window, self.target_length, sampling=self.sampling, content=self.content)

    def draw(self, rng: np.random.Generator, span: int | None = None) -> PoseSample:
        """One example read from a source span of ``span`` tokens (default ``self.span``)."""
        return sample_pose(self.window, self.target_length, rng, chunks=self.chunks, content=self.content,
                           span=self.span if span is None else span, sampling=self.sampling)

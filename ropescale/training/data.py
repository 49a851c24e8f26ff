"""Training examples: windows of the data source's tokens in an order fixed by the seed.

The documents of any source the harness reads (``ropescale.runs.data``: the bundled KJV splits, local
files, HF datasets) are tokenized once and joined into one stream, each followed by the EOS
token (packing, as pre-training does). The stream is cut into non-overlapping spans of ``span``
tokens (L, the target length; with PoSE S, ``PoseSampler.span``: 5T under the authors'
sampling); example i of the run is span ``order_e[i mod n]`` with epoch
e = i // n and ``order_e`` a permutation drawn from ``(seed, e)``. Every run with the same seed,
data and L therefore sees the same spans in the same order — whatever the strategy, the number of
processes, or where a resumed run starts — and example i is a pure function of i.

Without PoSE an example is its whole span: ``input_ids`` ``[L]``. With PoSE it is T tokens of
the span picked by ``ropescale.training.pose.PoseSampler.draw`` with the RNG seeded by
``(seed, 1, i)``, plus their ``position_ids`` ``[T]``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ropescale.runs.data import DataError, DataSpec, load_documents, tokenize_documents
from ropescale.training.pose import PoseSampler

__all__ = ["TrainingWindows", "load_stream", "token_stream"]


def token_stream(docs: list[torch.Tensor], eos_token_id: int | None) -> torch.Tensor:
    """Documents' token ids ``[n_i]`` joined into one stream ``[Σ n_i (+1 each)]`` int64, each
    document followed by ``eos_token_id`` when there is one."""
    sep = [torch.tensor([eos_token_id], dtype=torch.long)] if eos_token_id is not None else []
    return torch.cat([part for d in docs for part in (d.long(), *sep)])


def load_stream(spec: DataSpec, tokenizer) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(stream, documents)`` of a data source (``DataError`` in one line when unreadable)."""
    docs = tokenize_documents(tokenizer, load_documents(spec))
    return token_stream(docs, tokenizer.eos_token_id), docs


class TrainingWindows(Dataset):
    """Example ``i`` of a run (``len`` = examples the run consumes, all epochs included).

    Args:
        stream: token ids ``[N]`` int64.
        span: tokens per span (L; with PoSE ``pose.span``).
        total: examples the run needs (steps × grad_accum × batch_size × processes).
        seed: data order (and PoSE draws).
        pose: the run's ``PoseSampler`` (T, L, chunks, content, sampling), or None.

    Raises ``DataError`` when the stream holds no full span.
    """

    def __init__(self, stream: torch.Tensor, span: int, total: int, seed: int,
                 pose: PoseSampler | None = None):
        self.n = stream.numel() // span
        if self.n == 0:
            raise DataError(f"training data too short: {stream.numel()} tokens, fewer than one window of {span}")
        self.spans = stream[: self.n * span].view(self.n, span)  # [n, L]
        self.span, self.total, self.seed, self.pose = span, total, seed, pose
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.total

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of span indices for ``epoch`` (drawn from ``(seed, epoch)``)."""
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng((self.seed, 0, epoch)).permutation(self.n)
        return self._orders[epoch]

    def span_of(self, i: int) -> int:
        """Which span example ``i`` reads."""
        return int(self.order(i // self.n)[i % self.n])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.total:
            raise IndexError(i)
        ids = self.spans[self.span_of(i)]  # [L]
        if self.pose is None:
            return {"input_ids": ids.clone()}
        sample = self.pose.draw(np.random.default_rng((self.seed, 1, i)), span=self.span)
        return {"input_ids": ids[sample.content_index].clone(), "position_ids": sample.position_ids}

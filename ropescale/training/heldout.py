"""Held-out perplexity during training: the curve of PPL at each length vs optimiser steps.

The harness's own scoring (``ropescale.runs.scoring``): chunk windows of L tokens of the held-out
documents (documents never run into each other), every token but a window's first scored,
PPL = exp(total NLL / scored tokens). At most ``max_windows`` windows per length, evenly spaced
(``ropescale.runs.windows.cap_windows``), fixed for the whole run — so every evaluation of every run with the
same settings scores the same tokens. Launched on several processes, each scores its share and
the parts are added up in window order (the numbers equal one process's).
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import gather_object

from ropescale.runs.data import load_documents, tokenize_documents
from ropescale.runs.scoring import combine_windows, window_nll
from ropescale.runs.windows import make_windows

__all__ = ["HeldOut"]


class HeldOut:
    """Windows of the held-out data at each length, built once.

    Raises ``ropescale.runs.data.DataError`` (unreadable source) or ``ropescale.runs.windows.WindowError`` (a length
    no document fills) when built — before any training.
    """

    def __init__(self, tokenizer, spec, lengths: list[int], *, max_windows: int | None, batch_size: int = 1):
        self.docs = tokenize_documents(tokenizer, load_documents(spec.spec()))
        sizes = [len(d) for d in self.docs]
        self.windows = {L: make_windows(sizes, L, "chunk", max_windows=max_windows) for L in lengths}
        self.batch_size = batch_size
        self.description = spec.spec().describe()

    def tokens(self, length: int) -> int:
        """Scored tokens at ``length`` (L − 1 per window)."""
        return sum(w.end - w.score_from for w in self.windows[length])

    @torch.no_grad()
    def perplexity(self, model, *, device, process_index: int = 0, num_processes: int = 1) -> dict[int, float]:
        """``{length: PPL}`` of ``model`` (put in eval mode for the measurement, then restored)."""
        was_training = model.training
        model.eval()
        out = {}
        try:
            for length, windows in self.windows.items():
                mine = list(range(process_index, len(windows), num_processes))
                parts = window_nll(model, self.docs, [windows[i] for i in mine], length=length,
                                   batch_size=self.batch_size, buckets=1, device=device)
                pieces = list(zip(mine, parts))
                if num_processes > 1:
                    pieces = [p for chunk in gather_object([pieces]) for p in chunk]
                ordered = [part for _, part in sorted(pieces, key=lambda x: x[0])]
                score = combine_windows(ordered, length, 1)
                out[length] = math.exp(score.mean_nll)
        finally:
            model.train(was_training)
        return out

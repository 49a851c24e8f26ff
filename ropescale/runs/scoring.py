"""Score windows with a causal LM: summed next-token NLL, overall and by position bucket.

Shapes: b = windows in a batch, n = tokens in a window, d = hidden size, V = vocabulary.
Memory per batch is O(b·n·d) (the LM head runs in chunks: ``ropescale.lm_head``).
NLL is in nats; perplexity = exp(total NLL / scored tokens) (token-weighted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ropescale.lm_head import OutputHead
from ropescale.runs.windows import Window

__all__ = ["Score", "combine_windows", "score_windows", "window_nll"]


@dataclass
class Score:
    """Accumulated NLL. ``bucket_*`` index position buckets within the window."""

    length: int
    buckets: int
    nll: float = 0.0
    tokens: int = 0
    bucket_nll: list[float] = field(default_factory=list)
    bucket_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bucket_nll = self.bucket_nll or [0.0] * self.buckets
        self.bucket_tokens = self.bucket_tokens or [0] * self.buckets

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    def by_position(self) -> list[dict]:
        """Per bucket: window positions ``[start, end)``, mean NLL and token count."""
        edges = [self.length * k // self.buckets for k in range(self.buckets + 1)]
        return [{"start": edges[k], "end": edges[k + 1], "tokens": self.bucket_tokens[k],
                 "nll": self.bucket_nll[k] / self.bucket_tokens[k] if self.bucket_tokens[k] else None}
                for k in range(self.buckets)]


def _batches(windows: list[Window], batch_size: int):
    """Consecutive windows of equal size, at most ``batch_size`` at a time."""
    for _, group in groupby(windows, key=lambda w: w.end - w.start):
        group = list(group)
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def _forward_nll(model, head: OutputHead | None, ids: torch.Tensor, first: int, chunk: int | None) -> torch.Tensor:
    """NLL ``[b, n - first]`` float32 (on the model's device) of targets ``ids[:, first:]``
    (``first`` ≥ 1) from one forward over ``ids`` ``[b, n]``: through the chunked head when it
    reproduces the model's own logits (``OutputHead.verify``: checked on the first batch of a
    call, one host read), else from full logits."""
    if head is not None and head.mismatch is None:
        hidden, own = head.run(input_ids=ids, use_cache=False)  # [b, n, d], [b, 1, V]
        if head.verify(hidden, own):
            return head.token_nll(hidden[:, first - 1 : -1], ids[:, first:], chunk)
    logits = model(input_ids=ids, use_cache=False).logits[:, first - 1 : -1]  # [b, n-first, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, first:].flatten(),
                           reduction="none").view(ids.shape[0], -1)


def _nll(model, head, ids: torch.Tensor, block: int | None, chunk: int | None) -> torch.Tensor:
    """Next-token NLL ``[b, n-1]`` of ``ids`` ``[b, n]``: one forward, or with ``block`` B the
    targets in [kB, (k+1)B) from a forward over the first (k+1)·B tokens — a dynamic strategy then
    sees, per block, the length generation would have reached."""
    if not block:
        return _forward_nll(model, head, ids, 1, chunk)
    n = ids.shape[1]
    return torch.cat([_forward_nll(model, head, ids[:, : min(start + block, n)], max(start, 1), chunk)
                      for start in range(0, n, block)], dim=1)


@torch.no_grad()
def window_nll(model, docs: list[torch.Tensor], windows: list[Window], *, length: int,
               bos_token_id: int | None = None, batch_size: int = 1, buckets: int = 16,
               device: torch.device | str = "cpu", desc: str | None = None,
               prefix_block: int | None = None, logits_chunk: int | None = None,
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per window, in order: its summed next-token NLL per position bucket ``[buckets]`` float64
    and its scored tokens per bucket ``[buckets]`` (the parts ``combine_windows`` adds up; a
    data-parallel run computes them for its share of the windows).

    Memory is O(n·d): the LM head and the loss run over ``logits_chunk`` positions at a time
    (``ropescale.lm_head``; default from a memory budget), never over ``[n, V]`` logits — unless
    the model's head cannot be reproduced, which is detected on the first batch (against the
    model's own last-position logits) and falls back to full logits with a warning. The accounting
    stays on the device until the end (no host sync per window).

    Args:
        model: causal LM (transformers ``*ForCausalLM``).
        docs: token ids per document, ``[n_tokens]`` int64 each.
        windows: from ``ropescale.runs.windows``; token at window index j is predicted from indices < j.
        length: nominal window length (sets the bucket edges: ``buckets`` equal parts of it).
        bos_token_id: prepended to every window when given (windows must be cut with bos=True).
        desc: progress-bar label; None disables the bar.
        prefix_block: score block-wise (see ``_nll``) instead of one forward per window.
        logits_chunk: positions per chunk of the LM head [tokens]; None: from a memory budget.
    """
    try:
        head = OutputHead(model)
    except ValueError:  # no separate decoder: full logits
        head = None
    out = []
    bar = tqdm(total=len(windows), desc=desc, disable=True if desc is None else None, leave=False, unit="win")
    offset = int(bos_token_id is not None)
    for batch in _batches(windows, batch_size):
        ids = torch.stack([docs[w.doc][w.start : w.end] for w in batch])  # [b, n]
        if offset:
            ids = F.pad(ids, (1, 0), value=bos_token_id)
        ids = ids.to(device)
        acc = torch.float32 if ids.device.type == "mps" else torch.float64  # MPS has no float64
        nll = _nll(model, head, ids, prefix_block, logits_chunk).to(acc)  # [b, n-1]
        target_pos = torch.arange(1, ids.shape[1], device=ids.device)  # window index of each target
        bucket = (target_pos * buckets) // length  # [n-1]
        for row, w in zip(nll, batch):
            keep = (target_pos >= (w.score_from - w.start + offset)).double()  # [n-1]
            zeros = torch.zeros(buckets, dtype=acc, device=ids.device)
            out.append((zeros.scatter_add(0, bucket, row * keep), zeros.scatter_add(0, bucket, keep)))
        bar.update(len(batch))
    bar.close()
    if not out:
        return out
    sums = torch.stack([t for pair in out for t in pair]).cpu().double()  # one transfer: [2·windows, buckets]
    return [(sums[2 * i], sums[2 * i + 1]) for i in range(len(out))]


def combine_windows(parts: list[tuple[torch.Tensor, torch.Tensor]], length: int, buckets: int) -> Score:
    """Add up per-window parts *in window order* (so any split across processes gives the same
    float64 sums as one process)."""
    bucket_nll = torch.zeros(buckets, dtype=torch.float64)
    bucket_tok = torch.zeros(buckets, dtype=torch.float64)
    for nll, tok in parts:
        bucket_nll += nll
        bucket_tok += tok
    score = Score(length, buckets)
    score.bucket_nll = bucket_nll.tolist()
    score.bucket_tokens = [int(t) for t in bucket_tok.tolist()]
    score.nll, score.tokens = float(bucket_nll.sum()), int(bucket_tok.sum())
    return score


def score_windows(model, docs: list[torch.Tensor], windows: list[Window], *, length: int, buckets: int = 16,
                  **kw) -> Score:
    """Summed next-token NLL over the scored tokens of ``windows`` (arguments of ``window_nll``)."""
    return combine_windows(window_nll(model, docs, windows, length=length, buckets=buckets, **kw), length, buckets)

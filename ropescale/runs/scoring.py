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
from ropescale.runs.uncertainty import BOOTSTRAP_RESAMPLES, block_bootstrap_ppl
from ropescale.runs.windows import Window

__all__ = ["Score", "combine_windows", "score_windows", "token_nll", "window_nll"]


@dataclass
class Score:
    """Accumulated NLL. ``bucket_*`` index position buckets within the window."""

    length: int
    buckets: int
    nll: float = 0.0
    tokens: int = 0
    bucket_nll: list[float] = field(default_factory=list)
    bucket_tokens: list[int] = field(default_factory=list)
    bucket_kl: list[float] | None = None  # summed KL(P_unpatched ‖ P_patched) per bucket [nats], when measured
    kl_first: tuple[float, int] | None = None  # summed KL and tokens over each window's first predictions
    block_nll: torch.Tensor | None = None  # [m] summed NLL of each block of consecutive scored tokens (every window's)
    block_tokens: torch.Tensor | None = None  # [m] scored tokens of each block

    def __post_init__(self) -> None:
        self.bucket_nll = self.bucket_nll or [0.0] * self.buckets
        self.bucket_tokens = self.bucket_tokens or [0] * self.buckets

    @property
    def mean_nll(self) -> float:
        """The token-weighted mean NLL [nats per token]."""
        return self.nll / self.tokens

    @property
    def mean_kl(self) -> float | None:
        """Mean KL(P_unpatched ‖ P_patched) per scored token [nats]; None when not measured."""
        return None if self.bucket_kl is None else sum(self.bucket_kl) / self.tokens

    @property
    def mean_kl_first(self) -> float | None:
        """Mean KL over each window's first predictions (``window_nll``'s ``kl_first``) [nats]."""
        return None if self.kl_first is None or not self.kl_first[1] else self.kl_first[0] / self.kl_first[1]

    def ppl_interval(self, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
        """95% block-bootstrap interval of the perplexity (``ropescale.runs.uncertainty``) over the blocks
        ``window_nll(block=…)`` summed; None when blocks were not kept or fewer than two hold tokens."""
        if self.block_nll is None:
            return None
        return block_bootstrap_ppl(self.block_nll, self.block_tokens, resamples=resamples, seed=seed)

    def by_position(self) -> list[dict]:
        """Per bucket: window positions ``[start, end)``, mean NLL and token count."""
        edges = [self.length * k // self.buckets for k in range(self.buckets + 1)]
        rows = [{"start": edges[k], "end": edges[k + 1], "tokens": self.bucket_tokens[k],
                 "nll": self.bucket_nll[k] / self.bucket_tokens[k] if self.bucket_tokens[k] else None}
                for k in range(self.buckets)]
        if self.bucket_kl is not None:
            for row, kl in zip(rows, self.bucket_kl):
                row["kl"] = kl / row["tokens"] if row["tokens"] else None
        return rows


def _batches(windows: list[Window], batch_size: int):
    """Consecutive windows of equal size, at most ``batch_size`` at a time."""
    for _, group in groupby(windows, key=lambda w: w.end - w.start):
        group = list(group)
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def _reference(model, forward):
    """``forward()`` run with the model's active patch suspended (``PatchHandle.suspended``): the
    unpatched model's output; None when no patch is active (the model is its own reference)."""
    from ropescale.patching import current_patch

    handle = current_patch(model)
    if handle is None:
        return None
    with handle.suspended():
        return forward()


def _forward_nll(model, head: OutputHead | None, ids: torch.Tensor, first: int, chunk: int | None,
                 kl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NLL ``[b, n - first]`` float32 (on the model's device) of targets ``ids[:, first:]``
    (``first`` ≥ 1) from one forward over ``ids`` ``[b, n]``: through the chunked head when it
    reproduces the model's own logits (``OutputHead.verify``: checked on the first batch of a
    call, one host read), else from full logits. With ``kl``, also KL(P_unpatched ‖ P) ``[b, n -
    first]`` at the same positions, the reference from a forward with the patch suspended (zeros
    when no patch is active); else None."""
    if head is not None and head.mismatch is None:
        hidden, own = head.run(input_ids=ids, use_cache=False)  # [b, n, d], [b, 1, V]
        if head.verify(hidden, own):
            nll = head.token_nll(hidden[:, first - 1 : -1], ids[:, first:], chunk)
            if not kl:
                return nll, None
            ref = _reference(model, lambda: head.run(input_ids=ids, use_cache=False)[0])  # [b, n, d]
            if ref is None:
                return nll, torch.zeros_like(nll)
            return nll, head.token_kl(ref[:, first - 1 : -1], hidden[:, first - 1 : -1], chunk and max(1, chunk // 2))
    logits = model(input_ids=ids, use_cache=False).logits[:, first - 1 : -1]  # [b, n-first, V]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, first:].flatten(),
                          reduction="none").view(ids.shape[0], -1)
    if not kl:
        return nll, None
    ref = _reference(model, lambda: model(input_ids=ids, use_cache=False).logits[:, first - 1 : -1])
    if ref is None:
        return nll, torch.zeros_like(nll)
    own = F.log_softmax(logits.float(), dim=-1)  # [b, n-first, V]
    ref = F.log_softmax(ref.float(), dim=-1)
    return nll, F.kl_div(own, ref, reduction="none", log_target=True).sum(-1).clamp_min(0)  # ≥ 0 (rounding)


def _nll(model, head, ids: torch.Tensor, block: int | None, chunk: int | None,
         kl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token NLL ``[b, n-1]`` of ``ids`` ``[b, n]`` (and with ``kl`` the KL to the unpatched
    model ``[b, n-1]``): one forward, or with ``block`` B the targets in [kB, (k+1)B) from a forward
    over the first (k+1)·B tokens — a dynamic strategy then sees, per block, the length generation
    would have reached."""
    if not block:
        return _forward_nll(model, head, ids, 1, chunk, kl)
    n = ids.shape[1]
    parts = [_forward_nll(model, head, ids[:, : min(start + block, n)], max(start, 1), chunk, kl)
             for start in range(0, n, block)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1) if kl else None


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """Per-token next-token NLL ``[n − 1]`` (float64, nats, on the host) of ``ids`` ``[n]`` under ``model``,
    one forward; entry p − 1 is token p's. Memory O(n·d): the LM head and the loss run over ``chunk``
    positions at a time (``ropescale.lm_head``), never over ``[n, V]`` logits — unless the model's head
    cannot be reproduced, in which case the full logits are used (as ``window_nll`` does)."""
    try:
        head = OutputHead(model)
    except ValueError:  # no separate decoder: full logits
        head = None
    nll, _ = _forward_nll(model, head, ids[None].to(model.device), 1, chunk)  # [1, n-1]
    return nll[0].double().cpu()


@torch.no_grad()
def window_nll(model, docs: list[torch.Tensor], windows: list[Window], *, length: int,
               bos_token_id: int | None = None, batch_size: int = 1, buckets: int = 16,
               device: torch.device | str = "cpu", desc: str | None = None,
               prefix_block: int | None = None, logits_chunk: int | None = None,
               kl: bool = False, kl_first: int = 0, block: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Per window, in order: its summed next-token NLL per position bucket ``[buckets]`` float64
    and its scored tokens per bucket ``[buckets]`` (the parts ``combine_windows`` adds up; a
    data-parallel run computes them for its share of the windows) — with ``kl``, then its summed
    KL(P_unpatched ‖ P_patched) per bucket ``[buckets]`` and ``[KL sum, tokens]`` over its scored
    targets at window index ≤ ``kl_first`` (the first ``kl_first`` predictions) — and with ``block`` B, last,
    its summed NLL and scored tokens per block of B consecutive targets (window indices [1 + kB, 1 + (k+1)B),
    ``[ceil(length / B)]`` each: the units of ``combine_windows``' bootstrap interval).

    Memory is O(n·d): the LM head and the loss run over ``logits_chunk`` positions at a time
    (``ropescale.lm_head``; default from a memory budget), never over ``[n, V]`` logits — unless
    the model's head cannot be reproduced, which is detected on the first batch (against the
    model's own last-position logits) and falls back to full logits with a warning. The accounting
    stays on the device until the end (no host sync per window). KL adds a second forward per
    window with the active patch suspended (``PatchHandle.suspended``: no second copy of the
    weights) and one more ``[b, n, d]`` hidden state.

    Args:
        model: causal LM (transformers ``*ForCausalLM``).
        docs: token ids per document, ``[n_tokens]`` int64 each.
        windows: from ``ropescale.runs.windows``; token at window index j is predicted from indices < j.
        length: nominal window length (sets the bucket edges: ``buckets`` equal parts of it).
        bos_token_id: prepended to every window when given (windows must be cut with bos=True).
        desc: progress-bar label; None disables the bar.
        prefix_block: score block-wise (see ``_nll``) instead of one forward per window.
        logits_chunk: positions per chunk of the LM head [tokens]; None: from a memory budget.
        kl: also the KL divergence to the unpatched model (nats per token; 0 with no active patch).
        kl_first: the first predictions per window the second KL sum covers [tokens].
        block: tokens per bootstrap block; None: no block sums.
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
        nll, div = _nll(model, head, ids, prefix_block, logits_chunk, kl)  # [b, n-1] each
        nll = nll.to(acc)
        target_pos = torch.arange(1, ids.shape[1], device=ids.device)  # window index of each target
        bucket = (target_pos * buckets) // length  # [n-1]
        early = (target_pos <= kl_first).to(acc)  # [n-1]: the first kl_first predictions
        blocks = -(-length // block) if block else 0
        in_block = ((target_pos - 1) // block).clamp_max(blocks - 1) if block else None  # [n-1]
        for i, w in enumerate(batch):
            keep = (target_pos >= (w.score_from - w.start + offset)).to(acc)  # [n-1]
            zeros = torch.zeros(buckets, dtype=acc, device=ids.device)
            part = [zeros.scatter_add(0, bucket, nll[i] * keep), zeros.scatter_add(0, bucket, keep)]
            if kl:
                row = div[i].to(acc) * keep
                part += [zeros.scatter_add(0, bucket, row), torch.stack([(row * early).sum(), (keep * early).sum()])]
            if block:
                empty = torch.zeros(blocks, dtype=acc, device=ids.device)
                part += [empty.scatter_add(0, in_block, nll[i] * keep), empty.scatter_add(0, in_block, keep)]
            out.append(torch.cat(part))  # [2·buckets (+ buckets + 2) (+ 2·blocks)]
        bar.update(len(batch))
    bar.close()
    if not out:
        return out
    sums = torch.stack(out).cpu().double()  # one transfer: [windows, 2·buckets (+ buckets + 2) (+ 2·blocks)]
    sizes = [buckets, buckets] + ([buckets, 2] if kl else []) + ([blocks, blocks] if block else [])
    return [tuple(row.split(sizes)) for row in sums]


def combine_windows(parts: list[tuple[torch.Tensor, ...]], length: int, buckets: int, *,
                    blocks: bool = False) -> Score:
    """Add up per-window parts *in window order* (so any split across processes gives the same
    float64 sums as one process); parts with KL (``window_nll(kl=True)``) add its sums too. With
    ``blocks`` (parts from ``window_nll(block=…)``), every window's block sums are kept, in order, for
    ``Score.ppl_interval``."""
    score_blocks = None
    if blocks and parts:
        score_blocks = (torch.cat([p[-2] for p in parts]), torch.cat([p[-1] for p in parts]))
        parts = [p[:-2] for p in parts]
    width = len(parts[0]) if parts else 2
    sums = [torch.zeros(t.shape, dtype=torch.float64) for t in parts[0]] if parts else []
    for part in parts:
        if len(part) != width:
            raise ValueError("window parts with and without KL cannot be combined")
        for total, t in zip(sums, part):
            total += t
    score = Score(length, buckets)
    if not parts:
        return score
    bucket_nll, bucket_tok = sums[:2]
    score.bucket_nll = bucket_nll.tolist()
    score.bucket_tokens = [int(t) for t in bucket_tok.tolist()]
    score.nll, score.tokens = float(bucket_nll.sum()), int(bucket_tok.sum())
    if width == 4:
        score.bucket_kl = sums[2].tolist()
        score.kl_first = (float(sums[3][0]), int(sums[3][1]))
    if score_blocks is not None:
        score.block_nll, score.block_tokens = score_blocks
    return score


def score_windows(model, docs: list[torch.Tensor], windows: list[Window], *, length: int, buckets: int = 16,
                  **kw) -> Score:
    """Summed next-token NLL over the scored tokens of ``windows`` (arguments of ``window_nll``)."""
    return combine_windows(window_nll(model, docs, windows, length=length, buckets=buckets, **kw), length, buckets)

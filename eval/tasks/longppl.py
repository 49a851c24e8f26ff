"""LongPPL (Fang et al. 2025, "What is Wrong with Perplexity for Long-context Language Modeling?",
arXiv:2410.23771; reference implementation PKU-ML/LongPPL ``longppl/longppl.py``): perplexity over
the *key tokens* of long text, beside plain perplexity over the same windows.

For a window x of L tokens and an evaluator model, token x_p's

- long-context likelihood LCL(x_p) = log P(x_p | x_<p) (the whole window before it), and
- long-short difference LSD(x_p) = log P(x_p | x_<p) − log P(x_p | x_[s, p)), the short context
  starting at s, shared by a block of ``stride`` tokens: positions p ∈ [s + short, s + short +
  stride) use the context from s = short-context block start (``trunc_len`` and ``sliding_window``
  of the reference code; positions before ``short`` have no short context and are never key).

x_p is a key token when LSD > ``alpha`` and LCL > ``beta`` (the paper's α = 2, β = −2: the long
context makes it e² times likelier, and it is likely with it). LongPPL = exp(mean NLL of the
evaluated model over the key tokens, with the full window as context); ``ppl`` = exp(mean NLL over
every scored token of the same windows). Both are token-weighted over all windows of a length.

The evaluator is the patched model itself by default (its own long-context gains, per strategy),
or ``evaluator``: another model (a local path or hub id, unpatched, loaded once; it must share the
evaluated model's tokenizer, so key tokens are the same positions — a different tokenizer is
refused in one line). ``short`` defaults to the training window T (the paper: 4096 for its 4k-short
evaluators) and ``stride`` to short // 4 (the paper: 1024).

Shapes: a window ``[L]``; per-token NLL arrays ``[L − 1]`` (entry p − 1 is token p's).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch
from pydantic import Field

from ropescale.runs.memory import Need, forward_bytes, model_dims
from ropescale.runs.scoring import token_nll
from ropescale.runs.windows import make_windows

from .base import Metric, Task, TaskOptions, progress

__all__ = ["LongPPL", "LongPPLOptions", "key_tokens", "short_context_nll", "token_nll"]


class LongPPLOptions(TaskOptions):
    """LongPPL's options (each field's description says what it sets)."""

    alpha: float = Field(2.0, description="LSD threshold (nats): key tokens gain more than this from the long context")
    beta: float = Field(-2.0, description="LCL threshold (nats): key tokens' long-context log-probability above this")
    short: int | None = Field(None, ge=1, description="short context (tokens); default the training window T")
    stride: int | None = Field(None, ge=1, description="tokens sharing one short context; default short // 4")
    evaluator: str | None = Field(None, description="model finding the key tokens; default the patched model itself")
    max_windows: int | None = Field(None, ge=1, description="cap on windows per length")

    def check_lengths(self, lengths: list[int]) -> None:
        if self.short and self.short >= min(lengths):
            raise ValueError(f"short context {self.short} is not shorter than the shortest length {min(lengths)}: "
                             "no token would have a long context to gain from")


@torch.no_grad()
def short_context_nll(model, ids: torch.Tensor, short: int, stride: int) -> torch.Tensor:
    """NLL ``[n − 1]`` of each token p ≥ ``short`` given only the tokens from its block's start s
    (p ∈ [s + short, s + short + stride), s = 0, stride, …); NaN before ``short``. One forward per
    block, over ``ids[s : s + short + stride]``."""
    n = ids.numel()
    out = torch.full((n - 1,), math.nan, dtype=torch.float64)
    for s in range(0, n - short, stride):
        end = min(s + short + stride, n)
        nll = token_nll(model, ids[s:end])  # entry j: token s + j + 1
        out[s + short - 1:end - 1] = nll[short - 1:]
    return out


def key_tokens(full: torch.Tensor, short: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Key-token mask ``[n − 1]``: LSD = short − full > alpha and LCL = −full > beta (NaN: never key)."""
    return ((short - full) > alpha) & (-full > beta)


class LongPPL(Task):
    """LongPPL: perplexity over the tokens the long context makes likely (Fang et al. 2025), beside PPL."""

    name = "longppl"
    Options = LongPPLOptions
    metrics = (Metric(key="longppl", label="LongPPL (key tokens)", higher_is_better=False),
               Metric(key="ppl", label="perplexity (all tokens)", higher_is_better=False),
               Metric(key="key_share", label="key tokens (share of scored)", higher_is_better=True, fmt="{:.3f}"))
    uses_data = True

    @property
    def short(self) -> int:
        """The short context [tokens] the key tokens are found with (default: T)."""
        return self.options.short or self.train_length

    @property
    def stride(self) -> int:
        """The stride of the short-context windows [tokens] (default: a quarter of ``short``)."""
        return self.options.stride or max(1, self.short // 4)

    @cached_property
    def evaluator(self):
        """The external evaluator (None: the patched model itself)."""
        if self.options.evaluator is None:
            return None
        from ropescale.models import load_model

        from .ruler.cache import tokenizer_fingerprint

        model, tok = load_model(self.options.evaluator)
        if tokenizer_fingerprint(tok) != tokenizer_fingerprint(self.tokenizer):
            raise ValueError(f"evaluator {self.options.evaluator}: its tokenizer differs from the evaluated model's; "
                             "key tokens are positions of one tokenization, so the evaluator must share it")
        return model

    def examples(self, length: int):
        if self.short >= length:
            raise ValueError(f"longppl: short context {self.short} is not shorter than length {length}")
        return make_windows([len(d) for d in self.documents], length, "chunk", None, False, self.options.max_windows)

    def memory(self, length: int, model) -> Need:
        """Device: one forward's activations over ``length`` tokens and the chunked LM head's budget
        (``ropescale.lm_head``: never ``[L, V]`` logits), plus the per-token NLL arrays."""
        from ropescale.lm_head import DEFAULT_BUDGET

        dims = model_dims(model)
        return Need(what=f"longppl at {length} tokens", device={
            "activations": forward_bytes(dims, length, model.dtype.itemsize) + 24 * length, "LM head": DEFAULT_BUDGET})

    def measure(self, model, windows, indices, *, length, strategy, device, desc) -> list:
        o, rows = self.options, []
        evaluator = self.evaluator
        bar = progress(len(indices), desc, unit="win")
        for i in indices:
            w = windows[i]
            ids = self.documents[w.doc][w.start:w.end].to(device)  # [L]
            full = token_nll(model, ids).cpu()
            ev = evaluator if evaluator is not None else model
            ev_full = full if evaluator is None else token_nll(evaluator, ids.to(evaluator.device)).cpu()
            ev_short = short_context_nll(ev, ids.to(ev.device), self.short, self.stride).cpu()
            key = key_tokens(ev_full, ev_short, o.alpha, o.beta)
            rows.append((i, float(full.sum()), full.numel(), float(full[key].sum()), int(key.sum())))
            bar.update(1)
        bar.close()
        return rows

    def combine(self, parts, windows, *, length, strategy) -> dict[str, Any]:
        rows = sorted(x for part in parts for x in part)
        if [r[0] for r in rows] != list(range(len(windows))):
            raise RuntimeError("longppl: the processes' parts do not cover every window exactly once")
        nll, n = sum(r[1] for r in rows), sum(r[2] for r in rows)
        key_nll, k = sum(r[3] for r in rows), sum(r[4] for r in rows)
        return {"longppl": math.exp(key_nll / k) if k else None, "ppl": math.exp(nll / n), "key_tokens": k,
                "tokens": n, "key_share": k / n, "windows": len(windows), "short": self.short, "stride": self.stride,
                "evaluator": self.options.evaluator or "the patched model"}

    @classmethod
    def plots(cls, records, output):
        from ..plots import plot_metric

        path = output / "longppl_vs_length.png"
        plot_metric(records, "longppl", "LongPPL (key tokens)", path, second=("ppl", "perplexity (all tokens)", None))
        return {"plot": path}

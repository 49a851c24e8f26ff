"""Perplexity over windows of L tokens of the data source (``ropescale.runs.windows`` cuts them,
``ropescale.runs.scoring`` scores them). PPL = exp(total NLL / scored tokens), token-weighted.

With ``kl: true``, also what the strategy costs where the model needs no scaling: the KL divergence
KL(P_unpatched ‖ P_patched) of the next-token distributions on the same windows (nats per scored
token, token-weighted: ``kl``), over each window's first ``kl_first_tokens`` predictions
(``kl_first``: short prompts) and per position bucket — as llama.cpp's ``--kl-divergence`` measures a
quantization's drift (``perplexity.cpp``: mean KLD over the scored tokens of each chunk). 0 for
``vanilla``. One more forward per window (the patch suspended, ``PatchHandle.suspended``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from ropescale.runs.memory import Need, forward_bytes, model_dims
from ropescale.runs.scoring import combine_windows, window_nll
from ropescale.runs.uncertainty import BOOTSTRAP_RESAMPLES
from ropescale.runs.windows import make_windows

from .base import Metric, Task, TaskOptions

__all__ = ["LEGACY_KEYS", "Perplexity", "PerplexityOptions"]


class PerplexityOptions(TaskOptions):
    """The perplexity task's options: chunk or sliding windows, stride, batch, the cap on windows."""

    mode: Literal["chunk", "sliding"] = "chunk"
    stride: int | None = Field(None, ge=1, description="sliding mode; default length // 2")
    max_windows: int | None = Field(None, ge=1, description="cap on windows per length")
    max_tokens: int | None = Field(None, ge=1, description=(
        "cap on the tokens a cell scores: at most ceil(max_tokens / L) windows per length L, evenly spaced "
        "(the same tokens at every length; long windows cost far more each)"))
    add_bos: bool = False
    batch_size: int = Field(1, ge=1)
    logits_chunk: int | None = Field(None, ge=1, description=(
        "positions per chunk of the LM head and loss (memory ≈ chunk × V × 12 bytes); "
        "default: from a 256 MiB budget"))
    position_buckets: int = Field(16, ge=1, le=1024, description="NLL-by-position buckets per window")
    ci_block: int = Field(256, ge=1, description=(
        "tokens per block of the perplexity's 95% block-bootstrap interval (ppl_ci): consecutive scored "
        "tokens of a window, resampled as units"))
    kl: bool = Field(False, description="also KL(P_unpatched ‖ P_patched) per token [nats] (one more forward a window)")
    kl_first_tokens: int = Field(128, ge=1, description="kl: the first predictions of each window reported apart")
    dynamic_block: int | None = Field(None, ge=1, description=(
        "dynamic strategies: score tokens [kB, (k+1)B) with a forward over the first (k+1)B tokens, "
        "the scale generation would use (1 = per position); default: one scale per window"))

    @model_validator(mode="after")
    def _kl_first_needs_kl(self) -> PerplexityOptions:
        # a key that does nothing is a mistake; the default (as a dumped config, the manifest's, holds it) is not
        if not self.kl and self.kl_first_tokens != type(self).model_fields["kl_first_tokens"].default:
            raise ValueError(f"kl_first_tokens={self.kl_first_tokens} is read only with kl: true (it splits off each "
                             "window's first predictions of the KL); set kl: true, or drop kl_first_tokens")
        return self

    def check_lengths(self, lengths: list[int]) -> None:
        if self.stride and self.mode == "sliding" and self.stride > min(lengths):
            raise ValueError(f"stride {self.stride} is longer than the shortest length {min(lengths)}")

    def key(self) -> dict[str, Any]:
        # batch_size and logits_chunk change numbers by float noise only, ci_block only the interval: not part of
        # the identity;
        # neither is kl when off (folders from before it resume)
        out = self.model_dump(exclude={"batch_size", "logits_chunk", "ci_block"}) | {
            "stride": self.stride if self.mode == "sliding" else None}
        if not self.kl:
            del out["kl"], out["kl_first_tokens"]
        if self.max_tokens is None:  # folders from before the option resume
            del out["max_tokens"]
        return out


# written at the top level of a config before tasks existed; still read there
LEGACY_KEYS = tuple(k for k in PerplexityOptions.model_fields if k not in ("logits_chunk", "kl", "kl_first_tokens"))


def _listed(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else list(interval)


def _blocks(score, block: int) -> dict[str, Any]:
    """The record's account of the interval: how it was made and the blocks it resampled (summed NLL
    [nats] and scored tokens of each, in window order), so intervals of differences (a strategy against
    vanilla on the same tokens) can be drawn from the records."""
    keep = score.block_tokens > 0
    return {"ci": f"95% block bootstrap: {int(keep.sum())} blocks of {block} consecutive scored tokens, "
                  f"{BOOTSTRAP_RESAMPLES} resamples, percentile interval",
            "nll_blocks": [round(x, 4) for x in score.block_nll[keep].tolist()],
            "block_tokens": [int(x) for x in score.block_tokens[keep].tolist()]}


def _dynamic_semantics(block: int | None) -> str:
    if block is None:
        return "one scale per window (L = window length), as a single forward"
    return (f"block-wise, block {block}: tokens [kB, (k+1)B) scored by a forward over the first (k+1)B "
            "tokens, as exact cached generation with dynamic_block=B (B=1: per position)")


class Perplexity(Task):
    """Perplexity of the data source's documents in windows of L tokens (chunk or sliding)."""

    name = "perplexity"
    Options = PerplexityOptions
    metrics = (Metric(key="ppl", label="perplexity", higher_is_better=False),
               Metric(key="nll", label="mean NLL (nats)", higher_is_better=False, fmt="{:.4f}"))
    uses_data = True
    engine_asks = frozenset({"logprobs"})

    @property
    def bos(self) -> int | None:
        """The BOS token id put before each window (``add_bos``), or None."""
        return self.tokenizer.bos_token_id if self.options.add_bos else None

    def examples(self, length: int):
        o = self.options
        if o.add_bos and self.tokenizer.bos_token_id is None:
            raise ValueError("add_bos is set but the model's tokenizer has no BOS token")
        cap = [c for c in (o.max_windows, -(-o.max_tokens // length) if o.max_tokens else None) if c]
        return make_windows([len(d) for d in self.documents], length, o.mode, o.stride, o.add_bos,
                            min(cap) if cap else None)

    def memory(self, length: int, model) -> Need:
        """Device: one forward's activations over ``batch_size`` windows of ``length`` tokens (no
        KV cache) and the chunked LM head's budget (``ropescale.lm_head``). The documents are
        already in host memory."""
        from ropescale.lm_head import DEFAULT_BUDGET

        o = self.options
        dims = model_dims(model)
        head = o.logits_chunk * dims.vocab * 12 * o.batch_size if o.logits_chunk else DEFAULT_BUDGET
        device = {"activations": forward_bytes(dims, length + 1, model.dtype.itemsize, batch=o.batch_size)
                  + 24 * o.batch_size * length, "LM head": head}
        if o.kl:  # the unpatched forward's last hidden state, kept beside the patched one's
            device["KL reference"] = o.batch_size * (length + 1) * dims.hidden * model.dtype.itemsize
        return Need(what=f"perplexity at {length} tokens ({o.batch_size} window{'s' * (o.batch_size > 1)} a batch)",
                    device=device)

    def measure(self, model, windows, indices, *, length, strategy, device, desc) -> list:
        o = self.options
        parts = window_nll(model, self.documents, [windows[i] for i in indices], length=length, bos_token_id=self.bos,
                           batch_size=o.batch_size, buckets=o.position_buckets, device=device, desc=desc,
                           prefix_block=o.dynamic_block if strategy.dynamic else None, logits_chunk=o.logits_chunk,
                           kl=o.kl, kl_first=o.kl_first_tokens, block=o.ci_block)
        return list(zip(indices, parts))

    def combine(self, parts, windows, *, length, strategy) -> dict[str, Any]:
        o = self.options
        block = o.dynamic_block if strategy.dynamic else None
        ordered = [p for _, p in sorted((x for part in parts for x in part), key=lambda x: x[0])]
        s = combine_windows(ordered, length, o.position_buckets, blocks=True)
        kl = {"kl": s.mean_kl, "kl_first": s.mean_kl_first, "kl_first_tokens": o.kl_first_tokens} if o.kl else {}
        return {"ppl": math.exp(s.mean_nll), "ppl_ci": _listed(s.ppl_interval()), "nll": s.mean_nll, **kl,
                **_blocks(s, o.ci_block), "tokens": s.tokens, "windows": len(windows),
                "mode": o.mode, "stride": (o.stride or length // 2) if o.mode == "sliding" else None,
                "add_bos": o.add_bos, "dynamic": _dynamic_semantics(block) if strategy.dynamic else None,
                "nll_by_position": s.by_position()}

    def engine_requests(self, windows) -> tuple[list[dict[str, Any]], int]:
        """Each window's token ids (after the BOS when ``add_bos``) as a prompt whose log-probabilities
        are asked; the first window is the checked one."""
        bos = self.bos
        reqs = []
        for w in windows:
            ids = self.documents[w.doc][w.start:w.end].tolist()
            reqs.append({"ids": ([bos] if bos is not None else []) + ids, "max_tokens": 1, "prompt_logprobs": True})
        return reqs, 0

    def engine_parts(self, windows, results, length: int) -> list:
        """The part ``combine`` adds up, from the engine's log-probabilities: per window the NLL
        [nats] and token counts summed into ``position_buckets`` buckets over the scored targets,
        as ``window_nll`` buckets the in-process model's."""
        o = self.options
        offset = int(self.bos is not None)
        blocks = -(-length // o.ci_block)
        parts = []
        for i, (w, r) in enumerate(zip(windows, results)):
            nll = -torch.tensor(r["logprobs"], dtype=torch.float64)  # [n-1]
            target = torch.arange(1, nll.numel() + 1)
            bucket = (target * o.position_buckets) // length
            block = ((target - 1) // o.ci_block).clamp_max(blocks - 1)  # as window_nll's blocks
            keep = (target >= (w.score_from - w.start + offset)).double()
            zeros = torch.zeros(o.position_buckets, dtype=torch.float64)
            empty = torch.zeros(blocks, dtype=torch.float64)
            parts.append((i, (zeros.scatter_add(0, bucket, nll * keep), zeros.scatter_add(0, bucket, keep),
                              empty.scatter_add(0, block, nll * keep), empty.scatter_add(0, block, keep))))
        return parts

    @classmethod
    def engine_length(cls, options, length: int) -> int:
        return length + int(options.add_bos) + 1

    @classmethod
    def engine_refusal(cls, options) -> str | None:
        if options.kl:
            return ("perplexity: kl: the KL to the unpatched model needs the whole next-token distribution, and an "
                    "engine returns the target's log-probability only")
        return None

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        from ..plots import plot_metric, plot_position

        paths = {"plot": output / "ppl_vs_length.png", "position_plot": output / "nll_vs_position.png"}
        plot_metric(records, "ppl", "perplexity", paths["plot"], ci="ppl_ci")
        plot_position(records, paths["position_plot"])
        if any(r.get("kl") is not None for r in records):
            paths["kl_plot"] = output / "kl_vs_length.png"
            plot_metric([r for r in records if r.get("kl") is not None], "kl",
                        "KL(unpatched ‖ patched) [nats/token]", paths["kl_plot"])
        return paths

    @classmethod
    def report(cls, records: list[dict]) -> str:
        """With ``kl``: the KL tables (every scored token; each window's first predictions)."""
        from ..report import markdown_table

        measured = [r for r in records if r.get("kl") is not None]
        if not measured:
            return ""
        first = measured[0].get("kl_first_tokens")
        out = []
        for key, label in (("kl", "every scored token"), ("kl_first", f"each window's first {first} predictions")):
            metric = Metric(key=key, label=label, higher_is_better=False, fmt="{:.4f}")
            out += [f"**KL(P_unpatched ‖ P_patched)** [nats/token], {label} (lower is better; 0 = the model as "
                    "loaded)", "", markdown_table(measured, metric)]
        return "\n".join(out)

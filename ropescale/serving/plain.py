"""Whether plain transformers reproduces a patched model from the folder written for it.

The transformers engine says "plain transformers reproduces it" only after this check: the written
folder loaded back with ``AutoModelForCausalLM.from_pretrained`` (no ropescale), and its logits on a
few tokens compared with the patched model's — once at positions 0 … n−1, once with half of them
moved to the end of the checked span, so that scaled and dynamic rotations (which change only past
the training window) are exercised without running a long sequence. Both models see the same
token ids and ``position_ids``, without a KV cache.

Shapes: n = ``PROBE_TOKENS`` tokens; logits ``[1, n, vocab]``. Units: positions in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ropescale.serving.rope import MAX_LENGTH

__all__ = ["PROBE_TOKENS", "PlainCheck", "check_plain", "probe_positions", "tolerance"]

PROBE_TOKENS = 8  # n: tokens per probe


@dataclass(frozen=True)
class PlainCheck:
    """The outcome: ``same`` when every logit agrees within ``tolerance`` (relative to the largest
    logit, at least 1); ``max_diff``: the largest |Δ logit| found (inf when the reload failed);
    ``line``: one line saying what was compared, or why it failed."""

    same: bool
    max_diff: float
    line: str


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative logit difference called the same for weights of ``dtype``: 1e-4 for
    float32/float64 (float32 rotary arithmetic on both sides, ulps apart at most), 3e-2 for the
    16-bit types, whose cos/sin rounding alone moves logits by about that much."""
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 3e-2


def probe_positions(far: int, n: int = PROBE_TOKENS) -> list[torch.Tensor]:
    """The ``position_ids`` ``[1, n]`` (int64) the check runs: 0 … n−1, and 0 … n/2−1 followed by the
    n/2 last positions before ``far`` (only the first when ``far`` ≤ n)."""
    short = torch.arange(n)[None]
    if far <= n:
        return [short]
    half = n // 2
    return [short, torch.cat([torch.arange(half), torch.arange(far - (n - half), far)])[None]]


def _vocab(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "vocab_size", 0) or 2)


@torch.no_grad()
def _logits(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()


def check_plain(model, folder: str | Path, *, far: int) -> PlainCheck:
    """Compare the patched ``model`` with ``from_pretrained(folder)`` (same dtype, on the model's
    device; a second copy of the weights in memory while it runs) on ``PROBE_TOKENS`` tokens at the
    positions of ``probe_positions(far)``; ``far``: the end of the checked span [tokens], at most
    2^24. Never raises for what the reload does: a folder plain transformers cannot load or run
    is a failed check (``same`` False, the first line of the error in ``line``)."""
    from transformers import AutoModelForCausalLM

    far = max(2, min(int(far), MAX_LENGTH))
    param = next(model.parameters())
    n = PROBE_TOKENS
    ids = ((torch.arange(n) * 7 + 3) % _vocab(model))[None].to(param.device)
    was_training = model.training
    model.eval()
    try:
        ours = []
        for positions in probe_positions(far, n):
            try:
                ours.append((positions, _logits(model, ids, positions.to(param.device))))
            except (TypeError, ValueError, RuntimeError, IndexError):
                if not ours:  # the model does not take position_ids of its own: the plain forward only
                    ours.append((None, model(input_ids=ids, use_cache=False).logits.float()))
                break
    finally:
        model.train(was_training)
    try:
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=param.dtype).to(param.device).eval()
        diff, scale = 0.0, 1.0
        for positions, expected in ours:
            got = plain(input_ids=ids, use_cache=False).logits.float() if positions is None else \
                _logits(plain, ids, positions.to(param.device))
            diff = max(diff, float((got - expected).abs().max()))
            scale = max(scale, float(expected.abs().max()))
    except Exception as e:  # noqa: BLE001 — whatever plain transformers raises is the check's answer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return PlainCheck(False, float("inf"), f"plain from_pretrained of the export fails: {type(e).__name__}: "
                                               f"{first[:200]}")
    finally:
        plain = None  # the second copy freed (refcounting: transformers models hold no cycles)
    reach = max(int(p.max()) for p, _ in ours) + 1 if ours[0][0] is not None else n
    same = diff <= tolerance(param.dtype) * scale
    return PlainCheck(same, diff, f"max |Δ logit| {diff:.3g} against the patched model on {n} tokens at positions "
                                  f"up to {reach - 1}")

"""Requests answered under one patch: what every pipeline (a sweep's cell, a search's candidate) hands a scoring
engine outside this process, and the checks every answer passes before a number is made of it.

A pipeline patches the loaded transformers model, describes where and how the patch is served (``Serving``)
and asks ``engine.score_requests(requests, checked, serving)`` (``eval.engines.scoring.ScoringEngine``). The
engine (``ScoringEngine.answer``) exports
the live patch for itself, runs, and returns one answer per request (``Answered``). Then, whatever the engine:

- the answers are checked against the requests (``eval.engines.scoring.check_answers``: one per request, each
  prompt's ``len(ids) - 1`` finite log-probabilities ≤ 0 where asked, at most ``max_tokens`` generated ids);
- the checked request (``checked``: a window, or a prompt with its answer) is scored by the patched
  transformers model too (``transformers_logprobs``), and where the engine declares a tolerance
  (``ScoringEngine.tolerance``) a mean NLL differing by more stops the pipeline (``EngineDisagrees``, one line):
  the numbers would be another model's. ``Scored.parity`` records both.

Errors: ``ropescale.serving.rope.ExportRefused`` propagates (the engine cannot serve this patch: the sweep
refuses the cell, the search prunes the candidate); ``EngineFailed`` / ``ScoringEngineFailed`` for an engine
that died or answered wrongly; ``EngineDisagrees`` past the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import RopescaleError

__all__ = ["Answered", "EngineDisagrees", "Scored", "Serving", "slug", "transformers_logprobs"]


class EngineDisagrees(RopescaleError, RuntimeError):
    """An engine and transformers score the checked request differently beyond the engine's tolerance."""


@dataclass(frozen=True)
class Serving:
    """One patch, live on the loaded model, as an engine serves it.

    handle: the patch (``ropescale.patch``'s handle) on ``model``, the patched transformers model.
    tokenizer: the model's tokenizer (an engine writing a model folder saves it).
    source: the model as configured (``cfg.model``: a bundled name, a path, a hub id); its files are linked.
    dtype: the weights' dtype as resolved (``float32``, ``bfloat16``, ``float16``).
    options: the engine's config section (``ScoringEngine.Options``' instance), None when it has none.
    folder: where this patch's export is written (rewritten per call).
    log_dir: where the engine's logs go.
    where: the cell or candidate, as messages name it (``yarn @ 1024``).
    device: where ``model`` runs (the parity check's forward).
    freeze: a dynamic strategy served frozen at this length [tokens] (``served == "freeze"``), None: as it is.
    checked_what: the checked request, as the disagreement names it.
    stops: what happens on a disagreement or a failure, as messages end.
    """

    handle: Any
    model: Any
    tokenizer: Any
    source: str
    dtype: str
    options: Any
    folder: Path
    log_dir: Path
    where: str
    device: Any
    freeze: int | None = None
    checked_what: str = "the cell's first example"
    stops: str = "the cell is not recorded"


@dataclass(frozen=True)
class Answered:
    """An engine's answers: ``results`` (one dict per request: ``logprobs`` [nats] where asked, ``tokens``),
    the engine's ``version`` and what else its record keeps (``record``: seconds, the export's notes)."""

    results: list[dict[str, Any]]
    version: str
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scored:
    """Checked answers: ``results`` and ``version`` as answered, ``parity`` (``mean_nll_diff``, ``max_abs_dlogp``
    [nats], ``tokens``, ``tolerance``, ``against``; None without a tolerance) and the engine's ``record``."""

    results: list[dict[str, Any]]
    version: str
    parity: dict[str, Any] | None
    record: dict[str, Any]


def slug(display: str, length: int | None = None) -> str:
    """A folder name for a served patch: ``display`` with what a path cannot hold replaced, at most 48
    characters, then ``@length``."""
    out = "".join(c if c.isalnum() or c in "._=-" else "_" for c in display)[:48]
    return out if length is None else f"{out}@{length}"


@torch.no_grad()
def transformers_logprobs(model, ids: list[int], device) -> torch.Tensor:
    """log p(ids[j+1] | ids[:j+1]) ``[n-1]`` float64 from the (patched) transformers model, the head
    over chunks of positions (``ropescale.lm_head``)."""
    from ropescale.lm_head import OutputHead

    x = torch.tensor([ids], device=device)
    try:
        head = OutputHead(model)
    except ValueError:
        head = None
    if head is not None:
        hidden, own = head.run(input_ids=x, use_cache=False)
        if head.verify(hidden, own):
            return -head.token_nll(hidden[:, :-1], x[:, 1:])[0].double().cpu()
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, x[0, 1:, None])[:, 0].cpu()

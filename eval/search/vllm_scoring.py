"""``engine: vllm`` in a search: every candidate scored by vLLM, serving what ``ropescale patch
--engine vllm`` writes — the path of ``eval.engines.vllm_eval`` (the patch's export
``export_vllm``, a served folder with its config.json and the weights linked, the driver's ``score``
mode in vLLM's own environment), one engine start per candidate, since vLLM fixes the rotation when
it loads.

Per candidate, one driver call scores every sequence the objective reads: each search window of
each target length and of T (``prompt_logprobs``: the windows' next-token log-probabilities, the
same scored targets as ``ropescale.runs.scoring.score_windows``), and with the retrieval or needle
terms each prompt + answer (the answer's log-probabilities). The parity check is eval's: the first
window of the longest length is also scored by the patched transformers model, and a candidate
whose mean NLL there differs by more than ``vllm.parity_tolerance`` (default 1e-4 nats in float32,
5e-2 in bfloat16/float16) stops the search (``EngineDisagrees``, one line): the numbers would be
another model's. The constraint's vanilla PPL at T is vLLM's too (the vanilla patch served once).

Refused before anything loads (``check_search_engine``, one ``ConfigError`` line): a strategy vLLM
cannot express (``vllm_eval.unservable``; with several lengths in one engine a strategy recomputed
from the length — dynamic NTK, LongRoPE and so method ``evolution`` — too), a ``max_model_len``
shorter than the longest sequence, a launched run, vLLM not installed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ropescale.runs.config import ConfigError

from ..engines.vllm.scoring import (
    EngineDisagrees,
    check_processes,
    require_vllm,
    tolerance,
    transformers_logprobs,
    unservable,
    vllm_model_folder,
)

__all__ = ["check_search_engine", "vllm_measure"]


def check_search_engine(cfg, source: str = "config", processes: int = 1) -> None:
    """What ``engine: vllm`` refuses in a search before a model loads (see the module docstring)."""
    why = unservable(cfg.strategy, static_only=True)
    if why:
        raise ConfigError(f"{source}: strategy: {cfg.strategy}: {why}; a search scores T and every length in one "
                          "engine (engine: vllm; use engine: transformers)")
    if cfg.vllm.max_model_len is not None:
        need = max(*cfg.lengths, cfg.original_max_position_embeddings or 0) + 1
        if cfg.vllm.max_model_len < need:
            raise ConfigError(f"{source}: vllm.max_model_len: {cfg.vllm.max_model_len} is shorter than the {need} "
                              f"tokens a window of {need - 1} holds")
    check_processes(source, processes)
    require_vllm(source)


def _requests(objective) -> tuple[list[dict], list[tuple]]:
    """The driver's requests and, per request, what it is: ``("window", L, window)`` or
    ``("answer", term, answer length)``."""
    reqs, what = [], []
    for length in sorted(objective.windows):
        for w in objective.windows[length]:
            reqs.append({"ids": objective.docs[w.doc][w.start:w.end].tolist(), "max_tokens": 1,
                         "prompt_logprobs": True})
            what.append(("window", length, w))
    for term, examples in (("retrieval", objective.passkeys), ("needle", objective.needles)):
        for ex in examples:
            reqs.append({"ids": list(ex.prompt.ids) + list(ex.candidates[0]), "max_tokens": 1,
                         "prompt_logprobs": True})
            what.append(("answer", term, len(ex.candidates[0])))
    return reqs, what


def _sums(results: list[dict], what: list[tuple]) -> dict:
    """NLL sums and token counts per window length and per answer term, from vLLM's log-probs."""
    sums: dict = {}
    for r, (kind, key, item) in zip(results, what):
        logprobs = torch.tensor(r["logprobs"], dtype=torch.float64)  # [n - 1]: targets 1 … n-1
        if kind == "window":  # the targets score_windows keeps: from score_from on
            logprobs = logprobs[max(item.score_from - item.start - 1, 0):]
        else:
            logprobs = logprobs[-item:]
        total, tokens = sums.get(key, (0.0, 0))
        sums[key] = (total - float(logprobs.sum()), tokens + logprobs.numel())
    return sums


def vllm_measure(objective, handle, served: Path) -> dict:
    """One candidate (``handle``: its patch on ``objective.model``) scored by vLLM: ``{"nll": {L:
    mean NLL}, "retrieval": …, "needle": … (None when not in the objective), "parity": |Δ mean NLL|
    of the first window}``. ``served``: the folder the export is served from (rewritten per
    candidate). Raises ``Refused`` for a candidate vLLM cannot serve (the export's reason),
    ``EngineFailed`` when the driver dies, ``EngineDisagrees`` past the parity tolerance."""
    from ropescale.models import resolve_model
    from ropescale.serving.engines.vllm import export_vllm
    from ropescale.serving.rope import ExportRefused

    from ..engines import process
    from ..engines.process import EngineFailed
    from .tuner import Refused

    cfg = objective.cfg
    reqs, what = _requests(objective)
    serve = max(len(r["ids"]) for r in reqs)  # the positions vLLM rotates
    try:
        exp = export_vllm(handle, serve)
    except ExportRefused as e:
        raise Refused(f"{e} (engine: vllm)") from None
    first = next(i for i, w in enumerate(what) if w[0] == "window" and w[1] == max(cfg.lengths))
    ours = transformers_logprobs(objective.model, reqs[first]["ids"], objective.device)
    folder = vllm_model_folder(Path(resolve_model(cfg.model)), served, exp.config)
    request = {"mode": "score", "model": str(folder), "max_model_len": cfg.vllm.max_model_len or serve + 1,
               "dtype": cfg.dtype, "tensor_parallel_size": cfg.vllm.tensor_parallel_size,
               "data_parallel_size": cfg.vllm.data_parallel_size, "requests": reqs}
    got = process.run_engine("vllm", request, log_dir=served.parent / "logs", timeout=24 * 3600)
    if "error" in got:
        raise EngineFailed(f"vLLM {got.get('vllm', '')} refuses the exported model: {got['error']}")
    results = got["results"]
    if len(results) != len(reqs):
        raise EngineFailed(f"vLLM's driver answered {len(results)} of {len(reqs)} requests")
    theirs = torch.tensor(results[first]["logprobs"], dtype=torch.float64)
    diff = math.inf if bool(torch.isnan(theirs).any()) else abs(float(theirs.mean() - ours.mean()))
    tol = tolerance(cfg.vllm, cfg.dtype)
    if not diff <= tol:
        raise EngineDisagrees(
            f"{handle.strategy} {handle.params}: vLLM {got.get('vllm', '')} and transformers disagree on the first "
            f"window at {max(cfg.lengths)}: mean NLL {-float(theirs.mean()):.6g} vs {-float(ours.mean()):.6g} nats "
            f"(|Δ| {diff:.3g} > tolerance {tol:g}); the search stops")
    sums = _sums(results, what)
    mean = {k: total / tokens for k, (total, tokens) in sums.items()}
    return {"nll": {k: v for k, v in mean.items() if isinstance(k, int)}, "retrieval": mean.get("retrieval"),
            "needle": mean.get("needle"), "parity": diff}


def served_folder(output: Path) -> Path:
    """Where this process serves its candidates from, under the search folder (one per process:
    several processes may share a study)."""
    return Path(output) / "vllm" / f"candidate-{os.getpid()}"

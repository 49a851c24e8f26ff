"""``engine: vllm``: the harness's cells scored by vLLM, serving what ``ropescale patch --engine vllm``
writes (``ropescale.serving.export_vllm``), with the first example of every cell checked
against transformers.

Per cell (strategy × length): the patched transformers model's export for vLLM is written as a
model folder (``<output>/vllm/<strategy>@<L>/``: that ``config.json``, the weights and tokenizer
linked), then vLLM's driver (``vllm_driver.py`` mode ``score``, in vLLM's own environment:
``eval.engines.run_engine``) loads it once — ``tensor_parallel_size``, ``data_parallel_size`` and
``max_model_len`` passed through — and runs the task's requests:

the requests the task makes (``Task.engine_requests``: prompts whose log-probabilities vLLM returns
from its prompt log-probs, ``prompt_logprobs=0``, and prompts it continues greedily), turned back
into the task's part by the task (``Task.engine_parts``) and combined as the transformers engine's
(``Task.combine``): every task that asks only for log-probabilities and generations
(``eval.engines.scoring``) — perplexity, passkey, needle, niah_multikey.

The exactness check: the first example of every cell — its window (perplexity) or its prompt with
the answer (retrieval) — is also scored by the patched transformers model, and the cell is
refused (``EngineDisagrees``, one line; the cells before it are kept) when the mean NLL over its
positions differs by more than the parity tolerance (``vllm.parity_tolerance``; default 1e-4 nats
in float32 — ``ropescale parity`` measured ≤ 3e-5 per position on the bundled model — and 5e-2 in
bfloat16/float16, not measured here). The cell records the engine, its version, both numbers
and the engine's start-up and scoring seconds. Before that, the driver's answer is checked
against the requests (``checked_answer``: the version and timing fields, then the checks every
scoring engine's answers pass, ``eval.engines.scoring.check_answers``: one result per request, each
prompt's log-probabilities, finite and ≤ 0, no more tokens than asked): a short, incomplete or
impossible answer is ``EngineFailed`` in one line and the cell is not recorded.

Refused before anything loads (``check_engine``, one ``ConfigError`` line): vLLM not installed
(how to install it), a task that asks for more than vLLM answers (``Task.engine_asks``) or whose
options it cannot score (``Task.engine_refusal``), strategies vLLM cannot express (relative
rules, a query temperature — log-n or another rule —, strategies without a transformers rope
type, dynamic ones but dynamic NTK — frozen at L, the one scale the transformers engine uses
per window — and LongRoPE; perplexity's
``dynamic_block``), a ``max_model_len`` shorter than a cell needs, several launched processes
(vLLM parallelises itself). What depends on the loaded model — YaRN's cos/sin cache shorter than
a retrieval prompt plus its answer, per-layer-type patches — is refused at its cell, in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ropescale.errors import RopescaleError
from ropescale.runs.config import ConfigError, ConfigModel

from .. import process
from ..process import EngineAbsent, EngineFailed
from ..scoring import DEFAULT, ScoringEngine, check_answers, scoring_engine
from . import ENVIRONMENT

__all__ = ["EngineDisagrees", "VllmOptions", "VllmScoring", "check_engine", "checked_answer", "score_cell_vllm",
           "transformers_logprobs"]
_LINK_SKIP = {"config.json", "ropescale.json"}


class VllmOptions(ConfigModel):
    """``vllm:`` in an eval / sweep config (only with ``engine: vllm``: refused beside another engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per model replica (vLLM's tensor parallelism)")
    data_parallel_size: int = Field(1, ge=1, description="model replicas (vLLM's data parallelism)")
    max_model_len: int | None = Field(None, ge=2, description="vLLM's context length; default: what each cell needs")
    parity_tolerance: float | None = Field(None, gt=0, description=(
        "largest |Δ mean NLL| [nats] between vLLM and transformers on each cell's first example; default 1e-4 "
        "in float32, 5e-2 in bfloat16/float16"))

    def key(self) -> dict[str, Any]:
        """What changes the numbers: nothing here (parallelism and lengths change how, not what)."""
        return {}


class EngineDisagrees(RopescaleError, RuntimeError):
    """vLLM and transformers score a cell's first example differently beyond the tolerance."""


def tolerance(opts: VllmOptions, dtype: str) -> float:
    """The largest |Δ log p| [nats] allowed between vLLM and transformers on the parity check: the config's
    ``parity_tolerance``, else 1e-4 in float32 and 5e-2 in half precision."""
    if opts.parity_tolerance is not None:
        return opts.parity_tolerance
    return 1e-4 if dtype == "float32" else 5e-2


# --- the driver's answer, checked against what was asked before anything is recorded

class _Result(BaseModel):
    """One request's answer: log p of each prompt token after the first [nats] (when asked; the driver
    writes NaN where vLLM has none, which ``check_answers`` refuses), and the generated token ids."""

    logprobs: list[float] | None = None
    tokens: list[int] = Field(default_factory=list)


class _Answer(BaseModel):
    """``vllm_driver.py``'s ``score`` answer (without ``error``)."""

    results: list[_Result]
    vllm: str
    start_seconds: float
    score_seconds: float


def checked_answer(got: dict[str, Any], reqs: list[dict], where: str) -> _Answer:
    """The driver's answer to ``reqs`` when it is one: every field (``results``, ``vllm``,
    ``start_seconds``, ``score_seconds``), then the results against the requests as every scoring
    engine's are (``eval.engines.scoring.check_answers``: one per request, ``len(ids) - 1`` finite
    log-probabilities ≤ 0 where they were asked, at most ``max_tokens`` generated). ``EngineFailed``
    (one line naming the cell ``where`` and what is wrong) otherwise: a short answer would record a
    cell from part of its examples."""
    try:
        answer = _Answer.model_validate(got)
    except ValidationError as e:
        first = e.errors()[0]
        raise EngineFailed(f"{where}: vLLM's driver answered without a valid {'.'.join(map(str, first['loc']))} "
                           f"({first['msg']}); the cell is not recorded") from None
    check_answers(reqs, [r.model_dump() for r in answer.results], "vLLM's driver", where)
    return answer


# --- refusals before anything loads

class VllmScoring(ScoringEngine):
    """``engine: vllm``: the patch's export served by vLLM (see the module docstring)."""

    name = "vllm"
    answers = frozenset({"generate", "logprobs"})
    options = "vllm"
    environment = ENVIRONMENT

    def check(self, cfg, source: str = "config", processes: int = 1) -> None:
        """Everything ``engine: vllm`` can refuse before a model loads (see the module docstring)."""
        from ...tasks.base import get_task

        super().check(cfg, source, processes)  # a task asking for what vLLM does not answer
        task_cls = get_task(cfg.task)
        why = task_cls.engine_refusal(cfg.options)
        if why:
            raise ConfigError(f"{source}: {why} — use engine: transformers")
        for spec in cfg.strategies:
            why = unservable(spec.name, logn=spec.logn, temperature=spec.temperature,
                             dynamic_block=bool(getattr(cfg.options, "dynamic_block", None)))
            if why:
                raise ConfigError(f"{source}: strategies: {spec.display}: {why} (engine: vllm; use engine: "
                                  "transformers)")
        if cfg.vllm.max_model_len is not None:
            need = task_cls.engine_length(cfg.options, max(cfg.lengths))
            if cfg.vllm.max_model_len < need:
                raise ConfigError(f"{source}: vllm.max_model_len: {cfg.vllm.max_model_len} is shorter than the "
                                  f"{need} tokens a {cfg.task} cell at length {max(cfg.lengths)} holds")
        check_processes(source, processes)
        require_vllm(source)

    def score_cell(self, cfg, task, model, examples, spec, params, length, train_length, device, output):
        return score_cell_vllm(cfg, task, model, examples, spec, params, length, train_length, device, output)


def check_engine(cfg, source: str = "config", processes: int = 1) -> None:
    """``VllmScoring().check``: everything ``engine: vllm`` refuses before a model loads."""
    VllmScoring().check(cfg, source, processes)


def unservable(name: str, *, logn: bool = False, temperature: Any = None, dynamic_block: bool = False,
               static_only: bool = False) -> str | None:
    """Why vLLM cannot serve strategy ``name`` (one clause), or None: a relative-position rule, a query
    temperature, no transformers rope type, a strategy recomputed from the length (dynamic NTK and
    LongRoPE excepted, served frozen at a cell's length — unless ``static_only``: several lengths in
    one engine), dynamic NTK scored block-wise (``dynamic_block``)."""
    from ropescale.strategies import get_strategy

    strat = get_strategy(name)
    if strat.kind != "frequency":
        return "a relative-position rule applied inside attention; vLLM has no setting for it"
    if logn or temperature:
        return "a query temperature (log-n or another rule) has no vLLM setting"
    if strat.export is None:
        return "no transformers rope type to translate, so vLLM cannot express it"
    if strat.dynamic and (static_only or strat.served is None):
        return "recomputes its frequencies from the sequence length; vLLM serves one static rotation"
    if strat.dynamic and dynamic_block and strat.served == "freeze":
        return "dynamic_block scores block-wise with a scale per prefix; vLLM serves one static rotation"
    return None


def check_processes(source: str, processes: int) -> None:
    """``ConfigError`` for a run launched on several processes: vLLM parallelises itself."""
    if processes > 1:
        raise ConfigError(f"{source}: engine: vllm runs in one process and parallelises itself "
                          "(vllm.tensor_parallel_size, vllm.data_parallel_size); do not launch it with "
                          "accelerate launch")


def require_vllm(source: str) -> None:
    """``ConfigError`` naming the install script when vLLM's environment is absent."""
    try:
        process.require_engine(ENVIRONMENT.engine)
    except EngineAbsent as e:
        raise ConfigError(f"{source}: engine: vllm: {e}") from None


# --- one cell

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


def vllm_model_folder(src: Path, dst: Path, config: dict, generation: dict | None = None) -> Path:
    """A model folder for vLLM: ``config`` as config.json, every other file of ``src`` linked — but
    generation_config.json, written with ``generation``'s keys set where there are any."""
    from ropescale.serving.engines import write_generation

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in _LINK_SKIP and not (dst / f.name).exists():
            if f.name == "generation_config.json" and generation:
                continue
            os.symlink(f.resolve(), dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    write_generation(src, dst, generation)
    return dst


def score_cell_vllm(cfg, task, model, examples, spec, params: dict, length: int, train_length: int, device,
                    output: Path) -> dict[str, Any]:
    """The task's metrics for one cell scored by vLLM, plus ``engine``, ``engine_version``,
    ``parity`` and the engine's seconds. Raises ``ConfigError`` (vLLM cannot serve this cell: the
    export's reason), ``EngineFailed`` (its driver died) and ``EngineDisagrees``."""
    from ropescale.models import resolve_model
    from ropescale.patching import patch
    from ropescale.serving.engines.vllm import export_vllm
    from ropescale.serving.rope import ExportRefused


    reqs, parity_index = task.engine_requests(examples)
    serve = max(len(r["ids"]) + r["max_tokens"] - 1 for r in reqs)  # the positions vLLM rotates
    slug = "".join(c if c.isalnum() or c in "._=-" else "_" for c in spec.display)[:48] + f"@{length}"
    with patch(model, spec.name, original_max_position_embeddings=train_length, logn=spec.logn,
               temperature=spec.temperature, **params) as handle:
        try:  # dynamic NTK: the one scale the transformers engine uses for a whole window of L
            freeze = length if handle.strategy_obj.served == "freeze" else None
            exp = export_vllm(handle, serve, freeze_dynamic_at=freeze)
        except ExportRefused as e:
            raise ConfigError(f"{spec.display} @ {length}: {e} (engine: vllm)") from None
        ours = transformers_logprobs(model, reqs[parity_index]["ids"], device)
    folder = vllm_model_folder(Path(resolve_model(cfg.model)), output / "vllm" / slug, exp.config, exp.generation)
    max_model_len = cfg.vllm.max_model_len or serve + 1
    got = process.run_engine(VllmScoring.name, {"mode": "score", "model": str(folder), "max_model_len": max_model_len,
                              "dtype": cfg.dtype, "tensor_parallel_size": cfg.vllm.tensor_parallel_size,
                              "data_parallel_size": cfg.vllm.data_parallel_size, "requests": reqs},
                     log_dir=output / "logs", timeout=24 * 3600)
    if "error" in got:
        raise EngineFailed(f"{spec.display} @ {length}: vLLM {got.get('vllm', '')} refuses the exported model: "
                           f"{got['error']}")
    answer = checked_answer(got, reqs, f"{spec.display} @ {length}")
    results = [r.model_dump() for r in answer.results]
    theirs = torch.tensor(results[parity_index]["logprobs"], dtype=torch.float64)
    tol = tolerance(cfg.vllm, cfg.dtype)
    d_mean = abs(float(theirs.mean() - ours.mean()))  # theirs finite (checked_answer); ours NaN: refused
    max_d = float((theirs - ours).abs().max())
    if not d_mean <= tol:
        raise EngineDisagrees(f"{spec.display} @ {length}: vLLM {answer.vllm} and transformers disagree on the "
                              f"cell's first example: mean NLL {-float(theirs.mean()):.6g} vs {-float(ours.mean()):.6g}"
                              f" nats (|Δ| {d_mean:.3g} > tolerance {tol:g}; max |Δ log p| {max_d:.3g}); the cell "
                              "is not recorded")
    parts = task.engine_parts(examples, results, length)
    from ropescale.strategies import get_strategy

    metrics = task.combine([parts], examples, length=length, strategy=get_strategy(spec.name))
    return {**metrics, "engine": "vllm", "engine_version": answer.vllm,
            "parity": {"mean_nll_diff": d_mean, "max_abs_dlogp": max_d, "tokens": int(ours.numel()),
                       "tolerance": tol, "against": f"transformers {scoring_engine(DEFAULT).version()}"},
            "engine_start_seconds": round(answer.start_seconds, 3),
            "engine_score_seconds": round(answer.score_seconds, 3),
            "examples": len(examples), "vllm_export": exp.notes}

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

The cell's patch is exported and the driver run by ``VllmScoring.answer``, which a search's candidates go
through as well (``eval.search.objective``: every window and answer of a candidate in one driver call, the
folder ``<search>/vllm/candidate-<pid>/`` rewritten per candidate); the checks and the parity check are every
engine's (``eval.engines.answering``).

Refused before anything loads (``check_engine``, ``check_demand``: one ``ConfigError`` line): vLLM not installed
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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ropescale.runs.config import ConfigError, ConfigModel

from .. import process
from ..answering import Answered, EngineDisagrees, transformers_logprobs
from ..process import EngineAbsent, EngineFailed
from ..scoring import DEFAULT, Demand, ScoringEngine, check_answers
from . import ENVIRONMENT

__all__ = ["EngineDisagrees", "VllmOptions", "VllmScoring", "check_engine", "checked_answer", "transformers_logprobs",
           "unservable", "vllm_model_folder"]
_LINK_SKIP = {"config.json", "ropescale.json"}


class VllmOptions(ConfigModel):
    """``vllm:`` in an eval / sweep / search config (only with ``engine: vllm``: refused beside another engine)."""

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


def tolerance(opts: VllmOptions, dtype: str) -> float:
    """The largest |Δ log p| [nats] allowed between vLLM and transformers on the parity check: the config's
    ``parity_tolerance``, else 1e-4 in float32 and 5e-2 in half precision."""
    if opts is not None and opts.parity_tolerance is not None:
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


class VllmScoring(ScoringEngine):
    """``engine: vllm``: the patch's export served by vLLM (see the module docstring)."""

    name = "vllm"
    title = "vLLM"
    answers = frozenset({"generate", "logprobs"})
    options = "vllm"
    Options = VllmOptions
    environment = ENVIRONMENT

    def check_demand(self, demand: Demand, options: Any, source: str = "config", processes: int = 1) -> None:
        """What vLLM refuses before anything loads (see the module docstring)."""
        for spec in demand.strategies:
            why = unservable(spec.name, logn=spec.logn, temperature=spec.temperature,
                             dynamic_block=demand.dynamic_block, static_only=demand.static is not None)
            if why:
                static = f"; {demand.static}" if demand.static else ""
                raise ConfigError(f"{source}: {demand.key}: {spec.display}: {why}{static} (engine: vllm; use engine: "
                                  f"{DEFAULT})")
        if options is not None and options.max_model_len is not None and options.max_model_len < demand.tokens:
            raise ConfigError(f"{source}: vllm.max_model_len: {options.max_model_len} is shorter than the "
                              f"{demand.tokens} tokens {demand.holds}")
        check_processes(source, processes)
        require_vllm(source)

    def tolerance(self, options: Any, dtype: str) -> float:
        return tolerance(options, dtype)

    def answer(self, requests: list[dict[str, Any]], serving) -> Answered:
        """The requests scored by vLLM's driver on the patch's export, written to ``serving.folder``.
        Raises ``ExportRefused`` (the export's reason) and ``EngineFailed`` (the driver died or refused the
        folder, or answered without a field)."""
        from ropescale.models import resolve_model
        from ropescale.serving.engines.vllm import export_vllm

        serve = max(len(r["ids"]) + r["max_tokens"] - 1 for r in requests)  # the positions vLLM rotates
        exp = export_vllm(serving.handle, serve, freeze_dynamic_at=serving.freeze)
        folder = vllm_model_folder(Path(resolve_model(serving.source)), serving.folder, exp.config, exp.generation)
        opts = serving.options or VllmOptions()
        got = process.run_engine(self.name, {"mode": "score", "model": str(folder),
                                             "max_model_len": opts.max_model_len or serve + 1, "dtype": serving.dtype,
                                             "tensor_parallel_size": opts.tensor_parallel_size,
                                             "data_parallel_size": opts.data_parallel_size, "requests": requests},
                                 log_dir=serving.log_dir, timeout=24 * 3600)
        if "error" in got:
            raise EngineFailed(f"{serving.where}: vLLM {got.get('vllm', '')} refuses the exported model: "
                               f"{got['error']}")
        answer = checked_answer(got, requests, serving.where)
        return Answered(results=[r.model_dump() for r in answer.results], version=answer.vllm,
                        record={"engine_start_seconds": round(answer.start_seconds, 3),
                                "engine_score_seconds": round(answer.score_seconds, 3), "vllm_export": exp.notes})


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


def vllm_model_folder(src: Path, dst: Path, config: dict, generation: dict | None = None) -> Path:
    """A model folder for vLLM: ``config`` as config.json, every other file of ``src`` linked — but
    generation_config.json, written with ``generation``'s keys set where there are any (a link left by an
    earlier export into the same folder is replaced, never written through)."""
    from ropescale.serving.engines import write_generation

    dst.mkdir(parents=True, exist_ok=True)
    if generation and (dst / "generation_config.json").is_symlink():
        (dst / "generation_config.json").unlink()
    for f in src.iterdir():
        if f.is_file() and f.name not in _LINK_SKIP and not (dst / f.name).exists():
            if f.name == "generation_config.json" and generation:
                continue
            os.symlink(f.resolve(), dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    write_generation(src, dst, generation)
    return dst

"""Scoring engines: what scores a harness cell (``engine:`` in an eval / sweep config, ``--engine`` on
``ropescale eval``).

The contract (lm-evaluation-harness's, reduced to what the tasks here need): a task asks, an engine
answers. A task that an engine outside this process can score declares what it asks for in
``Task.engine_asks`` — ``"logprobs"`` (each prompt token's log-probability) and/or ``"generate"``
(greedy tokens after a prompt) — and turns a cell's examples into requests (``Task.engine_requests``:
``{"ids", "max_tokens", "prompt_logprobs"}`` each) and the answers back into its part for ``combine``
(``Task.engine_parts``). A scoring engine declares what it answers (``answers``) and answers requests
under one live patch (``answer``; ``eval.engines.answering``), through which a sweep's cell
(``score_cell(cell, examples, bench)``, ``eval.cells``) and a search's candidate are scored
(``score_requests``); a task is scored by an engine when the engine answers every
kind of request the task asks. No task name lives in an engine module and no engine name in the
sweep: ``scoring_engine(cfg.engine)`` is all the sweep asks for.

One engine per harness package, registered by subclassing ``ScoringEngine`` with a ``name`` as the engine's
``scorer`` (``eval.engines.registry.ROLES``): ``transformers`` (``eval/engines/transformers/scoring.py``: the
patched model in this process, the default — every task), ``vllm`` and ``mlx`` (``eval/engines/<engine>/
scoring.py``: the patch's export served by the engine); an installed package adds one through the
``ropescale.engines`` entry points.

The registry holds every engine to the contract, bundled or plugin: each subclass's ``score_cell`` is
called with the task as it answers (``AnsweringTask``), whose ``engine_parts`` first checks the answers
against the requests (``check_answers``: one answer per request, each prompt's ``len(ids) - 1``
log-probabilities where asked — finite, none above 0 by more than rounding —, at most ``max_tokens``
generated token ids, the tokens of a generation request present); a cell whose answers were not
passed through ``engine_parts``, or whose metrics lack the task's, is refused too. Each is
``ScoringEngineFailed``, one line naming the engine and the cell, before anything is recorded. An
exception raised inside a plugin's engine (``check``, ``score_cell``, ``answer``, ``version``) is that engine's
failure, one line naming it and its message (``scoring engine 'x' failed: RuntimeError: …``); a
bundled engine's (a module of this package) surfaces as it is: a bug of ropescale's.

Errors: ``UnknownEngineError`` (one line, the known names) for an unknown engine; each engine's
``check`` raises ``ConfigError`` (one line) for what it cannot score, before anything loads.
"""

from __future__ import annotations

import difflib
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError

from ropescale.errors import RopescaleError
from ropescale.runs.config import ConfigError, NestedErrors, error_parts
from ropescale.serving.engines import UnknownEngineError

from .answering import Answered, EngineDisagrees, Scored, Serving, slug, transformers_logprobs
from .process import EngineFailed, Environment
from .registry import ROLES, add_role, role_names

__all__ = ["DEFAULT", "ROUNDING", "AnsweringTask", "Demand", "ScoringEngine", "ScoringEngineFailed", "check_answers",
           "engine_sections", "scoring_engine", "scoring_engine_names", "section_keys"]

DEFAULT = "transformers"  # the engine a config without ``engine:`` is scored by (run identities leave it out)


ROUNDING = 1e-4  # a log-probability above 0 by more than this [nats] is wrong, not float32 rounding


class ScoringEngineFailed(EngineFailed):
    """A scoring engine's answers break the contract, or a plugin's engine raised: one line naming the
    engine (and the cell); nothing is recorded for the cell."""


# --- the answers, checked against the requests before a task turns them into its part

def check_answers(requests: list[dict[str, Any]], results: Any, who: str, where: str) -> None:
    """``ScoringEngineFailed`` — ``"{where}: {who} <what is wrong>; the cell is not recorded"``, one line —
    unless ``results`` answers ``requests`` (``Task.engine_requests``'): a list of one dict per request,
    each holding ``len(ids) - 1`` log-probabilities [nats] where ``prompt_logprobs`` is asked (finite,
    none above 0 by more than ``ROUNDING``), and ``tokens``, at most ``max_tokens`` token ids (non-negative
    integers; required for a generation request, one not asking for log-probabilities). ``who``: the
    engine as messages name it (``scoring engine 'x'``); ``where``: the cell (``yarn @ 4096``)."""
    if not isinstance(results, (list, tuple)):
        problem = f"answered {type(results).__name__}, not a list of the {len(requests)} answers asked"
    elif len(results) != len(requests):
        problem = f"answered {len(results)} of the {len(requests)} requests asked"
    else:
        problem = next(filter(None, (_answer_problem(i, req, res)
                                     for i, (req, res) in enumerate(zip(requests, results)))), None)
    if problem:
        raise ScoringEngineFailed(f"{where}: {who} {problem}; the cell is not recorded")


def _answer_problem(i: int, req: dict[str, Any], res: Any) -> str | None:
    """What is wrong with answer ``res`` to request number ``i``, ``req`` (a clause), or None."""
    if not isinstance(res, Mapping):
        return f"answered request {i} with a {type(res).__name__}, not a dict of logprobs and tokens"
    if req["prompt_logprobs"]:
        problem = _logprobs_problem(res.get("logprobs"), len(req["ids"]) - 1)
        if problem:
            return f"answered request {i} with {problem}"
    if "tokens" not in res:
        return None if req["prompt_logprobs"] else f"answered generation request {i} without its tokens"
    tokens = res["tokens"]
    if not isinstance(tokens, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return f"answered request {i} with tokens that are not token ids: {str(tokens)[:80]}"
    if len(tokens) > req["max_tokens"]:
        return f"generated {len(tokens)} tokens for request {i}, more than the {req['max_tokens']} asked"
    return None


def _logprobs_problem(logprobs: Any, want: int) -> str | None:
    """What is wrong with an answer's ``logprobs`` for a prompt whose ``want`` tokens after the first
    are scored (a clause), or None."""
    import torch

    if logprobs is None:
        return "no log-probabilities"
    try:
        lp = torch.as_tensor(logprobs, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        lp = None
    if isinstance(logprobs, (str, bytes, Mapping)) or lp is None or lp.dim() != 1:
        return f"log-probabilities that are not a list of numbers: {str(logprobs)[:80]}"
    if lp.numel() != want:
        return f"{lp.numel()} log-probabilities for a prompt of {want + 1} tokens ({want} asked)"
    for bad, why in ((~torch.isfinite(lp), "not a finite number"),
                     (lp > ROUNDING, "above 0: a probability above 1")):
        if bad.any():
            j = int(bad.nonzero()[0])
            return f"a log-probability of {lp[j].item():.6g} at position {j}, {why}"
    return None


class AnsweringTask:
    """The task as a scoring engine sees it while it scores a cell: every attribute the task's, but
    ``engine_parts`` checks the answers against the task's requests first (``check_answers``) and
    notes that the answers were checked (``answered``)."""

    def __init__(self, task, who: str, where: str):
        self._task, self._who, self._where, self.answered = task, who, where, False

    def __getattr__(self, name: str) -> Any:
        if name == "_task":  # not set yet (a copy being made): no task to ask
            raise AttributeError(name)
        return getattr(self._task, name)

    def engine_parts(self, examples: Any, results: Any, length: int) -> Any:
        """The task's part from ``results``, once they answer its requests for ``examples``."""
        requests, _ = self._task.engine_requests(examples)
        check_answers(requests, results, self._who, self._where)
        self.answered = True
        return self._task.engine_parts(examples, results, length)


@contextmanager
def _failures_named(engine: ScoringEngine, where: str | None = None) -> Iterator[None]:
    """An exception raised inside a plugin's engine as the engine's failure (``ScoringEngineFailed``, one
    line naming it and its message, and the cell ``where`` when scoring one); a ``RopescaleError`` (the
    engine's own one-line refusal), running out of memory (the sweep says what to drop) and anything a
    bundled engine raises pass as they are."""
    try:
        yield
    except (RopescaleError, MemoryError):
        raise
    except Exception as e:
        import torch

        if engine.builtin or isinstance(e, torch.OutOfMemoryError):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        line = f"{engine.label} failed: {type(e).__name__}: {first}"
        raise ScoringEngineFailed(line if where is None else f"{where}: {line}; the cell is not recorded") from e


def _own_failures(method: Callable) -> Callable:
    """``method`` of an engine with its exceptions named as the engine's (``_failures_named``)."""

    @functools.wraps(method)
    def call(self, *args, **kw):
        with _failures_named(self):
            return method(self, *args, **kw)

    return call


def _contracted(score_cell: Callable) -> Callable:
    """An engine's ``score_cell`` held to the contract (see the module docstring)."""

    @functools.wraps(score_cell)
    def scored(self, cell, examples, bench) -> dict[str, Any]:
        where, task = cell.where, bench.task
        asked = task if isinstance(task, AnsweringTask) else AnsweringTask(task, self.label, where)
        with _failures_named(self, where):
            result = score_cell(self, cell, examples, replace(bench, task=asked))
        problem = None
        if not asked.answered:
            problem = "returned the cell without passing its answers through the task (Task.engine_parts)"
        elif not isinstance(result, dict) or any(m.key not in result for m in task.metrics):
            keys = ", ".join(m.key for m in task.metrics)
            problem = f"returned {str(result)[:80]} for the cell, not a dict of the task's metrics ({keys})"
        if problem:
            raise ScoringEngineFailed(f"{where}: {self.label} {problem}; the cell is not recorded")
        return result

    return scored


@dataclass(frozen=True)
class Demand:
    """What a pipeline will ask an engine to serve, known before a model loads (``ScoringEngine.check_demand``).

    strategies: what is patched in (``StrategySpec``-likes: ``name``, ``display``, ``logn``, ``temperature``).
    tokens: the longest sequence one export must hold, with what it generates [tokens].
    holds: what that sequence is, for messages (``a perplexity cell at length 1024``).
    key: the config key naming the strategies (``strategies``, ``strategy``).
    static: why one export serves several lengths (nothing may be frozen at a length), None when it does not.
    dynamic_block: a dynamic strategy is scored block-wise (a scale per prefix).
    """

    strategies: Sequence[Any]
    tokens: int
    holds: str
    key: str = "strategies"
    static: str | None = None
    dynamic_block: bool = False


class ScoringEngine:
    """One scoring engine: subclass with ``name`` set (registering it).

    name: its name in configs (``engine: NAME``) and records.
    title: how messages name what runs (``vLLM``, ``mlx-lm``); default its name.
    answers: the kinds of request it answers (``"logprobs"``, ``"generate"``).
    in_process: it is this process's patched model (the harness measures the cell itself: every task,
        ``accelerate launch`` splitting the examples); otherwise requests are handed to ``answer``.
    options: the name of its own config section (``vllm:``), None when it has none; ``Options`` its
        pydantic model (the section's default when left out).
    environment: its own Python and scripts (``eval.engines.process.Environment``), None when it has none.
    builtin: set on subclassing: defined in a module of this package (its exceptions are ropescale's
        bugs), not a plugin's (its exceptions are its own failures, one line).

    An engine outside this process implements ``answer`` (requests under one live patch →
    ``eval.engines.answering.Answered``): a sweep's cells (``score_cell``) and a search's candidates are
    scored through it. Subclassing holds the engine to the contract (the module docstring): its
    ``score_cell`` answers through ``AnsweringTask``; a plugin's ``check``, ``score_cell``, ``answer`` and
    ``version`` raise one line.
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    answers: ClassVar[frozenset[str]] = frozenset()
    in_process: ClassVar[bool] = False
    options: ClassVar[str | None] = None
    Options: ClassVar[type | None] = None
    environment: ClassVar[Environment | None] = None
    builtin: ClassVar[bool] = True

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.builtin = cls.__module__.startswith(f"{__package__}.")
        if "score_cell" in cls.__dict__:
            cls.score_cell = _contracted(cls.__dict__["score_cell"])
        for method in ("check", "version") if not cls.builtin else ():
            if method in cls.__dict__:
                setattr(cls, method, _own_failures(cls.__dict__[method]))
        if not cls.__dict__.get("title"):
            cls.title = cls.__dict__.get("name") or cls.title
        add_role(cls, "scorer")

    @property
    def label(self) -> str:
        """How messages name the engine: ``scoring engine 'NAME'``."""
        return f"scoring engine '{self.name}'"

    def scores(self, task_cls) -> bool:
        """Whether this engine scores ``task_cls``: in process, or answering every kind of request it asks."""
        return self.in_process or (bool(task_cls.engine_asks) and task_cls.engine_asks <= self.answers)

    def check(self, cfg, source: str = "config", processes: int = 1) -> None:
        """Everything this engine refuses for the eval config ``cfg`` before a model loads: ``ConfigError``
        (one line). A task it does not score; outside this process, task options no engine can score
        (``Task.engine_refusal``) and what ``check_demand`` refuses of the cells."""
        from ..tasks.base import get_task

        task_cls = get_task(cfg.task)
        if not self.scores(task_cls):
            can = " or ".join(sorted(n for n in scoring_engine_names() if scoring_engine(n).scores(task_cls)))
            if not task_cls.engine_asks:
                raise ConfigError(f"{source}: engine: {self.name} cannot score {cfg.task}: it measures the model in "
                                  f"this process only — use engine: {can}")
            missing = ", ".join(sorted(task_cls.engine_asks - self.answers))
            raise ConfigError(f"{source}: engine: {self.name} does not answer {missing}, which {cfg.task} asks for "
                              f"— use engine: {can}")
        if self.in_process:
            return
        why = task_cls.engine_refusal(cfg.options)
        if why:
            raise ConfigError(f"{source}: {why} — use engine: {DEFAULT}")
        longest = max(cfg.lengths)
        demand = Demand(strategies=cfg.strategies, tokens=task_cls.engine_length(cfg.options, longest),
                        holds=f"a {cfg.task} cell at length {longest}",
                        dynamic_block=bool(getattr(cfg.options, "dynamic_block", None)))
        self.check_demand(demand, self.section(cfg), source, processes)

    def check_demand(self, demand: Demand, options: Any, source: str = "config", processes: int = 1) -> None:
        """What this engine refuses of ``demand`` (its section ``options``) before a model loads, whatever the
        pipeline: ``ConfigError`` (one line). Default: nothing."""

    def section(self, cfg) -> Any:
        """This engine's config section of ``cfg`` (``cfg.engine_options``, read by ``engine_sections``), None when
        it has none."""
        return getattr(cfg, "engine_options", None) if self.options else None

    def tolerance(self, options: Any, dtype: str) -> float | None:
        """The largest |Δ mean NLL| [nats] allowed between this engine and transformers on the checked request
        (``eval.engines.answering``); None: no parity check (default)."""
        return None

    def score_requests(self, requests: list[dict[str, Any]], checked: int, serving: Serving) -> Scored:
        """``requests`` (``Task.engine_requests``' format) answered by this engine (``answer``) under
        ``serving``'s live patch and checked (``eval.engines.answering``): the answers against the requests
        (``check_answers``), then request ``checked`` (asking for log-probabilities) against the patched
        transformers model where the engine has a ``tolerance`` — ``EngineDisagrees`` past it, one line.
        ``ExportRefused`` propagates (the patch cannot be served)."""
        import torch

        with _failures_named(self, serving.where):
            answered = self.answer(requests, serving)
        if not isinstance(answered, Answered):
            raise ScoringEngineFailed(f"{serving.where}: {self.label} answered {type(answered).__name__}, not an "
                                      f"Answered; {serving.stops}")
        check_answers(requests, answered.results, self.label, serving.where)
        tol = self.tolerance(serving.options, serving.dtype)
        if tol is None:
            return Scored(answered.results, answered.version, None, answered.record)
        ours = transformers_logprobs(serving.model, requests[checked]["ids"], serving.device)
        theirs = torch.tensor(answered.results[checked]["logprobs"], dtype=torch.float64)
        d_mean = abs(float(theirs.mean() - ours.mean()))  # theirs finite (check_answers); ours NaN: refused
        max_d = float((theirs - ours).abs().max())
        if not d_mean <= tol:
            raise EngineDisagrees(
                f"{serving.where}: {self.title} {answered.version} and transformers disagree on "
                f"{serving.checked_what}: mean NLL {-float(theirs.mean()):.6g} vs {-float(ours.mean()):.6g} nats "
                f"(|Δ| {d_mean:.3g} > tolerance {tol:g}; max |Δ log p| {max_d:.3g}); {serving.stops}")
        parity = {"mean_nll_diff": d_mean, "max_abs_dlogp": max_d, "tokens": int(ours.numel()), "tolerance": tol,
                  "against": f"transformers {scoring_engine(DEFAULT).version()}"}
        return Scored(answered.results, answered.version, parity, answered.record)

    def answer(self, requests: list[dict[str, Any]], serving: Serving) -> Answered:
        """Answer ``requests`` (``Task.engine_requests``' format) under the live patch ``serving``
        (``eval.engines.answering.Serving``): an ``Answered``. Raises ``ropescale.serving.rope.ExportRefused``
        when this patch cannot be served (one line)."""
        raise NotImplementedError(f"{self.label} answers no requests outside a sweep's cells (no answer())")

    def score_cell(self, cell, examples, bench) -> dict[str, Any]:
        """The metrics of ``cell`` (``eval.cells.Cell``: a strategy at a length, its parameters resolved) on
        ``examples`` (the task's at the cell's length), scored on ``bench`` (``eval.cells.Bench``: config, task,
        model, device, run folder): ``task.combine``'s metrics plus ``engine`` and ``engine_version`` (and
        ``parity``, the engine's record). The default hands the task's requests to ``answer`` under the cell's
        patch (``score_requests``). Raises ``ConfigError`` for what it cannot serve at this cell (one line)."""
        from ropescale.serving.rope import ExportRefused
        from ropescale.strategies import get_strategy

        task, length, output = bench.task, cell.length, Path(bench.output)
        reqs, checked = task.engine_requests(examples)
        with cell.patch(bench.model) as handle:
            # dynamic NTK: the one scale the transformers engine uses for a whole window of L
            freeze = length if handle.strategy_obj.served == "freeze" else None
            serving = Serving(handle=handle, model=bench.model, tokenizer=task.tokenizer, source=bench.cfg.model,
                              dtype=bench.cfg.dtype, options=self.section(bench.cfg),
                              folder=output / self.name / slug(cell.spec.display, length), log_dir=output / "logs",
                              where=cell.where, device=bench.device, freeze=freeze)
            try:
                scored = self.score_requests(reqs, checked, serving)
            except ExportRefused as e:
                raise ConfigError(f"{cell.where}: {e} (engine: {self.name})") from None
        metrics = task.combine([task.engine_parts(examples, scored.results, length)], examples, length=length,
                               strategy=get_strategy(cell.spec.name))
        return {**metrics, "engine": self.name, "engine_version": scored.version,
                **({"parity": scored.parity} if scored.parity is not None else {}), **scored.record,
                "examples": len(examples)}

    def version(self) -> str:
        """The version a record names (for an in-process engine; others report theirs per cell)."""
        return "unknown"


ScoringEngine.score_cell = _contracted(ScoringEngine.score_cell)  # the default, held to the contract too


def engine_sections(raw: Any, *, lenient: bool = False) -> Any:
    """A raw config (a mapping, before validation) with its engine's section read, as a task's options are: the
    section named by the engine's ``options`` key (``vllm:``; or ``engine_options:``, a dumped config's) validated
    by the engine's own ``Options`` into ``engine_options`` (its defaults where left out; None for an engine
    without options). Every engine's section is a key of the raw config, registered engines and plugins alike,
    so an engine adds its section without a field in any config.

    Raises ``ValueError`` (one line) for another engine's section given (it would be ignored; with ``lenient``,
    one equal to its defaults, a dumped config read back, is dropped), a section given twice or one for an
    engine without options, and ``NestedErrors`` (paths under the section's key) for the engine's own."""
    if not isinstance(raw, dict):
        return raw
    raw, name = dict(raw), raw.get("engine", DEFAULT)
    known = scoring_engine_names()
    given = raw.pop("engine_options", None)
    dumped = given is not None
    for other in known:
        engine = scoring_engine(other)
        key = engine.options
        if not key or key not in raw:
            continue
        value = raw.pop(key)
        if other == name:
            if given is not None and value is not None:
                raise ValueError(f"{key}: the engine's options are given twice (under {key}: and engine_options:); "
                                 "keep one")
            given = value if value is not None else given
        elif value is not None and name in known:
            if lenient and _defaults(engine, value):
                continue
            raise ValueError(f"{key}: settings of engine: {other}, but this config's engine is {name} (which "
                             f"would ignore them); set engine: {other}, or drop the {key}: section")
    if not isinstance(name, str) or name not in known:
        return raw  # the engine field's own validator names the unknown engine
    own = scoring_engine(name)
    if lenient and dumped and not own.options and any(
            _defaults(scoring_engine(n), given) for n in known if n != name and scoring_engine(n).options):
        given = None  # a dumped config's engine_options, another engine's at its defaults: read back as absent
    if not own.options:
        if given:
            raise ValueError(f"engine_options: engine {name} takes no options")
        raw["engine_options"] = None
        return raw
    if given is not None and not isinstance(given, (dict, own.Options)):
        raise ValueError(f"{own.options}: expected a mapping of engine {name}'s options")
    try:
        raw["engine_options"] = given if isinstance(given, own.Options) else own.Options.model_validate(given or {})
    except ValidationError as e:  # the section's keys read as paths under its name
        raise NestedErrors(error_parts(e, own.Options)).under(own.options) from None
    return raw


def _defaults(engine, value: Any) -> bool:
    """Whether ``value`` is ``engine``'s options at their defaults (a dumped config's section)."""
    try:
        return engine.Options.model_validate(value) == engine.Options()
    except ValidationError:
        return False


def section_keys() -> list[str]:
    """The config keys of the registered engines' sections (``vllm``, a plugin's), sorted: a config's top level
    accepts them."""
    return sorted({scoring_engine(n).options for n in scoring_engine_names() if scoring_engine(n).options})


def scoring_engine_names() -> list[str]:
    """The registered scoring engines' names (bundled and plugins), sorted."""
    return role_names("scorer")


def scoring_engine(name: str) -> ScoringEngine:
    """The scoring engine ``name`` (an instance); ``UnknownEngineError`` (one line: a close match and the known
    scoring engines) otherwise."""
    known = scoring_engine_names()
    roles = ROLES.get(name) if isinstance(name, str) else None
    if roles is None or roles.scorer is None:
        hint = difflib.get_close_matches(str(name), known, n=1)
        raise UnknownEngineError(f"unknown scoring engine {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                 + f"; known scoring engines: {', '.join(known)}")
    return roles.scorer()

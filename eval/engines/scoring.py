"""Scoring engines: what scores a harness cell (``engine:`` in an eval / sweep config, ``--engine`` on
``ropescale eval``).

The contract (lm-evaluation-harness's, reduced to what the tasks here need): a task asks, an engine
answers. A task that an engine outside this process can score declares what it asks for in
``Task.engine_asks`` — ``"logprobs"`` (each prompt token's log-probability) and/or ``"generate"``
(greedy tokens after a prompt) — and turns a cell's examples into requests (``Task.engine_requests``:
``{"ids", "max_tokens", "prompt_logprobs"}`` each) and the answers back into its part for ``combine``
(``Task.engine_parts``). A scoring engine declares what it answers (``answers``) and scores a cell
from those requests (``score_cell``); a task is scored by an engine when the engine answers every
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
exception raised inside a plugin's engine (``check``, ``score_cell``, ``version``) is that engine's
failure, one line naming it and its message (``scoring engine 'x' failed: RuntimeError: …``); a
bundled engine's (a module of this package) surfaces as it is: a bug of ropescale's.

Errors: ``UnknownEngineError`` (one line, the known names) for an unknown engine; each engine's
``check`` raises ``ConfigError`` (one line) for what it cannot score, before anything loads.
"""

from __future__ import annotations

import difflib
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from ropescale.errors import RopescaleError
from ropescale.runs.config import ConfigError
from ropescale.serving.engines import UnknownEngineError

from .process import EngineFailed, Environment
from .registry import ROLES, add_role, role_names

__all__ = ["DEFAULT", "ROUNDING", "AnsweringTask", "ScoringEngine", "ScoringEngineFailed", "check_answers",
           "scoring_engine", "scoring_engine_names"]

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
    def scored(self, cfg, task, model, examples, spec, params: dict, length: int, train_length: int, device,
               output: Path) -> dict[str, Any]:
        where = f"{spec.display} @ {length}"
        asked = task if isinstance(task, AnsweringTask) else AnsweringTask(task, self.label, where)
        with _failures_named(self, where):
            result = score_cell(self, cfg, asked, model, examples, spec, params, length, train_length, device,
                                output)
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


class ScoringEngine:
    """One scoring engine: subclass with ``name`` set (registering it).

    name: its name in configs (``engine: NAME``) and records.
    answers: the kinds of request it answers (``"logprobs"``, ``"generate"``).
    in_process: it is this process's patched model (the harness measures the cell itself: every task,
        ``accelerate launch`` splitting the examples); otherwise ``score_cell`` scores the cell.
    options: the name of its own config section (``vllm:``), None when it has none.
    environment: its own Python and scripts (``eval.engines.process.Environment``), None when it has none.
    builtin: set on subclassing: defined in a module of this package (its exceptions are ropescale's
        bugs), not a plugin's (its exceptions are its own failures, one line).

    Subclassing holds the engine to the contract (the module docstring): its ``score_cell`` answers
    through ``AnsweringTask``; a plugin's ``check``, ``score_cell`` and ``version`` raise one line.
    """

    name: ClassVar[str] = ""
    answers: ClassVar[frozenset[str]] = frozenset()
    in_process: ClassVar[bool] = False
    options: ClassVar[str | None] = None
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
        add_role(cls, "scorer")

    @property
    def label(self) -> str:
        """How messages name the engine: ``scoring engine 'NAME'``."""
        return f"scoring engine '{self.name}'"

    def scores(self, task_cls) -> bool:
        """Whether this engine scores ``task_cls``: in process, or answering every kind of request it asks."""
        return self.in_process or (bool(task_cls.engine_asks) and task_cls.engine_asks <= self.answers)

    def check(self, cfg, source: str = "config", processes: int = 1) -> None:
        """Everything this engine refuses for ``cfg`` before a model loads: ``ConfigError`` (one line).
        The default refuses a task it does not score."""
        from ..tasks.base import get_task

        task_cls = get_task(cfg.task)
        if self.scores(task_cls):
            return
        can = " or ".join(sorted(n for n in scoring_engine_names() if scoring_engine(n).scores(task_cls)))
        if not task_cls.engine_asks:
            raise ConfigError(f"{source}: engine: {self.name} cannot score {cfg.task}: it measures the model in this "
                              f"process only — use engine: {can}")
        missing = ", ".join(sorted(task_cls.engine_asks - self.answers))
        raise ConfigError(f"{source}: engine: {self.name} does not answer {missing}, which {cfg.task} asks for — use "
                          f"engine: {can}")

    def score_cell(self, cfg, task, model, examples, spec, params: dict, length: int, train_length: int, device,
                   output: Path) -> dict[str, Any]:
        """The cell's metrics (``task.combine``'s) plus ``engine`` and ``engine_version``; raises
        ``ConfigError`` for what it cannot serve at this cell (one line)."""
        raise NotImplementedError

    def version(self) -> str:
        """The version a record names (for an in-process engine; others report theirs per cell)."""
        return "unknown"


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

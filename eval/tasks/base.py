"""What every evaluation task is: one lifecycle, shared by all.

A task is a subclass of ``Task`` in its own module under ``eval/tasks/`` (found and registered
automatically by its ``name``). The harness (``eval.sweep``) loads the model once, builds the task
with its options, asks it for the examples of each length *once* (so every strategy sees the
same ones), then for every (strategy, length) cell patches the model, has it ``measure`` the
examples (each process its share, when launched with ``accelerate launch``), ``combine``s the
parts into the cell's metrics — a flat dict of JSON values — and unpatches. The harness adds the
cell's identity (strategy, length, model, data, …) and appends the record to ``results.jsonl``.
``plots`` draws the task's figures from the finished records.

Adding a task is one module (a ``Task`` subclass with ``name``, ``Options``, ``metrics``,
``examples``, ``measure``, ``combine`` and optionally ``plots``) plus its tests. ``combine``
must give the same numbers however the examples were split. An installed package adds tasks through
the entry-point group ``ropescale.tasks`` (its module defines ``Task`` subclasses; ``ropescale.registry``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from ropescale.errors import UnknownNameError
from ropescale.registry import Registry
from ropescale.runs.config import ConfigModel
from ropescale.runs.memory import Need
from ropescale.strategies import Strategy

__all__ = ["TASKS", "Metric", "Task", "TaskOptions", "UnknownTaskError", "get_task", "progress", "task_names"]


class TaskOptions(ConfigModel):
    """Base of a task's own configuration keys (written under ``<task name>:`` in a config); a boolean
    where a number is meant (``trials: true``) is refused (``ConfigModel``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def check_lengths(self, lengths: list[int]) -> None:
        """Raise ``ValueError`` when these options cannot work at some of ``lengths``."""

    def key(self) -> dict[str, Any]:
        """What of these options changes the task's numbers (the cell id hashes it): all of them
        unless a task says otherwise."""
        return self.model_dump()


class Metric(BaseModel):
    """A metric a task reports: ``key`` in the record, how to print it, which way is better."""

    key: str
    label: str
    higher_is_better: bool
    fmt: str = "{:.2f}"


class UnknownTaskError(UnknownNameError, KeyError):
    """No task of that name (the message lists the known ones)."""


TASKS: Registry[type[Task]] = Registry("task", "tasks", UnknownTaskError, package=__package__,
                                        skip=("base", "prompts"), plugins="ropescale.tasks")


class Task:
    """One kind of evaluation. Subclasses set the class attributes and implement ``examples``,
    ``measure`` and ``combine``.

    name: the task's name in configs and records.
    Options: the pydantic model of its options (``TaskOptions`` subclass).
    metrics: what ``combine`` reports; the first is the headline of tables and plots.
    uses_data: whether the task reads the config's ``data`` source (its documents are passed in).
    engine_asks: the kinds of request a scoring engine outside this process answers for it
        (``"logprobs"``, ``"generate"``: ``eval.engines.scoring``); empty: scored in process only. A
        task that asks implements ``engine_requests``, ``engine_parts`` and ``engine_length``.
    objective_term: the task can be a term of a search's objective (``tasks:`` in a search config): it
        implements ``gold_answers`` — each example's prompt and its correct answer's tokens, whose mean NLL
        per answer token the search minimises.
    """

    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    metrics: ClassVar[tuple[Metric, ...]]
    uses_data: ClassVar[bool] = False
    engine_asks: ClassVar[frozenset[str]] = frozenset()  # what an engine outside this process answers for it
    objective_term: ClassVar[bool] = False  # implements gold_answers: a search can minimise its answers' NLL

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        TASKS.add_class(cls)

    def __init__(self, options: TaskOptions, *, tokenizer, train_length: int,
                 documents: list[torch.Tensor] | None = None, source: str | None = None):
        self.options, self.tokenizer, self.train_length, self.documents = options, tokenizer, train_length, documents
        self.source = source  # the data source's name (``DataSpec.describe()``), for messages

    @classmethod
    def summary(cls) -> str:
        """The first paragraph of the task's docstring, as one line (``ropescale list``)."""
        return " ".join((cls.__doc__ or cls.name).split("\n\n")[0].split())

    def examples(self, length: int) -> Any:
        """The examples at ``length`` tokens; built once and scored under every strategy.
        Raises ``ValueError`` (or a subclass) when ``length`` cannot hold them."""
        raise NotImplementedError

    def memory(self, length: int, model) -> Need | None:
        """What a cell at ``length`` tokens will ask for (``ropescale.runs.memory.Need``), estimated
        before anything is allocated: the harness refuses a length that cannot fit, in one line,
        before building examples. None: no estimate (nothing is refused)."""
        return None

    def measure(self, model, examples: Any, indices: list[int], *, length: int, strategy: Strategy,
                device: torch.device, desc: str | None) -> Any:
        """Run the (already patched) ``model`` on ``examples[i]`` for ``i`` in ``indices``: a
        picklable part for ``combine``. ``desc`` labels a progress bar (None: no bar)."""
        raise NotImplementedError

    def combine(self, parts: list, examples: Any, *, length: int, strategy: Strategy) -> dict[str, Any]:
        """The cell's metrics from every process's part: a flat dict holding at least every
        ``metrics`` key, identical for any split of the examples."""
        raise NotImplementedError

    @classmethod
    def objective_options(cls, examples: int) -> dict[str, Any]:
        """The options (its own keys) that make the task build ``examples`` examples, spread as it spreads them,
        for a search term: what a term's ``trials`` sets where the config leaves those keys out."""
        return {}

    def gold_answers(self, examples: Any) -> list[tuple[list[int], list[int]]]:
        """Each example's prompt ids ``[n]`` and the ids ``[m]`` a correct answer continues it with (for a task
        with ``objective_term``: a search scores their mean NLL per answer token, ``eval.search.objective``)."""
        raise NotImplementedError

    # --- scored by an engine outside this process (eval.engines.scoring), for a task with ``engine_asks``

    def engine_requests(self, examples: Any) -> tuple[list[dict[str, Any]], int]:
        """``(requests, checked)``: what a scoring engine answers for a cell — each request
        ``{"ids": [token ids], "max_tokens": n, "prompt_logprobs": bool}`` (greedy generation of up to n
        tokens; the prompt's log-probabilities when asked) — and the index of the request whose
        log-probabilities are also computed in process, the engine's exactness check."""
        raise NotImplementedError

    def engine_parts(self, examples: Any, results: list[dict[str, Any]], length: int) -> Any:
        """This cell's part for ``combine`` from the engine's ``results``, one per request:
        ``logprobs`` (log p of each prompt token after the first [nats], when asked) and ``tokens``
        (the generated ids)."""
        raise NotImplementedError

    @classmethod
    def engine_length(cls, options: TaskOptions, length: int) -> int:
        """Tokens an engine must hold for a cell at ``length`` [tokens]: its longest request and what it
        generates."""
        raise NotImplementedError

    @classmethod
    def engine_refusal(cls, options: TaskOptions) -> str | None:
        """Why these options cannot be scored outside this process (one clause), or None."""
        return None

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        """Figures from this task's records; returns ``{kind: path}``."""
        return {}

    @classmethod
    def report(cls, records: list[dict]) -> str:
        """Markdown the task adds to ``results.md`` after its metric tables (default: none)."""
        return ""


def task_names() -> list[str]:
    """The registered tasks' names (bundled and plugins), sorted."""
    return TASKS.names()


def get_task(name: str) -> type[Task]:
    """The task class ``name``; ``UnknownTaskError`` lists the known ones."""
    return TASKS.lookup(name)


def progress(total: int, desc: str | None, unit: str = "it"):
    """A tqdm bar labelled ``desc``; none when ``desc`` is None, and quiet when stderr is not a
    terminal (logs of long runs stay readable)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=True if desc is None else None, leave=False, unit=unit)

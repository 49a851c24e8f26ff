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
must give the same numbers however the examples were split.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, Union, get_args, get_origin

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from ropescale.errors import RopescaleError
from ropescale.registry import Registry
from ropescale.runs.memory import Need
from ropescale.strategies import Strategy

__all__ = ["TASKS", "Metric", "Task", "TaskOptions", "UnknownTaskError", "get_task", "progress", "task_names"]


class TaskOptions(BaseModel):
    """Base of a task's own configuration keys (written under ``<task name>:`` in a config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """``trials: true`` would be read as 1: a boolean is refused where a number is meant."""
        kinds = _numeric_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds:
            return v
        if isinstance(v, bool):
            raise ValueError(f"expected an integer, got {str(v).lower()}" if kinds == "scalar-int" else
                             f"expected a number, got {str(v).lower()}")
        if kinds == "list" and isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v):
            bad = next(x for x in v if isinstance(x, bool))
            raise ValueError(f"expected numbers, got {str(bad).lower()}")
        return v

    def check_lengths(self, lengths: list[int]) -> None:
        """Raise ``ValueError`` when these options cannot work at some of ``lengths``."""

    def key(self) -> dict[str, Any]:
        """What of these options changes the task's numbers (the cell id hashes it): all of them
        unless a task says otherwise."""
        return self.model_dump()


def _numeric_kinds(annotation: Any) -> str | None:
    """``"scalar-int"`` / ``"scalar-float"`` for an int / float field (optional or not), ``"list"``
    for a list of numbers, None otherwise (a field that takes booleans is left alone)."""
    union = get_origin(annotation) in (Union, UnionType)
    args = set(get_args(annotation)) if union else {annotation}
    if bool in args:
        return None
    if int in args:
        return "scalar-int"
    if float in args:
        return "scalar-float"
    for a in args:
        if get_origin(a) in (list, tuple) and set(get_args(a)) & {int, float} and bool not in get_args(a):
            return "list"
    return None


class Metric(BaseModel):
    """A metric a task reports: ``key`` in the record, how to print it, which way is better."""

    key: str
    label: str
    higher_is_better: bool
    fmt: str = "{:.2f}"


class UnknownTaskError(RopescaleError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


TASKS: Registry[type[Task]] = Registry("task", "tasks", UnknownTaskError, package=__package__,
                                        skip=("base", "prompts"))


class Task:
    """One kind of evaluation. Subclasses set the class attributes and implement ``examples``,
    ``measure`` and ``combine``.

    name: the task's name in configs and records.
    Options: the pydantic model of its options (``TaskOptions`` subclass).
    metrics: what ``combine`` reports; the first is the headline of tables and plots.
    uses_data: whether the task reads the config's ``data`` source (its documents are passed in).
    """

    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    metrics: ClassVar[tuple[Metric, ...]]
    uses_data: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        name = cls.__dict__.get("name")
        if name:
            TASKS.add(name, cls)

    def __init__(self, options: TaskOptions, *, tokenizer, train_length: int,
                 documents: list[torch.Tensor] | None = None, source: str | None = None):
        self.options, self.tokenizer, self.train_length, self.documents = options, tokenizer, train_length, documents
        self.source = source  # the data source's name (``DataSpec.describe()``), for messages

    @classmethod
    def summary(cls) -> str:
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
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        """Figures from this task's records; returns ``{kind: path}``."""
        return {}

    @classmethod
    def report(cls, records: list[dict]) -> str:
        """Markdown the task adds to ``results.md`` after its metric tables (default: none)."""
        return ""


def task_names() -> list[str]:
    return TASKS.names()


def get_task(name: str) -> type[Task]:
    """The task class ``name``; ``UnknownTaskError`` lists the known ones."""
    return TASKS.lookup(name)


def progress(total: int, desc: str | None, unit: str = "it"):
    """A tqdm bar labelled ``desc``; none when ``desc`` is None, and quiet when stderr is not a
    terminal (logs of long runs stay readable)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=True if desc is None else None, leave=False, unit=unit)

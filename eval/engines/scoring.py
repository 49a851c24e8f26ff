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

One engine per module, registered by subclassing ``ScoringEngine`` with a ``name``: ``transformers``
(here: the patched model in this process, the default — every task), ``vllm``
(``eval.engines.vllm_eval``: the patch's export served by vLLM); an installed package adds one
through the ``ropescale.engines`` entry points.

Errors: ``UnknownEngineError`` (one line, the known names) for an unknown engine; each engine's
``check`` raises ``ConfigError`` (one line) for what it cannot score, before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ropescale.registry import Registry
from ropescale.runs.config import ConfigError
from ropescale.serving.engines import UnknownEngineError

__all__ = ["DEFAULT", "SCORERS", "ScoringEngine", "scoring_engine", "scoring_engine_names"]

DEFAULT = "transformers"  # the engine a config without ``engine:`` is scored by (run identities leave it out)

# the driver scripts beside the engines' modules run in the engines' own environments: never imported
SCORERS: Registry[type] = Registry("scoring engine", "scoring engines", UnknownEngineError, package=__package__,
                                   skip=("base", "vllm_driver", "llama_cpp_driver", "mlx_driver", "convert_gguf"),
                                   plugins="ropescale.engines")


class ScoringEngine:
    """One scoring engine: subclass with ``name`` set (registering it).

    name: its name in configs (``engine: NAME``) and records.
    answers: the kinds of request it answers (``"logprobs"``, ``"generate"``).
    in_process: it is this process's patched model (the harness measures the cell itself: every task,
        ``accelerate launch`` splitting the examples); otherwise ``score_cell`` scores the cell.
    options: the name of its own config section (``vllm:``), None when it has none.
    """

    name: ClassVar[str] = ""
    answers: ClassVar[frozenset[str]] = frozenset()
    in_process: ClassVar[bool] = False
    options: ClassVar[str | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        SCORERS.add_class(cls)

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


class TransformersScoring(ScoringEngine):
    """The patched model in this process (``eval.sweep``'s own measuring)."""

    name = "transformers"
    answers = frozenset({"logprobs", "generate"})
    in_process = True

    def version(self) -> str:
        import transformers

        return transformers.__version__




def scoring_engine_names() -> list[str]:
    """The registered scoring engines' names (bundled and plugins), sorted."""
    return SCORERS.names()


def scoring_engine(name: str) -> ScoringEngine:
    """The scoring engine ``name`` (an instance); ``UnknownEngineError`` (one line) otherwise."""
    return SCORERS.lookup(name)()

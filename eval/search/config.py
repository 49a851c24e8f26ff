"""Search configuration: YAML / ``--set`` → validated ``SearchConfig``.

::

    model: reference
    data: kjv-train              # the search split; never the held-out data a report uses
    strategy: yarn
    search: {beta_fast: [4, 128], beta_slow: [0.25, 4], attention_factor: [0.8, 1.6]}
    fixed: {factor: 8}
    lengths: [1024]              # target lengths L [tokens]
    length_weights: [1]          # optional, one per length
    method: tpe                  # tpe | cmaes | evolution
    budget: 20                   # finished trials, counted over resumes
    seed: 0
    max_windows: 4               # windows per length per candidate, evenly spaced over the split
    retrieval_weight: 0          # > 0: adds the passkey answer's log-likelihood term
    needle_weight: 0             # > 0: adds LongRoPE2's needle-driven term (needles in the search text)
    tasks: [{task: graphwalks, weight: 0.5, trials: 4}]   # any task declaring objective_term: its gold answers' NLL
    epsilon: 0.05                # constraint: PPL at T ≤ (1 + ε) × vanilla's
    max_kl: 0.02                 # optional constraint: KL(P_unpatched ‖ P) at T ≤ this [nats/token]
    heldout: kjv-heldout         # the reported eval data, refused as the search split
    engine: transformers         # or any scoring engine answering log-probabilities (vllm, mlx, a plugin's)
    vllm: {tensor_parallel_size: 1}   # engine: vllm's section, as eval's (only with engine: vllm)
    report_to: [tensorboard]     # accelerate's trackers, as fine-tuning's: each finished trial's numbers
    output: runs/search-yarn

``engine: NAME`` scores every candidate with that scoring engine, as eval's cells are (its section, e.g.
``vllm:``, as eval's; ``eval.search.objective`` hands the engine the candidate's requests); ``report_to``
(fine-tuning's tracker names, ``ropescale.runs.trackers``) reports each finished trial
(``eval.search.trackers``).

Every error is one ``ConfigError`` line naming the key, raised before anything is read or written:
numbers are strict (``budget: true`` or ``"4"`` is refused, not read as 1 or 4), weights finite,
≥ 0, not all zero, with a finite sum; ``evolution:`` checked as ``run_evolution`` checks it; the
search split never the held-out data, whatever its spelling (``same_data``).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from ropescale.runs.config import (
    ConfigError,
    ConfigModel,
    DataConfig,
    NestedErrors,
    RunConfig,
    error_parts,
    explain,
    load_raw,
)
from ropescale.runs.data import BOOKS, KJV_SPLITS, DataSpec
from ropescale.runs.trackers import tracker_names
from ropescale.strategies import get_strategy

from ..config import MAX_LENGTH
from ..engines.scoring import DEFAULT, engine_sections, scoring_engine, scoring_engine_names, section_keys
from .space import Dimension, search_space

__all__ = ["EVOLUTION_KEYS", "METHODS", "TERM_SEED", "SearchConfig", "TaskTerm", "build_search_config",
           "load_search_config", "same_data"]

METHODS = ("tpe", "cmaes", "evolution")
EVOLUTION_KEYS = ("population", "iterations", "elite", "mutation_prob", "crossover_prob", "variant")

Int = Annotated[int, Strict()]  # true, 4.0 and "4" refused: a bool is no count
Real = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # an int or a float, finite; no bool, no string


def _source(spec: DataSpec) -> tuple:
    """What names ``spec``'s documents, whatever the spelling: a bundled split's name, a local
    path resolved (symlinks, ``..``, ``~``), else a hub dataset's id, config and split (without
    a slice such as ``test[:100]``), case-folded."""
    if spec.source in KJV_SPLITS or spec.source in BOOKS:
        return ("bundled", spec.source)
    path = Path(os.path.expanduser(spec.source))
    if path.exists():
        return ("path", path.resolve())
    split = spec.split.split("[")[0].strip().casefold()
    return ("hub", spec.source.strip().strip("/").casefold(), (spec.config or "").casefold(), split)


def same_data(search: DataSpec, heldout: DataSpec) -> bool:
    """Whether the search split can hold held-out documents: the same source however spelled
    (``_source``; ``max_documents`` ignored, a prefix of the data is the data), the same file
    through a hard link, or one local path inside the other (a folder holding the file)."""
    a, b = _source(search), _source(heldout)
    if a == b:
        return True
    if a[0] == b[0] == "path":
        pa, pb = a[1], b[1]
        return os.path.samefile(pa, pb) or pa.is_relative_to(pb) or pb.is_relative_to(pa)
    return False


TERM_SEED = 7919  # a task term's examples: not the eval's default seeds, so the reported prompts are not searched


class TaskTerm(ConfigModel):
    """One task as a term of the objective: ``weight`` × the mean NLL per answer token of the gold answers
    (``Task.gold_answers``) of its first ``trials`` examples at the longest length, built with ``options``
    (the task's own; ``seed`` defaults to ``TERM_SEED`` and ``num_samples`` to ``trials`` where the task has
    them). Any task declaring ``objective_term`` — passkey, needle, graphwalks, json_kv, a plugin's."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    task: str
    weight: Real = Field(gt=0, description="the term's weight in J")
    trials: Int = Field(4, ge=1, description="examples scored per candidate (at the longest length)")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's options (its own keys)")

    @model_validator(mode="after")
    def _known(self) -> TaskTerm:
        from ..tasks.base import get_task, task_names

        try:
            cls = get_task(self.task)
        except KeyError as e:
            raise ValueError(str(e)) from None
        if not cls.objective_term:
            can = ", ".join(n for n in task_names() if get_task(n).objective_term)
            raise ValueError(f"task {self.task} has no gold answers to score (objective_term); terms: {can}")
        try:
            self.task_options()
        except ValidationError as e:
            raise NestedErrors(error_parts(e, cls.Options)).under("options") from None
        return self

    def task_options(self):
        """The task's validated options: ``seed`` = ``TERM_SEED`` where it has one, and what makes it build
        ``trials`` examples (``Task.objective_options``: a retrieval task's depths spread over [0, 1], a generated
        task's ``num_samples``), each where ``options`` leaves it out."""
        from ..tasks.base import get_task

        cls = get_task(self.task)
        fill = {**({"seed": TERM_SEED} if "seed" in cls.Options.model_fields else {}),
                **cls.objective_options(self.trials)}
        return cls.Options.model_validate({**fill, **self.options})


class SearchConfig(RunConfig):
    """One parameter search: a strategy family's numeric parameters on one model, scored on a
    search split at the target lengths (see ``eval.search.objective``). Numbers are strict (no
    ``"4"``, no ``4.0`` for a count)."""

    data: DataConfig = Field(default_factory=lambda: DataConfig(source="kjv-train"),
                             description="the search split (default: the bundled model's training books)")
    heldout: DataConfig | None = Field(default_factory=lambda: DataConfig(source="kjv-heldout"),
                                       description="the data results are reported on; refused as the search split")
    strategy: str
    search: list[str] | dict[str, Any] | None = None
    fixed: dict[str, Any] = Field(default_factory=dict)
    lengths: list[Int] = Field(min_length=1, description="target lengths L [tokens]")
    length_weights: list[Real] | None = Field(None, description="weight of each length's NLL; default equal")
    method: str = "tpe"
    budget: Int = Field(20, description="finished trials (candidates evaluated), counted over resumes")
    seed: Int = 0
    max_windows: Int = Field(4, ge=1, description="windows per length per candidate, evenly spaced over the split")
    retrieval_weight: Real = Field(0.0, ge=0, description="weight of the passkey answer's mean NLL per token")
    retrieval_trials: Int = Field(4, ge=1, description="passkey prompts per candidate (at the longest length)")
    needle_weight: Real = Field(0.0, ge=0, description="weight of LongRoPE2's needle-driven term: the mean NLL per "
                                                       "answer token of needles planted in the search text")
    needle_trials: Int = Field(4, ge=1, description="needle prompts per candidate (at the longest length)")
    tasks: list[TaskTerm] = Field(default_factory=list, description="tasks as terms of J: weight × the mean NLL per "
                                  "answer token of their gold answers (any task declaring objective_term)")
    epsilon: Real = Field(0.05, ge=0, description="constraint: PPL at T ≤ (1 + ε) × vanilla's")
    max_kl: Real | None = Field(None, gt=0, description=(
        "constraint: mean KL(P_unpatched ‖ P_candidate) per token at T ≤ this [nats] (the short-context cost); "
        "none: no KL constraint"))
    evolution: dict[str, Any] = Field(default_factory=dict, description=(
        "method evolution: LongRoPE's hyper-parameters (population, iterations, elite, mutation_prob, "
        "crossover_prob, variant); left out: the authors' defaults"))
    original_max_position_embeddings: Int | None = Field(None, ge=2, description="override the model's training "
                                                                                 "window T [tokens]")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto: bfloat16 on a GPU that supports it, float32 on the CPU "
                            "(recorded resolved)")
    threads: Int | None = Field(None, ge=1, description="torch threads (at most this machine's CPU count)")
    engine: str = Field(DEFAULT, description="what scores every candidate: transformers (in this process) or any "
                        "registered scoring engine answering log-probabilities (vllm, mlx, a plugin's: "
                        "eval.engines.scoring), serving what `patch --engine NAME` writes")
    engine_options: SerializeAsAny[BaseModel] | None = Field(None, description="the scoring engine's options, "
                                                             "given under the engine's name (vllm: ...)")
    report_to: list[str] = Field(default_factory=list,
                                 description="accelerate trackers to report each finished trial to (tensorboard, "
                                             "wandb, mlflow, ...; trials.csv is always written)")

    _report_to = field_validator("report_to", mode="before")(tracker_names)

    @model_validator(mode="before")
    @classmethod
    def _engine_section(cls, raw: Any) -> Any:
        return engine_sections(raw, lenient=True)  # lenient: a dumped config's defaults read back

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(x < 2 or x > MAX_LENGTH for x in v):
            raise ValueError(f"every length must lie in [2, {MAX_LENGTH}] tokens")
        if len(set(v)) != len(v):
            raise ValueError("a length is given twice")
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        known = scoring_engine_names()
        if v not in known:
            hint = difflib.get_close_matches(v, known, n=1)
            raise ValueError(f"unknown scoring engine {v!r}; choose from {', '.join(known)}"
                             + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return v

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in METHODS:
            hint = difflib.get_close_matches(v, METHODS, n=1)
            raise ValueError(f"unknown method {v!r}; known: {', '.join(METHODS)}"
                             + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return v

    @field_validator("budget")
    @classmethod
    def _budget(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"budget={v}: a search needs at least 1 trial")
        return v

    @field_validator("tasks")
    @classmethod
    def _one_term_per_task(cls, v: list[TaskTerm]) -> list[TaskTerm]:
        names = [t.task for t in v]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice:
            raise ValueError(f"task {twice} is given twice: one term per task (its options say which examples)")
        return v

    @model_validator(mode="after")
    def _check(self) -> SearchConfig:
        try:
            get_strategy(self.strategy)
        except KeyError as e:
            raise ValueError(f"strategy: {e}") from None
        if self.max_kl is not None and not scoring_engine(self.engine).in_process:
            raise ValueError(f"max_kl: the KL to the unpatched model needs the whole next-token distribution, and "
                             f"engine {self.engine} returns the target's log-probability only — use engine: {DEFAULT}")
        if self.length_weights is not None:
            w = self.length_weights
            if len(w) != len(self.lengths):
                raise ValueError(f"length_weights: {len(w)} weights for {len(self.lengths)} lengths")
            if any(x < 0 for x in w) or not sum(w) > 0:
                raise ValueError(f"length_weights: {w} — weights must be ≥ 0, not all zero")
            if not math.isfinite(sum(w)):  # [1e308, 1e308]: each normalised weight would be 0
                raise ValueError(f"length_weights: {w} sum to more than a float holds; give them on a smaller "
                                 "scale (only their ratios matter)")
        if self.heldout is not None and same_data(self.data.spec(), self.heldout.spec()):
            raise ValueError(f"data: the search split {self.data.spec().describe()!r} is (or holds) the held-out data "
                             f"{self.heldout.spec().describe()!r} results are reported on; search on another split "
                             "(kjv-train on the bundled model)")
        if self.method == "evolution":
            self._check_evolution()
        else:
            if self.evolution:
                raise ValueError(f"evolution: options of method evolution, but method is {self.method}")
            self.space()  # unsearchable parameters fail here, not after the model is loaded
        return self

    def _check_evolution(self) -> None:
        if not any(p.name == "long_factor" and p.kind is list for p in get_strategy(self.strategy).params):
            raise ValueError(f"method: evolution searches a strategy's per-pair long_factor (longrope's per-pair "
                             f"factors); {self.strategy} has none (use tpe or cmaes for it, or strategy: longrope)")
        if self.search:
            raise ValueError("search: method evolution searches long_factor itself; leave search: out")
        extra = set(self.evolution) - set(EVOLUTION_KEYS)
        if extra:
            raise ValueError(f"evolution: unknown key {sorted(extra)[0]!r}; allowed: {', '.join(EVOLUTION_KEYS)}")
        extra = set(self.fixed) - {"short_factor", "attention_factor", "factor"}
        if extra:
            raise ValueError(f"fixed: {sorted(extra)[0]} is searched by method evolution; fix only short_factor, "
                             "attention_factor or factor")
        try:  # the checks run_evolution makes, before the manifest claims the folder
            from .evolution import check_options
        except ImportError:
            return  # reported by run_search: this version has no evolution
        try:
            check_options(seed=self.seed, budget=self.budget, **self.evolution)
        except ValueError as e:
            raise ValueError(f"evolution: {str(e).removeprefix('run_evolution: ')}") from None

    def space(self) -> list[Dimension]:
        """The searched dimensions (``eval.search.space.search_space``)."""
        return search_space(self.strategy, self.search, self.fixed)

    def identity(self) -> dict[str, Any]:
        """The search's own part of its identity (``ropescale.runs.protocol``; the weights' and the
        search split's fingerprints and the versions are added there): what makes two searches the
        same. The budget is not part of it (raising it extends a search), nor where it runs or
        reports (``device``, ``threads``, ``report_to``, ``output``)."""
        keep = ("strategy", "search", "fixed", "lengths", "length_weights", "method", "seed", "max_windows",
                "retrieval_weight", "retrieval_trials", "epsilon", "original_max_position_embeddings", "dtype",
                "evolution")
        return {"task": "search", "model": self.model, "data": self.data.spec().describe(),
                **self.model_dump(mode="json", include=set(keep)),
                # LongRoPE2's needle term: in the identity only when used, so earlier studies still resume
                **(self.model_dump(include={"needle_weight", "needle_trials"}) if self.needle_weight else {}),
                **({"max_kl": self.max_kl} if self.max_kl is not None else {}),
                **({"tasks": [t.model_dump(mode="json") for t in self.tasks]} if self.tasks else {}),
                # another engine's numbers are another experiment's (within its parity tolerance); report_to is not
                **({"engine": self.engine} if self.engine != DEFAULT else {})}

    def weights(self) -> list[float]:
        """Each length's weight, normalised to sum 1."""
        w = self.length_weights or [1.0] * len(self.lengths)
        return [x / sum(w) for x in w]


def build_search_config(raw: Any, source: str = "config") -> SearchConfig:
    """``raw`` (a mapping) → ``SearchConfig``; ``ConfigError`` naming the key otherwise."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model, data, strategy, search, lengths, ...)")
    try:
        return SearchConfig.model_validate(raw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except ValidationError as e:
        keys = [k for k in SearchConfig.model_fields if k != "engine_options"] + section_keys()
        raise explain(e, source, SearchConfig, allowed=lambda loc: keys if len(loc) == 1 else None) from None


def load_search_config(path: str, overrides: list[str] = ()) -> SearchConfig:
    """Read and validate a YAML search config (``--set key=value`` applied first)."""
    raw, source = load_raw(path, overrides)
    return build_search_config(raw, source)

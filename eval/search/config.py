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
    max_windows: 4               # windows per length per candidate
    retrieval_weight: 0          # > 0: adds the passkey answer's log-likelihood term
    epsilon: 0.05                # constraint: PPL at T ≤ (1 + ε) × vanilla's
    heldout: kjv-heldout         # the reported eval data, refused as the search split
    output: runs/search-yarn

Every error is one ``ConfigError`` line naming the key.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ropescale.runs.config import ConfigError, DataConfig, apply_overrides, check_threads, read_yaml
from ropescale.strategies import get_strategy

from ..config import MAX_LENGTH
from .space import Dimension, search_space

__all__ = ["EVOLUTION_KEYS", "METHODS", "SearchConfig", "build_search_config", "load_search_config"]

METHODS = ("tpe", "cmaes", "evolution")
EVOLUTION_KEYS = ("population", "iterations", "elite", "mutation_prob", "crossover_prob", "variant")


class SearchConfig(BaseModel):
    """One parameter search: a strategy family's numeric parameters on one model, scored on a
    search split at the target lengths (see ``eval.search.objective``)."""

    model_config = ConfigDict(extra="forbid")
    model: str = "reference"
    data: DataConfig = Field(default_factory=lambda: DataConfig(source="kjv-train"),
                             description="the search split (default: the bundled model's training books)")
    heldout: DataConfig | None = Field(default_factory=lambda: DataConfig(source="kjv-heldout"),
                                       description="the data results are reported on; refused as the search split")
    strategy: str
    search: list[str] | dict[str, Any] | None = None
    fixed: dict[str, Any] = Field(default_factory=dict)
    lengths: list[int] = Field(min_length=1, description="target lengths L [tokens]")
    length_weights: list[float] | None = Field(None, description="weight of each length's NLL; default equal")
    method: str = "tpe"
    budget: int = Field(20, description="finished trials (candidates evaluated), counted over resumes")
    seed: int = 0
    max_windows: int = Field(4, ge=1, description="windows per length per candidate")
    retrieval_weight: float = Field(0.0, ge=0, description="weight of the passkey answer's mean NLL per token")
    retrieval_trials: int = Field(4, ge=1, description="passkey prompts per candidate (at the longest length)")
    epsilon: float = Field(0.05, ge=0, description="constraint: PPL at T ≤ (1 + ε) × vanilla's")
    evolution: dict[str, Any] = Field(default_factory=dict, description=(
        "method evolution: LongRoPE's hyper-parameters (population, iterations, elite, mutation_prob, "
        "crossover_prob, variant); left out: the authors' defaults"))
    original_max_position_embeddings: int | None = Field(None, ge=2)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto: bfloat16 on a GPU that supports it, float32 on the CPU "
                            "(recorded resolved)")
    device: str = "auto"
    threads: int | None = Field(None, ge=1)
    output: str | None = None

    @field_validator("data", "heldout", mode="before")
    @classmethod
    def _data(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"source": v}
        return v

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(x < 2 or x > MAX_LENGTH for x in v):
            raise ValueError(f"every length must lie in [2, {MAX_LENGTH}] tokens")
        if len(set(v)) != len(v):
            raise ValueError("a length is given twice")
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

    @field_validator("threads")
    @classmethod
    def _threads(cls, v: int | None) -> int | None:
        return check_threads(v)

    @model_validator(mode="after")
    def _check(self) -> SearchConfig:
        try:
            get_strategy(self.strategy)
        except KeyError as e:
            raise ValueError(f"strategy: {e}") from None
        if self.length_weights is not None:
            if len(self.length_weights) != len(self.lengths):
                raise ValueError(f"length_weights: {len(self.length_weights)} weights for {len(self.lengths)} lengths")
            if any(w < 0 for w in self.length_weights) or not sum(self.length_weights) > 0:
                raise ValueError("length_weights: weights must be ≥ 0 with a positive sum")
        if self.heldout is not None and self.heldout.spec().describe() == self.data.spec().describe():
            raise ValueError(f"data: the search split {self.data.spec().describe()!r} is the held-out data results "
                             "are reported on; search on another split (kjv-train on the bundled model)")
        if self.method == "evolution":
            self._check_evolution()
        else:
            if self.evolution:
                raise ValueError(f"evolution: options of method evolution, but method is {self.method}")
            self.space()  # unsearchable parameters fail here, not after the model is loaded
        return self

    def _check_evolution(self) -> None:
        if self.strategy != "longrope":
            raise ValueError(f"method: evolution searches longrope's per-pair factors; strategy is {self.strategy} "
                             "(use tpe or cmaes for it, or strategy: longrope)")
        if self.search:
            raise ValueError("search: method evolution searches long_factor itself; leave search: out")
        extra = set(self.evolution) - set(EVOLUTION_KEYS)
        if extra:
            raise ValueError(f"evolution: unknown key {sorted(extra)[0]!r}; allowed: {', '.join(EVOLUTION_KEYS)}")
        extra = set(self.fixed) - {"short_factor", "attention_factor", "factor"}
        if extra:
            raise ValueError(f"fixed: {sorted(extra)[0]} is searched by method evolution; fix only short_factor, "
                             "attention_factor or factor")

    def space(self) -> list[Dimension]:
        """The searched dimensions (``eval.search.space.search_space``)."""
        return search_space(self.strategy, self.search, self.fixed)

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
        lines = []
        for err in e.errors():
            key = ".".join(map(str, err["loc"]))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                hint = difflib.get_close_matches(str(err["loc"][-1]), list(SearchConfig.model_fields), n=1)
                msg = "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
        raise ConfigError("; ".join(lines)) from None


def load_search_config(path: str, overrides: list[str] = ()) -> SearchConfig:
    """Read and validate a YAML search config (``--set key=value`` applied first)."""
    return build_search_config(apply_overrides(read_yaml(path), list(overrides)), str(path))

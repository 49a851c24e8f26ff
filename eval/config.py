"""Experiment configuration: YAML / flags → validated ``EvalConfig``.

An experiment runs one task (``perplexity`` by default; ``passkey``, ``needle``, … — see
``eval.tasks``) over strategies × lengths. The task's own options sit under its name (or under
``options:``, as ``EvalConfig.model_dump()`` — the manifest's config — writes them, so a dumped
config reads back as the same ``EvalConfig``).

A strategy entry is a name (``yarn``), a name with parameters (``yarn:factor=4,beta_fast=16``)
or a mapping (``{name: yarn, factor: 4, label: yarn-s4}``). Parameters the strategy fills
automatically (``factor`` of linear/ntk/yarn) are set per length to max(1, L / T) when
left out. Every error names the key: ``ConfigError: quickstart.yaml: strategies.2: ...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from ropescale.runs.config import (
    ConfigError,
    DataConfig,
    NestedErrors,
    RunConfig,
    StrategySpec,
    apply_overrides,
    error_parts,
    explain,
    load_raw,
    parse_strategy,
    read_yaml,
)

from .engines.scoring import DEFAULT, engine_sections, scoring_engine_names, section_keys
from .tasks.base import TaskOptions, get_task, task_names
from .tasks.perplexity import LEGACY_KEYS

__all__ = [
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "StrategySpec",
    "SweepConfig",
    "apply_overrides",
    "build_config",
    "load_config",
    "parse_strategy",
    "read_yaml",
    "resolved_dtype",
]


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolved_dtype(dtype: str, device) -> str:
    """The weights' dtype a run uses: ``auto`` → ``bfloat16`` on a CUDA device that supports it
    (Ampere and later), ``float32`` elsewhere (CPU, MPS, older GPUs); any other name as given.
    Runs record the resolved name (identity, manifest, records), so a default ``auto`` run on the
    CPU is the same experiment as an explicit ``float32`` one."""
    import torch

    if dtype != "auto":
        return dtype
    device = torch.device(device)
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


MAX_LENGTH = 1 << 24  # float32 holds every integer position up to here; memory is checked before a run


class EvalConfig(RunConfig):
    """One experiment: a task over strategies × lengths on one model (and, for tasks that read
    text, one data source). The task's own keys sit under its name (``passkey: {trials: 20}``);
    perplexity's may also sit at the top level, as they did before tasks existed."""

    task: str = "perplexity"
    lengths: list[int] = Field(min_length=1)
    strategies: list[StrategySpec] = Field(min_length=1)
    # SerializeAsAny: dumped as the task's own options class (the manifest's config), not as the
    # declared base, which has no fields and would dump as {}
    options: SerializeAsAny[TaskOptions] = Field(default_factory=TaskOptions, description="the task's options")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto: bfloat16 on a GPU that supports it, float32 on the CPU "
                            "(recorded resolved)")
    device_map: str | None = Field(None, description="auto / balanced / sequential: spread a model larger than "
                                                      "one GPU over this node's devices (accelerate)")
    engine: str = Field(DEFAULT, description="what scores the cells: transformers (in this process), vllm "
                        "(serving what `patch --engine vllm` writes), mlx (perplexity through mlx-lm) or a plugin's "
                        "scoring engine (eval.engines.scoring)")
    # the engine's own section (``vllm: {tensor_parallel_size: 2}``), validated by the engine's Options
    # (eval.engines.scoring.engine_sections): SerializeAsAny dumps it as that class
    engine_options: SerializeAsAny[BaseModel] | None = Field(None, description="the scoring engine's options, "
                                                             "given under the engine's name (vllm: ...)")

    @model_validator(mode="before")
    @classmethod
    def _task_options(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = engine_sections(raw)
        name = raw.get("task", "perplexity")
        if not isinstance(name, str):  # a list or mapping would not even be hashable
            raise ValueError(f"task: expected one task name, got {name!r}; known tasks: {', '.join(task_names())}")
        try:
            task = get_task(name)
        except KeyError as e:
            raise ValueError(str(e)) from None
        section = raw.pop(name, None)
        if "options" in raw:  # a dumped config (the manifest's) holds them under ``options``
            if section is not None:
                raise ValueError(f"{name}: the task's options are given twice (under {name}: and options:); "
                                 "keep one")
            section = raw.pop("options")
            section = section.model_dump() if isinstance(section, TaskOptions) else section
        section = section or {}
        if not isinstance(section, dict):
            raise ValueError(f"{name}: expected a mapping of the task's options")
        if name == "perplexity":  # the pre-task layout: perplexity's keys at the top level
            section = {**{k: raw.pop(k) for k in LEGACY_KEYS if k in raw}, **section}
        try:
            raw["options"] = task.Options.model_validate(section)
        except ValidationError as e:  # the options' keys read as paths under the task's name
            raise NestedErrors(error_parts(e, task.Options)).under(name) from None
        return raw

    @field_validator("strategies", mode="before")
    @classmethod
    def _strategies(cls, v: Any) -> Any:
        if not isinstance(v, list):
            raise ValueError("must be a list of strategy names or mappings")
        out = []
        for i, entry in enumerate(v):
            try:
                out.append(parse_strategy(entry))
            except (KeyError, ValueError) as e:
                raise ValueError(f"entry {i} ({entry!r}): {e}") from None
        names = [spec.display for spec in out]
        for i, name in enumerate(names):
            if name in names[:i] and out[i].label is not None:  # the label repeats, whatever the settings
                raise ValueError(f"entry {i}'s label {name!r} is entry {names.index(name)}'s too: give each entry "
                                 "its own label")
            if name in names[:i]:
                raise ValueError(f"entry {i} ({name!r}) repeats entry {names.index(name)}: the same cell would be "
                                 "computed twice; drop one, or give it a label: to compare other settings")
        return out

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(x < 2 for x in v):
            raise ValueError("every length must be at least 2 tokens")
        big = [x for x in v if x > MAX_LENGTH]
        if big:
            raise ValueError(f"{big[0]} tokens is beyond any model: RoPE angles are computed from float32 "
                             f"positions, exact only up to 2^24 = {MAX_LENGTH} tokens (the longest context "
                             f"windows are about 10 million); use lengths of at most {MAX_LENGTH}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _fits(self) -> EvalConfig:
        self.options.check_lengths(self.lengths)
        return self

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        known = scoring_engine_names()
        if v not in known:
            raise ValueError(f"unknown scoring engine {v!r}; choose from {', '.join(known)}")
        return v


SweepConfig = EvalConfig  # the name before tasks existed


def _top_level_keys(task: str) -> list[str]:
    """Keys a config may have at its top level when it runs ``task``."""
    keys = [k for k in EvalConfig.model_fields if k not in ("options", "engine_options")] + [task] + section_keys()
    return keys + list(LEGACY_KEYS) if task == "perplexity" else keys


def build_config(raw: Any, source: str = "config") -> EvalConfig:
    """An experiment's ``EvalConfig`` from its raw mapping (YAML, ``--set`` and flags merged by ``load_raw``).

    Raises:
        ConfigError: not a mapping, or a key or value the config refuses: one line ``SOURCE: key.path: message``.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model, data, lengths, strategies, ...)")
    try:
        return EvalConfig.model_validate(raw)
    except ValidationError as e:
        task = str(raw.get("task", "perplexity"))
        raise explain(e, source, EvalConfig, allowed=lambda loc: _top_level_keys(task) if len(loc) == 1 else None
                      ) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> EvalConfig:
    """Read and validate a YAML sweep config. Raises ``ConfigError`` naming the bad key."""
    raw, source = load_raw(path, overrides)
    return build_config(raw, source)

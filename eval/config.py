"""Experiment configuration: YAML / flags → validated ``EvalConfig``.

An experiment runs one task (``perplexity`` by default; ``passkey``, ``needle``, … — see
``eval.tasks``) over strategies × lengths. The task's own options sit under its name (or under
``options:``, as ``EvalConfig.model_dump()`` — the manifest's config — writes them, so a dumped
config reads back as the same ``EvalConfig``).

A strategy entry is a name (``yarn``), a name with parameters (``yarn:factor=4,beta_fast=16``)
or a mapping (``{name: yarn, factor: 4, label: yarn-s4}``). Parameters the strategy fills
automatically (``factor`` of linear/ntk/yarn) are set per length to max(1, L / L_train) when
left out. Every error names the key: ``ConfigError: quickstart.yaml: strategies.2: ...``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from ropescale.strategies import get_strategy
from eval.data import DataSpec
from eval.tasks.base import TaskOptions, get_task, task_names
from eval.tasks.perplexity import LEGACY_KEYS

__all__ = ["ConfigError", "StrategySpec", "DataConfig", "EvalConfig", "SweepConfig", "build_config", "load_config", "read_yaml",
           "parse_strategy", "apply_overrides"]


class ConfigError(ValueError):
    """A sweep configuration is malformed; the message names the key."""


class StrategySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None
    logn: bool = False  # log-n query scaling on top of the strategy

    @model_validator(mode="after")
    def _check(self) -> "StrategySpec":
        try:
            strat = get_strategy(self.name)
        except KeyError as e:  # unknown name: the message lists the known ones
            raise ValueError(str(e)) from None
        strat.validate(self.params, fill_auto={"scale": 1.0, "length": 1024, "half_train": 64})
        return self

    @property
    def display(self) -> str:
        if self.label:
            return self.label
        return (self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params.items()) if self.params else "")
                + ("+logn" if self.logn else ""))


def parse_strategy(entry: Any) -> StrategySpec:
    """``"yarn"``, ``"yarn:factor=4,logn=true"`` or ``{"name": "yarn", "factor": 4}`` → ``StrategySpec``.

    ``logn`` is not a strategy parameter but an option any strategy takes (log-n query scaling).
    Raises ``ValueError`` with one line (unknown name with the known ones, bad parameter and its range).
    """
    try:
        return _parse_strategy(entry)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))  # a field's own check (logn); empty for the strategy's
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {msg}" if where else msg) from None


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML parser error as one line."""
    problem = getattr(e, "problem", None) or str(e)
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def _value(text: str, where: str) -> Any:
    """A flag value read as YAML (numbers, booleans, lists); ``ValueError`` in one line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: cannot read {text!r}: {_yaml_error(e)}") from None


def _split_top_level(text: str) -> list[str]:
    """``"a=1,b=[2,3]"`` → ``["a=1", "b=[2,3]"]``: commas inside brackets belong to the value."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth <= 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in parts + [cur] if p.strip()]


def _parse_strategy(entry: Any) -> StrategySpec:
    if isinstance(entry, StrategySpec):
        return entry
    if isinstance(entry, str):
        name, _, rest = entry.partition(":")
        params = {}
        for item in _split_top_level(rest):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"strategy {entry!r}: expected key=value, got {item!r}")
            params[key.strip()] = _value(value, f"strategy {entry!r}")
        logn = params.pop("logn", False)
        return StrategySpec(name=name.strip(), params=params, logn=logn)
    if isinstance(entry, dict):
        entry = dict(entry)
        if "name" not in entry:
            raise ValueError(f"strategy entry {entry} has no 'name'")
        name, label, logn = entry.pop("name"), entry.pop("label", None), entry.pop("logn", False)
        params = entry.pop("params", {}) | entry
        return StrategySpec(name=name, params=params, label=label, logn=logn)
    raise ValueError(f"strategy entry must be a name or a mapping, got {entry!r}")


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = "kjv-heldout"
    config: str | None = None
    split: str = "test"
    text_column: str = "text"
    max_documents: int | None = Field(None, ge=1)

    def spec(self) -> DataSpec:
        return DataSpec(**self.model_dump())


class EvalConfig(BaseModel):
    """One experiment: a task over strategies × lengths on one model (and, for tasks that read
    text, one data source). The task's own keys sit under its name (``passkey: {trials: 20}``);
    perplexity's may also sit at the top level, as they did before tasks existed."""

    model_config = ConfigDict(extra="forbid")
    task: str = "perplexity"
    model: str = "reference"
    data: DataConfig = Field(default_factory=DataConfig)
    lengths: list[int] = Field(min_length=1)
    strategies: list[StrategySpec] = Field(min_length=1)
    # SerializeAsAny: dumped as the task's own options class (the manifest's config), not as the
    # declared base, which has no fields and would dump as {}
    options: SerializeAsAny[TaskOptions] = Field(default_factory=TaskOptions, description="the task's options")
    original_max_position_embeddings: int | None = Field(None, ge=2)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    device_map: str | None = Field(None, description="auto / balanced / sequential: spread a model larger than "
                                                      "one GPU over this node's devices (accelerate)")
    threads: int | None = Field(None, ge=1, description="torch threads (at most this machine's CPU count)")
    output: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _task_options(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
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
        except ValidationError as e:
            raise ValueError("; ".join(f"{name}.{'.'.join(map(str, x['loc']))}: "
                                       f"{x['msg'].removeprefix('Value error, ')}" for x in e.errors())) from None
        return raw

    @field_validator("data", mode="before")
    @classmethod
    def _data(cls, v: Any) -> Any:
        return {"source": v} if isinstance(v, str) else v

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
            if name in names[:i]:
                raise ValueError(f"entry {i} ({name!r}) repeats entry {names.index(name)}: the same cell would be "
                                 "computed twice; drop one, or give it a label: to compare other settings")
        return out

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(x < 2 for x in v):
            raise ValueError("every length must be at least 2 tokens")
        return sorted(set(v))

    @field_validator("threads")
    @classmethod
    def _threads(cls, v: int | None) -> int | None:
        cores = os.cpu_count() or 1
        if v is not None and v > cores:
            raise ValueError(f"{v} threads on a machine with {cores} CPU cores; use at most {cores}")
        return v

    @model_validator(mode="after")
    def _fits(self) -> "EvalConfig":
        self.options.check_lengths(self.lengths)
        return self


SweepConfig = EvalConfig  # the name before tasks existed


def _top_level_keys(task: str) -> list[str]:
    """Keys a config may have at its top level when it runs ``task``."""
    keys = [k for k in EvalConfig.model_fields if k != "options"] + [task]
    return keys + list(LEGACY_KEYS) if task == "perplexity" else keys


def _explain(err: ValidationError, source: str, task: str) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            field = str(e["loc"][-1])
            known = _top_level_keys(task) if len(e["loc"]) == 1 else list(DataConfig.model_fields)
            hint = difflib.get_close_matches(field, known, n=1)
            msg = f"unknown key; allowed: {', '.join(known)}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        lines.append(f"{source}: {key}: {msg}" if e["loc"] else f"{source}: {msg}")
    return ConfigError("\n".join(lines))


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``["lengths=[128,256]", "data.max_documents=3"]`` applied to a raw config mapping."""
    raw = dict(raw)
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            child = node.get(p)
            node[p] = child = dict(child) if isinstance(child, dict) else ({"source": child} if p == "data" and isinstance(child, str) else {})
            node = child
        try:
            node[last] = _value(value, f"--set {item!r}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return raw


def build_config(raw: Any, source: str = "config") -> EvalConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model, data, lengths, strategies, ...)")
    try:
        return EvalConfig.model_validate(raw)
    except ValidationError as e:
        raise _explain(e, source, str(raw.get("task", "perplexity"))) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last).
    Merge keys (``<<: *anchor``) are YAML too: the merged keys are defaults the mapping's own
    keys override, so only the mapping's own keys are checked."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict:
    """The raw mapping of a YAML config file. Raises ``ConfigError`` (missing, invalid, not a mapping)."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # YAML is UTF-8, whatever the locale
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a YAML config must be UTF-8)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_error(e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (model, data, lengths, strategies, ...)")
    return raw


def load_config(path: str | Path, overrides: list[str] = ()) -> EvalConfig:
    """Read and validate a YAML sweep config. Raises ``ConfigError`` naming the bad key."""
    return build_config(apply_overrides(read_yaml(path), list(overrides)), str(path))

"""Configuration primitives shared by every run (evaluation experiments and fine-tuning).

``ConfigError`` (the one-line error of a malformed config), strategy entries
(``StrategySpec``/``parse_strategy``: ``"yarn"``, ``"yarn:factor=4,logn=true"`` or a mapping), the data
source (``DataConfig``), ``--set key=value`` overrides and the YAML reader (duplicate keys refused,
merge keys allowed, UTF-8 whatever the locale, at most ``MAX_VALUES`` values once its aliases are
expanded: an alias bomb is refused before it is built), and ``ConfigModel``, the base of every config
section (YAML's true/false refused where a number is meant).

The one loader and the one error formatter of every config kind (an experiment, a sweep, a
fine-tuning run, a search, a task's or a recipe's options): ``load_raw`` (a YAML file, then flags,
then ``--set`` overrides → one mapping) and ``explain`` / ``error_parts`` (pydantic's errors → one
line, ``FILE: key.path: message`` per error joined by ``; ``; an unknown key lists the allowed ones
with the closest: ``configs/x.yaml: stpes: unknown key; allowed: model, ... (did you mean 'steps'?)``).
A section validated inside a validator (a task's or a recipe's options) raises ``NestedErrors``, so
its keys read as paths of the outer config (``recipe.rr``, ``passkey.trials``).
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.runs.data import DataSpec
from ropescale.runs.profiles import factor_text
from ropescale.strategies import get_strategy
from ropescale.temperature import parse_temperature

__all__ = ["MAX_VALUES", "ConfigError", "ConfigModel", "DataConfig", "NestedErrors", "RunConfig", "StrategySpec",
           "apply_overrides", "check_threads", "error_parts", "explain", "load_raw", "parse_strategy", "read_yaml"]

MAX_VALUES = 100_000  # values in one config (or one --set value) with its YAML aliases expanded


class ConfigError(RopescaleError, ValueError):
    """A sweep configuration is malformed; the message names the key."""


def _plain_type(annotation: Any) -> Any:
    """``Annotated[float, Field(...)]`` → ``float``; anything else unchanged."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _numeric_kinds(annotation: Any) -> str | None:
    """``"scalar-int"`` / ``"scalar-float"`` for an int / float field (optional or not), ``"list"``
    for a list or tuple of numbers, None otherwise (a field that takes booleans is left alone)."""
    annotation = _plain_type(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = {_plain_type(a) for a in typing.get_args(annotation)} if union else {annotation}
    if bool in args:
        return None
    if int in args:
        return "scalar-int"
    if float in args:
        return "scalar-float"
    for a in args:
        items = {_plain_type(x) for x in typing.get_args(a)}
        if typing.get_origin(a) in (list, tuple) and items & {int, float} and bool not in items:
            return "list"
    return None


class ConfigModel(BaseModel):
    """The base of every config section (an experiment, a fine-tuning run, a task's or a recipe's
    options, ``vllm:``, ``data:``): YAML's ``true``/``false`` where a number is meant (``trials: true``,
    ``tensor_parallel_size: true``) would be read as 1 or 0; it is refused in one line under its key
    (``expected an integer, got true``). A field whose type admits a boolean is left alone, and a
    field's own ``mode="before"`` validator runs first (``loss_chunk_size: false`` → 0)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
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


class StrategySpec(BaseModel):
    """A strategy as an experiment names it (``NAME[:k=v,...]`` or a mapping): its registry ``name``,
    ``params``, a display ``label``, a query temperature (``logn``, ``temperature``), request-length
    ``profiles``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None
    logn: bool = False  # log-n query scaling on top of the strategy
    temperature: str | dict | None = None  # another query temperature (ropescale.temperature) instead
    # request-length profiles (ropescale.serving.profiles): the factor per example, from these, by its length
    profiles: list[Any] | None = None  # checked (check_factors): numbers >= 1, no bool

    @model_validator(mode="after")
    def _check(self) -> StrategySpec:
        try:
            strat = get_strategy(self.name)
        except KeyError as e:  # unknown name: the message lists the known ones
            raise ValueError(str(e)) from None
        rule = parse_temperature(self.temperature)
        if rule is not None and self.logn:
            raise ValueError("logn and temperature: name one query temperature")
        if self.profiles is not None:
            from ropescale.runs.profiles import check_factors

            object.__setattr__(self, "profiles", check_factors(self.profiles, f"{self.name}: profiles"))
            if strat.scale_param is None or strat.kind != "frequency" or strat.dynamic:
                raise ValueError(f"{self.name}: profiles pick a static scale factor per request; {self.name} has "
                                 "none (profiles serve a static frequency strategy with a factor: yarn, linear, ntk)")
            if strat.scale_param in self.params:
                raise ValueError(f"{self.name}: profiles give the factor; leave {strat.scale_param} out")
        strat.validate(self.params, partial=True)  # auto parameters left out are filled per length (resolve)
        # numpy numbers (accepted as numbers) as the Python ones they hold: displays, cell ids and manifests
        # (JSON) read them as written in Python
        object.__setattr__(self, "params", {k: _plain(v) for k, v in self.params.items()})
        return self

    @property
    def display(self) -> str:
        """How tables and messages name the entry: its label, else ``NAME:k=v,...`` with ``+logn``,
        a temperature and profiles.
        """
        if self.label:
            return self.label
        return (self.name + (":" + ",".join(f"{k}={v}" for k, v in self.params.items()) if self.params else "")
                + ("+logn" if self.logn else "")
                + (f"+{parse_temperature(self.temperature).spec()}" if self.temperature else "")
                + (f"+profiles={'/'.join(factor_text(f) for f in self.profiles)}" if self.profiles else ""))

    def resolve(self, *, length: int, train_length: int, context: dict[str, Any] | None = None) -> dict:
        """The strategy's parameters for a run at L = ``length`` tokens on a model trained on T =
        ``train_length`` (``Strategy.resolve``); with ``profiles``, the factor the profiles' rule picks
        for an example of L tokens (``ropescale.serving.profiles.select_factor``)."""
        params, strat = self.params, get_strategy(self.name)
        if self.profiles:
            from ropescale.runs.profiles import select_factor

            params = {**params, strat.scale_param: select_factor(self.profiles, train_length, length)}
        return strat.resolve(params, length=length, train_length=train_length, context=context)


def _plain(value: Any) -> Any:
    """numpy scalars (also inside lists) as the Python values they hold; anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def parse_strategy(entry: Any) -> StrategySpec:
    """``"yarn"``, ``"yarn:factor=4,logn=true"`` or ``{"name": "yarn", "factor": 4}`` → ``StrategySpec``.

    ``logn`` and ``temperature`` are not strategy parameters but options any strategy takes (log-n query
    scaling; another ``ropescale.temperature`` rule, e.g. ``yarn:temperature={kind: beta, beta: 0.1}``).
    Raises ``ValueError`` with one line (unknown name with the known ones, bad parameter and its range).
    """
    try:
        return _parse_strategy(entry)
    except ValidationError as e:
        where, msg = error_parts(e, StrategySpec)[0]  # a field's own check (logn); no key for the strategy's
        raise InvalidInput(f"{where}: {msg}" if where else msg) from None


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML parser error as one line."""
    problem = getattr(e, "problem", None) or str(e)
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def _value(text: str, where: str) -> Any:
    """A flag value read as YAML (numbers, booleans, lists) by the config files' reader; ``ValueError``
    in one line."""
    try:
        return _load_yaml(text)
    except yaml.YAMLError as e:
        raise InvalidInput(f"{where}: cannot read {text!r}: {_yaml_error(e)}") from None


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
            if key.strip() in params:  # the last would win unseen
                raise ValueError(f"strategy {entry!r}: {key.strip()} given twice")
            params[key.strip()] = _value(value, f"strategy {entry!r}")
        logn, temperature = params.pop("logn", False), params.pop("temperature", None)
        profiles = params.pop("profiles", None)
        return StrategySpec(name=name.strip(), params=params, logn=logn, temperature=temperature, profiles=profiles)
    if isinstance(entry, dict):
        entry = dict(entry)
        if "name" not in entry:
            raise ValueError(f"strategy entry {entry} has no 'name'")
        name, label, logn = entry.pop("name"), entry.pop("label", None), entry.pop("logn", False)
        temperature, profiles = entry.pop("temperature", None), entry.pop("profiles", None)
        nested = entry.pop("params", {})
        both = sorted(set(nested) & set(entry)) if isinstance(nested, dict) else []
        if both:  # the top-level value would win unseen
            raise ValueError(f"strategy entry {name!r}: {both[0]} given both under params: and beside it; give it once")
        params = nested | entry
        return StrategySpec(name=name, params=params, label=label, logn=logn, temperature=temperature,
                            profiles=profiles)
    raise ValueError(f"strategy entry must be a name or a mapping, got {entry!r}")


class DataConfig(ConfigModel):
    """A config's ``data:`` section: the source (kjv-heldout, a local file or folder, a hub dataset id),
    its config, split, text column, how many documents, whether to join them."""

    model_config = ConfigDict(extra="forbid")
    source: str = "kjv-heldout"
    config: str | None = None
    split: str = "test"
    text_column: str = "text"
    max_documents: int | None = Field(None, ge=1)
    join: bool = Field(False, description="the documents as one text, in order, separated by a blank line "
                                          "(windows longer than any one document: books of a corpus read in turn)")

    @model_validator(mode="before")
    @classmethod
    def _source_only(cls, raw: Any) -> Any:
        """``data: kjv-train`` (the source alone) → ``{source: kjv-train}``."""
        return {"source": raw} if isinstance(raw, str) else raw

    def spec(self) -> DataSpec:
        """The section as the data readers take it (``ropescale.runs.data.DataSpec``)."""
        return DataSpec(**self.model_dump())


class RunConfig(ConfigModel):
    """The base of every run's config — an experiment (``eval.config.EvalConfig``), a search
    (``eval.search.config.SearchConfig``), a fine-tuning run
    (``ropescale.training.config.FinetuneConfig``): the fields and checks they share. Each kind adds
    its own fields (and its ``dtype`` choices) and redefines a shared one's default where it differs
    (a search's and a fine-tuning run's ``data`` is the training split); the shared fields keep their
    place in a dumped config. The run's lifecycle is ``ropescale.runs.protocol``'s."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field("reference", description="a Hugging Face model id, a local folder, or the bundled "
                                                "reference model")
    data: DataConfig = Field(default_factory=DataConfig, description="the documents the run reads")
    original_max_position_embeddings: int | None = Field(None, ge=2, description="override the model's training "
                                                                                 "window T [tokens]")
    device: str = "auto"
    threads: int | None = Field(None, ge=1, description="torch threads (at most this machine's CPU count)")
    output: str | None = Field(None, description="the run's folder (one run per folder)")

    @field_validator("threads")
    @classmethod
    def _threads(cls, v: int | None) -> int | None:
        return check_threads(v)


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
            node[p] = child = (dict(child) if isinstance(child, dict)
                               else ({"source": child} if p == "data" and isinstance(child, str) else {}))
            node = child
        try:
            node[last] = _value(value, f"--set {item!r}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return raw


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
                    None, None,
                    f"key {key!r} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def get_single_node(self):
        """The document's node graph, refused before any value is built when its aliases expand to
        more than ``MAX_VALUES`` values or an alias sits inside its own anchor."""
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values ``node`` stands for with every alias expanded (a scalar 1, a collection 1 +
    its items'), each distinct node counted once (``sizes``); ``ComposerError`` once past
    ``MAX_VALUES`` — ten aliases of ten aliases … ten levels deep are 10^10 values built from a few
    hundred characters — or for an alias inside its own anchor (``open_``: the anchors being counted)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise yaml.composer.ComposerError(None, None, "an alias refers to its own anchor (a value cannot hold "
                                          "itself)", node.start_mark)
    open_.add(id(node))
    total = 1
    if isinstance(node, yaml.CollectionNode):
        children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else node.value
        for child in children:
            total += _expanded_size(child, sizes, open_)
            if total > MAX_VALUES:
                raise yaml.composer.ComposerError(
                    None, None, f"its aliases expand to more than {MAX_VALUES:,} values (anchors repeated inside "
                    "anchors: an alias bomb); write the values out, or use fewer aliases", node.start_mark)
    open_.discard(id(node))
    sizes[id(node)] = total
    return total


def _load_yaml(text: str) -> Any:
    """``text`` as YAML through ``_UniqueKeyLoader``; ``yaml.YAMLError`` (nesting too deep for the
    parser included) in one line."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply to read") from None


def read_yaml(path: str | Path) -> dict:
    """The raw mapping of a YAML config file. Raises ``ConfigError`` (missing, invalid, not a mapping,
    more than ``MAX_VALUES`` values once its aliases are expanded)."""
    path = Path(path)
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8"))  # YAML is UTF-8, whatever the locale
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


def check_threads(v: int | None) -> int | None:
    """A run's ``threads``: at most this machine's CPU cores (None: torch's default). Raises
    ``ValueError`` in one line (a config's validator reports it under its key)."""
    cores = os.cpu_count() or 1
    if v is not None and v > cores:
        raise ValueError(f"{v} threads on a machine with {cores} CPU cores; use at most {cores}")
    return v


def load_raw(path: str | Path | None, overrides: list[str] = (), flags: dict | None = None) -> tuple[dict, str]:
    """The raw mapping of a config, before its model validates it.

    Args:
        path: the YAML file (None: none).
        overrides: ``--set key=value`` items, applied last (dots for nesting: ``pose.chunks=3``).
        flags: command-line values, applied over the file (those not None).

    Returns:
        ``(raw, source)``: the mapping, and its source for error messages (the file, or ``flags``).

    Raises:
        ConfigError: a missing file, YAML that does not parse, a key given twice, an override
            without ``=`` (one line).
    """
    raw = read_yaml(path) if path else {}
    raw = {**raw, **{k: v for k, v in (flags or {}).items() if v is not None}}
    return apply_overrides(raw, list(overrides)), str(path) if path else "flags"


class NestedErrors(ValueError):
    """A section's own validation errors raised from a validator of the config holding it. The outer
    formatter (``explain``) reads them as paths of the outer config.

    Args:
        parts: ``[(key path inside the section, message)]``, from ``error_parts``.
    """

    def __init__(self, parts: list[tuple[str, str]]):
        self.parts = parts
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in parts))

    def under(self, key: str) -> NestedErrors:
        """The same errors under a key of the outer config.

        Args:
            key: the section's key (``recipe``, ``passkey``).

        Returns:
            The errors with ``key`` prefixed to their paths.
        """
        return NestedErrors([(f"{key}.{k}" if k else key, m) for k, m in self.parts])


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X | None``, ``list[X]``, ``dict[str, X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, (types.UnionType,)) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _allowed_keys(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The keys allowed where ``loc``'s last key is: the fields of the model its path leads to."""
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = _model_of(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def error_parts(err: ValidationError, model: type[BaseModel] | None = None, *,
                allowed: Callable[[tuple], list[str] | None] | None = None) -> list[tuple[str, str]]:
    """``[(key path, message)]`` of pydantic's errors, the message in the config's words: an unknown
    key lists the allowed keys (the fields of ``model`` along the path; ``allowed(loc)`` first where
    a config knows better) and the closest one; a missing key says so; a strictly typed number says
    what it got; ``NestedErrors`` raised by a validator are expanded under its key."""
    out = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(map(str, loc))
        nested = (e.get("ctx") or {}).get("error")
        if isinstance(nested, NestedErrors):
            out += nested.under(key).parts if key else nested.parts
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            known = (allowed(loc) if allowed else None) or _allowed_keys(model, loc)
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = (f"unknown key; allowed: {', '.join(known) or 'none'}"
                   + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] in ("int_type", "float_type", "finite_number") and "got" not in msg:  # say what was given
            msg += f", got {e['input']!r}"
        out.append((key, msg))
    return out


def explain(err: ValidationError, source: str, model: type[BaseModel] | None = None, *,
            allowed: Callable[[tuple], list[str] | None] | None = None) -> ConfigError:
    """The one-line error of a config that failed validation.

    Args:
        err: pydantic's error.
        source: the config's source (its file, ``flags``).
        model: the config's model, whose fields an unknown key's message lists (None: none listed).
        allowed: ``allowed(loc)``, the keys allowed at a path where the config knows better than its
            fields (None: the fields).

    Returns:
        A ``ConfigError``: ``SOURCE: key.path: message`` for each error (``error_parts``), joined by ``; ``.
    """
    return ConfigError("; ".join(f"{source}: {k}: {m}" if k else f"{source}: {m}"
                                 for k, m in error_parts(err, model, allowed=allowed)))

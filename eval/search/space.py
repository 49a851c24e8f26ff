"""The search space of a registered strategy, derived from its ``Param`` declarations.

Every numeric parameter (``kind`` float or int) is searchable; its range is the ``Param``'s
(``low``/``high``, an open bound moved just inside: the next float up or down, or the next whole
number) intersected with a range the user gives; it is sampled on a log scale when the ``Param``
declares ``log=True`` (ratios, bases, lengths in tokens) unless the user says otherwise. List and
bool parameters are not searchable. A parameter with no finite bound on a side needs the user's
range there. So a new strategy is searchable with no code here.

Config forms (``SearchConfig.search``): a list of names (``[beta_fast, beta_slow]``: each over its
``Param`` range) or a mapping ``name: null | [low, high] | {low: .., high: .., log: ..}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ropescale.runs.config import ConfigError
from ropescale.strategies import get_strategy
from ropescale.strategies.registry import Param, Strategy

__all__ = ["Dimension", "centre", "search_space", "searchable"]


@dataclass(frozen=True)
class Dimension:
    """One searched parameter: values in [``low``, ``high``] (inclusive; whole numbers when
    ``kind`` is ``"int"``), sampled uniformly in log(value) when ``log``. Units are the parameter's
    own (``ropescale strategies`` lists them)."""

    name: str
    kind: str  # "float" | "int"
    low: float
    high: float
    log: bool = False


def centre(space: list[Dimension]) -> dict[str, float | int]:
    """The middle of ``space``: each dimension's midpoint (geometric on a log scale; whole numbers rounded)
    — the candidate a search computes its strategy on before it claims its folder."""
    out: dict[str, float | int] = {}
    for d in space:
        mid = math.sqrt(d.low * d.high) if d.log else (d.low + d.high) / 2
        out[d.name] = round(mid) if d.kind == "int" else mid
    return out


def searchable(param: Param) -> bool:
    """Whether a parameter is numeric (float or int), hence searchable."""
    return param.kind in (float, int)


def _inside(param: Param) -> tuple[float | None, float | None]:
    """The ``Param``'s range as closed bounds (None: unbounded on that side)."""
    low, high = param.low, param.high
    if low is not None and param.low_open:
        low = low + 1 if param.kind is int else math.nextafter(low, math.inf)
    if high is not None and param.high_open:
        high = high - 1 if param.kind is int else math.nextafter(high, -math.inf)
    return low, high


def _user_range(strategy: Strategy, name: str, given: Any) -> tuple[float | None, float | None, bool | None]:
    """``(low, high, log)`` the user gave for ``name`` (None where not given)."""
    where = f"search.{name}"
    if given is None:
        return None, None, None
    if isinstance(given, (list, tuple)):
        if len(given) != 2:
            raise ConfigError(f"{where}: expected [low, high], got {list(given)!r}")
        given = {"low": given[0], "high": given[1]}
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: expected null, [low, high] or a mapping of low/high/log, got {given!r}")
    extra = set(given) - {"low", "high", "log"}
    if extra:
        raise ConfigError(f"{where}: unknown key {sorted(extra)[0]!r}; allowed: low, high, log")
    log = given.get("log")
    if log is not None and not isinstance(log, bool):
        raise ConfigError(f"{where}.log: must be true or false, got {log!r}")
    bounds = []
    for key in ("low", "high"):
        value = given.get(key)
        if value is not None:
            try:  # the bound itself must be a value the strategy accepts
                value = strategy.param(name).check(strategy.name, value)
            except ValueError as e:
                raise ConfigError(f"{where}.{key}: {e}") from None
        bounds.append(value)
    return bounds[0], bounds[1], log


def search_space(strategy_name: str, search: list[str] | dict[str, Any] | None = None,
                 fixed: dict[str, Any] | None = None) -> list[Dimension]:
    """The dimensions to search for ``strategy_name``.

    ``search``: the parameters to search (a list of names, or a mapping name → range, see the
    module docstring); None or empty: every numeric parameter not in ``fixed``. ``fixed``: values
    the user pins (checked by the strategy, never searched). Raises ``ConfigError`` in one line
    for an unknown strategy or parameter, a list/bool parameter, a parameter both fixed and
    searched, a range outside the parameter's or empty, a side with no bound, a log scale over
    values ≤ 0, or nothing left to search.
    """
    try:
        strategy = get_strategy(strategy_name)
    except KeyError as e:
        raise ConfigError(f"strategy: {e}") from None
    fixed = dict(fixed or {})
    names = {p.name: p for p in strategy.params}
    _check_fixed(strategy, names, fixed)
    if isinstance(search, (list, tuple)):
        search = dict.fromkeys(search)
    search = dict(search or {})
    if not search:
        search = {p.name: None for p in strategy.params if searchable(p) and p.name not in fixed}
        if not search:
            raise ConfigError(f"{strategy.name}: no numeric parameter to search (its parameters: "
                              f"{', '.join(names) or 'none'}; fixed: {', '.join(fixed) or 'none'})")
    dims = []
    for name, given in search.items():
        if name not in names:
            raise ConfigError(f"search: {strategy.name} has no parameter {name!r}; its parameters: "
                              f"{', '.join(names) or 'none'}")
        if name in fixed and searchable(names[name]):
            raise ConfigError(f"search.{name}: also under fixed:; a parameter is either searched or fixed")
        dims.append(_dimension(strategy, names[name], given))
    return dims


def _check_fixed(strategy, names: dict, fixed: dict[str, Any]) -> None:
    """Each fixed value on its own (the combination is checked per candidate); ``ConfigError``."""
    for key, value in fixed.items():
        if key not in names:
            raise ConfigError(f"fixed: {strategy.name} has no parameter {key!r}; its parameters: "
                              f"{', '.join(names) or 'none'}")
        try:
            names[key].check(strategy.name, value)
        except ValueError as e:
            raise ConfigError(f"fixed: {e}") from None


def _dimension(strategy, param, given: Any) -> Dimension:
    """The dimension of ``param``: its allowed range narrowed by the user's ``given`` range (see
    ``_user_range``), its scale; ``ConfigError`` for a parameter that is not a number, a side
    without a bound, an empty range, a log scale over values ≤ 0."""
    name = param.name
    if not searchable(param):
        raise ConfigError(f"search.{name}: a {param.kind.__name__} parameter is not searchable; "
                          "only float and int parameters are (give it under fixed:)")
    low, high = _inside(param)
    user_low, user_high, user_log = _user_range(strategy, name, given)
    low = user_low if user_low is not None else low
    high = user_high if user_high is not None else high
    log = param.log if user_log is None else user_log
    if low is None or high is None:
        side = "lower" if low is None else "upper"
        raise ConfigError(f"search.{name}: {strategy.name}'s {name} has no {side} bound "
                          f"(allowed: {param.range_text()}); give a range: search: {{{name}: [low, high]}}")
    if param.kind is int:
        low, high = math.ceil(low), math.floor(high)
    if not low < high:
        raise ConfigError(f"search.{name}: empty range [{low:g}, {high:g}]; low must be below high")
    if log and low <= 0:
        raise ConfigError(f"search.{name}: a log scale needs values > 0, the range starts at {low:g}; "
                          f"give a positive low (search: {{{name}: [low, high]}}) or log: false")
    return Dimension(name, "int" if param.kind is int else "float", float(low), float(high), bool(log))

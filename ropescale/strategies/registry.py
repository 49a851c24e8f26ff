"""Registry of rotary strategies: name → pure function + validated parameters.

A strategy is a function from explicit keyword arguments to ``RopeFrequencies``. It may ask
for any of the *context* arguments below by naming them in its signature; everything else
in its signature is one of its own parameters, declared with a ``Param`` (default, range,
and how a sweep fills it in automatically).

Context arguments (units in brackets):
    dim: rotary dimension d (even) = 2 · len(inv_freq); ``head_dim`` unless partial rotary.
    rope_theta: RoPE base b.
    original_max_position_embeddings: training window L_train [tokens].
    seq_len: current sequence length L [tokens]; naming it makes the strategy *dynamic*
        (recomputed per forward from ``max(position_ids) + 1``).

Raises ``UnknownStrategyError`` (a ``KeyError``) for an unknown name, with the known names
and a close match, and ``ValueError`` naming the parameter, the bad value and the allowed
range for bad parameters. This mirrors ``transformers.modeling_rope_utils`` with real
errors instead of warnings.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple

import torch

from ropescale.errors import RopescaleError

__all__ = [
    "CONTEXT_ARGS", "Param", "RopeFrequencies", "Strategy", "UnknownStrategyError",
    "REGISTRY", "register", "get_strategy", "strategy_names",
]

CONTEXT_ARGS = ("dim", "rope_theta", "original_max_position_embeddings", "seq_len")
_REQUIRED = object()


class RopeFrequencies(NamedTuple):
    """What a frequency strategy returns.

    inv_freq: ``[d/2]`` float32, angular frequency θ_i of rotary pair i [radians per token].
    attention_factor: multiplies cos and sin, so attention logits scale by its square.
    """

    inv_freq: torch.Tensor
    attention_factor: float


class UnknownStrategyError(RopescaleError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class Param:
    """One parameter of a strategy.

    ``low``/``high`` bound the value (inclusive unless ``*_open``). ``auto`` names what a sweep
    fills in when the user leaves the parameter out: ``"scale"`` → max(1, L / L_train),
    ``"length"`` → L for the sweep's target length L, ``"half_train"`` → L_train / 2. Outside a
    sweep the ``default`` applies, and a parameter without one is required.
    """

    name: str
    default: Any = _REQUIRED
    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    auto: Literal["scale", "length", "half_train"] | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def range_text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts) or "any value"

    def check(self, strategy: str, value: Any) -> Any:
        where = f"{strategy}: parameter {self.name}={value!r}"
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{where} must be true or false")
            return value
        if self.kind is list:  # a list of numbers, each within the range
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{where} must be a non-empty list of numbers")
            item = Param(self.name, kind=float, low=self.low, high=self.high,
                         low_open=self.low_open, high_open=self.high_open)
            return [item.check(strategy, v) for v in value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number ({self.kind.__name__})")
        if self.kind is int:
            if float(value) != int(value):
                raise ValueError(f"{where} must be a whole number")
            value = int(value)
        else:
            value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{where} must be finite")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            raise ValueError(f"{where} is out of range; allowed: {self.range_text()}")
        return value


@dataclass(frozen=True)
class Strategy:
    """A registered strategy. ``kind`` is ``"frequency"`` (returns ``RopeFrequencies``) or
    ``"attention"`` (returns a ``RelativeRule`` applied inside attention)."""

    name: str
    fn: Callable[..., RopeFrequencies]
    params: tuple[Param, ...]
    source: str
    kind: str = "frequency"
    check: Callable[[dict], None] | None = None
    needs: tuple[str, ...] = field(default=())

    @property
    def dynamic(self) -> bool:
        """True when the frequencies depend on the current sequence length."""
        return "seq_len" in self.needs

    @property
    def summary(self) -> str:
        first = (inspect.getdoc(self.fn) or "").split("\n\n")[0]
        return " ".join(first.replace("``", "").split())

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def validate(self, params: dict[str, Any], *, fill_auto: dict[str, float] | None = None) -> dict:
        """Checked parameters with defaults filled in.

        ``fill_auto`` maps an ``auto`` kind ("scale", "length") to the value a sweep supplies
        for parameters the user left out. Raises ``ValueError`` for unknown, missing or
        out-of-range parameters.
        """
        known = {p.name for p in self.params}
        for key in params:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                raise ValueError(
                    f"{self.name} has no parameter {key!r}; its parameters: "
                    f"{', '.join(sorted(known)) or 'none'}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
        out = {}
        for p in self.params:
            if p.name in params and params[p.name] is not None:
                out[p.name] = p.check(self.name, params[p.name])
            elif p.auto and fill_auto and p.auto in fill_auto:
                out[p.name] = p.check(self.name, fill_auto[p.auto])
            elif not p.required:
                out[p.name] = p.default
            else:
                auto = " (a sweep sets it from the target length)" if p.auto else ""
                raise ValueError(f"{self.name}: parameter {p.name} is required{auto}; allowed: {p.range_text()}")
        if self.check:
            self.check(out)
        return out

    def compute(self, context: dict[str, Any], params: dict[str, Any]) -> RopeFrequencies:
        """Call the function with the context arguments it names plus validated ``params``."""
        missing = [k for k in self.needs if context.get(k) is None]
        if missing:
            raise ValueError(f"{self.name} needs {', '.join(missing)}, which the model did not provide")
        return self.fn(**{k: context[k] for k in self.needs}, **params)


REGISTRY: dict[str, Strategy] = {}


def register(name: str, *, params: tuple[Param, ...] = (), source: str,
             kind: str = "frequency", check: Callable[[dict], None] | None = None):
    """Decorator adding a strategy function to ``REGISTRY`` under ``name``."""

    def deco(fn: Callable[..., RopeFrequencies]) -> Callable[..., RopeFrequencies]:
        sig = inspect.signature(fn).parameters
        needs = tuple(a for a in CONTEXT_ARGS if a in sig)
        declared = {p.name for p in params}
        own = set(sig) - set(needs)
        if own != declared:
            raise TypeError(f"{name}: signature parameters {sorted(own)} != declared {sorted(declared)}")
        if name in REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        REGISTRY[name] = Strategy(name, fn, params, source, kind, check, needs)
        return fn

    return deco


def strategy_names() -> list[str]:
    return sorted(REGISTRY)


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; ``UnknownStrategyError`` lists the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        hint = difflib.get_close_matches(str(name), REGISTRY, n=1)
        raise UnknownStrategyError(
            f"unknown strategy {name!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; known strategies: {', '.join(strategy_names())}"
        ) from None

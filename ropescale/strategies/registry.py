"""Registry of rotary strategies: name → pure function + validated parameters.

A strategy is a function from explicit keyword arguments to ``RopeFrequencies``. It may ask
for any of the *context* arguments below by naming them in its signature; everything else
in its signature is one of its own parameters, declared with a ``Param`` (default, range,
and how a sweep fills it in automatically).

Context arguments (units in brackets):
    dim: rotary dimension d (even) = 2 · len(inv_freq); ``head_dim`` unless partial rotary.
    rope_theta: RoPE base b.
    original_max_position_embeddings: training window T [tokens].
    seq_len: current sequence length L [tokens]; naming it makes the strategy *dynamic*
        (recomputed per forward from ``max(position_ids) + 1``).
    model_inv_freq, model_attention_scaling: the loaded model's own ``inv_freq`` ``[d/2]`` and cos/sin
        scale, as shipped (``native``); absent where only a config was read.
    dual_chunk_attention_config: the model's own ``dual_chunk_attention_config`` (Qwen2.5-1M's
        ``{"chunk_size", "local_size", "original_max_position_embeddings"}`` [tokens]); optional: None
        where the model has none (``OPTIONAL_CONTEXT``), so a strategy naming it falls back to its
        own defaults.

Parameters are checked by ``Strategy.validate`` (no target length) or ``Strategy.resolve``
(target length L and training window T: the one rule filling ``auto`` parameters, ``auto_value``).
``register(..., export=fn)`` declares how transformers expresses a strategy (``Exporter``).

Raises ``UnknownStrategyError`` (an ``UnknownNameError`` and a ``KeyError``) for an unknown name, with the known names
and a close match, and ``InvalidInput`` (a ``ValueError``) naming the parameter, the bad value and the allowed
range for bad parameters. This mirrors ``transformers.modeling_rope_utils`` with real
errors instead of warnings.

What a frequency strategy returns is checked where it enters every use (``Strategy.compute``: the
patch, dynamic recomputation, exports, inspection): ``inv_freq`` a floating torch tensor of shape
``[d/2]``, finite and ≥ 0 (0 leaves a pair unrotated), ``attention_factor`` a finite number > 0;
otherwise ``InvalidInput`` naming the strategy and, for one registered by a plugin, the plugin.
``register`` refuses a ``Param`` whose default lies outside its own range (``TypeError``).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch

from ropescale.errors import InvalidInput, UnknownNameError
from ropescale.registry import Registry, loading_plugin

__all__ = [
    "AUTO_KINDS",
    "BASELINE",
    "CONTEXT_ARGS",
    "DYNAMIC_SERVING",
    "OPTIONAL_CONTEXT",
    "REGISTRY",
    "STRATEGY_KINDS",
    "AutoKind",
    "Exporter",
    "Freezer",
    "Param",
    "RopeFrequencies",
    "Strategy",
    "StrategyKind",
    "UnknownStrategyError",
    "auto_value",
    "check_frequencies",
    "get_strategy",
    "register",
    "strategy_names",
]

CONTEXT_ARGS = ("dim", "rope_theta", "original_max_position_embeddings", "seq_len", "model_inv_freq",
                "model_attention_scaling", "dual_chunk_attention_config")
OPTIONAL_CONTEXT = ("dual_chunk_attention_config",)  # passed as None where the model has none
_REQUIRED = object()
# keywords that are not a strategy's to take: patch()'s options (ropescale.patching.options.PatchOptions, told apart
# from the strategy's parameters by name) and the keys a config's strategy entry reads itself (ropescale.runs.config)
RESERVED_PARAMS = ("original_max_position_embeddings", "layer_types", "dynamic_cache", "dynamic_block", "logn",
                   "attention_path", "block_size", "temperature", "profiles", "label", "name", "params")

StrategyKind = Literal["frequency", "attention"]
"""``"frequency"``: the function returns ``RopeFrequencies``; ``"attention"``: a ``RelativeRule``."""
BASELINE = "vanilla"  # the unscaled rotation (frequency.py registers it): what a baseline cell runs

STRATEGY_KINDS: tuple[str, ...] = get_args(StrategyKind)

DynamicServing = Literal["freeze", "sets"]
"""How engines with one static rotation serve a dynamic strategy: ``"freeze"`` — its static form at a
chosen length (dynamic NTK); ``"sets"`` — static sets the engine picks from by the served length (LongRoPE)."""
DYNAMIC_SERVING: tuple[str, ...] = get_args(DynamicServing)

AutoKind = Literal["scale", "length", "half_train"]
"""How a parameter left out is filled from the target length L and the training window T."""
AUTO_KINDS: tuple[str, ...] = get_args(AutoKind)
_AUTO_TEXT = {"scale": "max(1, L / T)", "length": "L", "half_train": "floor(T / 2)"}

Freezer = Callable[[dict, int, int], "tuple[str, dict]"]
"""``fn(params, at, train_length) -> (name, params)``: the static strategy (a registered name and its parameters)
that rotates as a ``served="freeze"`` dynamic strategy with validated ``params`` does at sequence length F = ``at``
on a model with training window T = ``train_length`` [tokens] — what engines with one static rotation serve."""

Exporter = Callable[[dict, dict, dict, "int | None"], "dict | None"]
"""``fn(params, context, base, max_position_embeddings) -> rope_parameters | None``: the
transformers ``rope_parameters`` entries (``rope_type`` and its keys) that reproduce a strategy
with validated ``params`` in a rotary ``context`` (``dim``, ``rope_theta``,
``original_max_position_embeddings``); ``base`` is the layer's original ``rope_parameters``
(read only) and ``max_position_embeddings`` the config's. None: transformers cannot express it."""


def auto_value(auto: str, *, length: int, train_length: int) -> float | int:
    """The value of an ``auto`` parameter at target length L = ``length`` for a model trained on
    T = ``train_length`` tokens: ``"scale"`` → max(1, L / T) (float), ``"length"`` → L (float),
    ``"half_train"`` → T // 2 (int) [tokens]. The one place that maps auto kinds to values."""
    if auto == "scale":
        return max(1.0, length / train_length)
    if auto == "length":
        return float(length)
    if auto == "half_train":
        return train_length // 2
    raise InvalidInput(f"unknown auto kind {auto!r}; known: {', '.join(AUTO_KINDS)}")


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (``numpy.int64(16)`` → 16), for messages and
    results; anything else unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def _is_bool(value: Any) -> bool:
    """Python's and numpy's booleans (``numpy.bool_`` is no ``bool`` subclass)."""
    return isinstance(value, (bool, np.bool_))


_WHOLE_MAX = 2**53  # every whole number up to here is exact as a float (positions, angles)


def _whole(value: Any) -> int | None:
    """``value`` as a Python int when it is a whole number of magnitude at most 2^53: a Python or
    numpy integer, or a float with an integral value (16.0: what YAML, JSON and float-valued
    searches write for 16); None for anything else (bools, 16.5, inf, nan, strings, 10^400)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        whole = int(value)
    else:
        number = float(value)
        if not (math.isfinite(number) and number.is_integer()):
            return None
        whole = int(number)
    return whole if abs(whole) <= _WHOLE_MAX else None


def _check_length(name: str, value: Any) -> int:
    whole = _whole(value)
    if whole is None or whole < 2:
        raise InvalidInput(f"{name}={_plain(value)!r} must be a whole number of tokens >= 2")
    return whole


class RopeFrequencies(NamedTuple):
    """What a frequency strategy returns.

    inv_freq: ``[d/2]`` float32, angular frequency θ_i of rotary pair i [radians per token].
    attention_factor: multiplies cos and sin, so attention logits scale by its square.
    """

    inv_freq: torch.Tensor
    attention_factor: float


class UnknownStrategyError(UnknownNameError, KeyError):
    """No strategy of that name (the message lists the known ones)."""


@dataclass(frozen=True)
class Param:
    """One parameter of a strategy.

    ``low``/``high`` bound the value (inclusive unless ``*_open``). ``auto`` names what
    ``Strategy.resolve`` fills in when the user leaves the parameter out, from the target length
    L and the training window T (see ``auto_value``): ``"scale"`` → max(1, L / T), ``"length"`` →
    L, ``"half_train"`` → T // 2. Without a length (``Strategy.validate``) the ``default``
    applies, and a parameter without one is required. ``log``: the parameter's natural scale is
    logarithmic (a ratio, a base, a length in tokens), so a parameter search samples it uniformly
    in log(value) (``ropescale_eval.search.space``); it changes no check. A ``kind=str``
    parameter takes one of its ``choices`` (names: never searched).
    """

    name: str
    default: Any = _REQUIRED
    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    auto: AutoKind | None = None
    help: str = ""
    log: bool = False
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.auto is not None and self.auto not in AUTO_KINDS:
            raise TypeError(f"parameter {self.name}: auto={self.auto!r}; choose one of {', '.join(AUTO_KINDS)}")
        if (self.kind is str) != bool(self.choices):
            raise TypeError(f"parameter {self.name}: a str parameter names its choices, and only it")

    @property
    def required(self) -> bool:
        """Whether the parameter has no default (a value, or an ``auto`` fill from the length, is needed)."""
        return self.default is _REQUIRED

    @property
    def auto_text(self) -> str | None:
        """What ``Strategy.resolve`` fills in, as a formula of L and T (``"max(1, L / T)"``,
        ``"L"``, ``"floor(T / 2)"``; L the target length, T the training window [tokens]), or
        None for a parameter that is never filled automatically."""
        return None if self.auto is None else _AUTO_TEXT[self.auto]

    def range_text(self) -> str:
        """The values the parameter takes, in words.

        Returns:
            ``"one of a, b"``, ``">= 1 and <= 64"`` or ``"any value"``.
        """
        if self.choices:
            return "one of " + ", ".join(self.choices)
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts) or "any value"

    def check(self, strategy: str, value: Any) -> Any:
        """A value of this parameter, checked.

        Numbers may be Python's or numpy's (``numpy.int64(16)``, ``numpy.float32(2)``); booleans
        are never numbers. An ``int`` parameter takes a whole number, also written as a float
        with an integral value (16.0: what YAML, JSON and float-valued searches write), and
        refuses 16.5. NaN and ±inf are refused everywhere.

        Args:
            strategy: the strategy's name, for the message.
            value: the value given.

        Returns:
            The value as a plain Python value (int, float, bool, str or list of floats).

        Raises:
            ropescale.errors.InvalidInput: the value is refused (one line naming the strategy, the
                parameter, the value and the allowed range).
        """
        shown = repr(_plain(value))
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        where = f"{strategy}: parameter {self.name}={shown}"
        if self.kind is bool:
            if not _is_bool(value):
                raise InvalidInput(f"{where} must be true or false")
            return bool(value)
        if self.kind is str:  # one of a few names
            if not isinstance(value, str) or value not in self.choices:
                raise InvalidInput(f"{where} is not a choice; allowed: {self.range_text()}")
            return value
        if self.kind is list:  # a list of numbers, each within the range
            if isinstance(value, np.ndarray) and value.ndim == 1:
                value = list(value)
            if not isinstance(value, (list, tuple)) or not value:
                raise InvalidInput(f"{where} must be a non-empty list of numbers")
            item = Param(self.name, kind=float, low=self.low, high=self.high,
                         low_open=self.low_open, high_open=self.high_open)
            return [item.check(strategy, v) for v in value]
        allowed = f"allowed: {self.range_text()}"
        what = "a whole number" if self.kind is int else "a number"
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise InvalidInput(f"{where} must be {what} ({self.kind.__name__}); {allowed}")
        if self.kind is int:
            number = _whole(value)
            if number is None:
                if isinstance(value, numbers.Integral) or (math.isfinite(float(value)) and float(value).is_integer()):
                    raise InvalidInput(f"{where} is too large: whole numbers must be at most 2^53; {allowed}")
                finite = math.isfinite(float(value))
                raise InvalidInput(f"{where} must be {'a whole' if finite else 'a finite whole'} number; {allowed}")
        else:
            try:
                number = float(value)
            except OverflowError:  # a Python int beyond float range
                number = math.inf
            if not math.isfinite(number):
                raise InvalidInput(f"{where} must be a finite number; {allowed}")
        too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        too_high = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if too_low or too_high:
            raise InvalidInput(f"{where} is out of range; {allowed}")
        return number


@dataclass(frozen=True)
class Strategy:
    """A registered strategy. ``kind`` is ``"frequency"`` (returns ``RopeFrequencies``) or
    ``"attention"`` (returns a ``RelativeRule`` applied inside attention); ``export`` writes it
    as transformers ``rope_parameters`` (see ``Exporter``), None when transformers has no
    equivalent. ``keeps_model``: the strategy is the model's own rotation as it was loaded
    (``native``): ``patch`` leaves the rotary modules, their dynamic updates and the attention's
    own scales as they are, the export writes the model's own rope parameters, and a saved
    patched folder is taken as plain transformers serves it (``load_model(..., served=True)``)."""

    name: str
    fn: Callable[..., RopeFrequencies]
    params: tuple[Param, ...]
    source: str
    kind: StrategyKind = "frequency"
    check: Callable[[dict], None] | None = None
    needs: tuple[str, ...] = field(default=())
    export: Exporter | None = None
    softmax: Callable[[dict], float] | None = None  # validated params → softmax-scale multiplier (1: none)
    origin: str = ""  # where it was registered, when not by ropescale: "plugin 'x' (pkg.mod)" or "module pkg.mod"
    keeps_model: bool = False  # it keeps the model as it is (native): its own parameters, temperature
    # how a dynamic strategy is served by engines with one static rotation: "freeze" (a static form at a
    # chosen length: dynamic NTK), "sets" (static sets an engine picks from by the served length: LongRoPE),
    # None (no static form: refused)
    served: DynamicServing | None = None
    freeze: Freezer | None = None  # served="freeze": its static form at a length (``Freezer``)

    @property
    def label(self) -> str:
        """How messages name it: ``strategy 'yarn'``, with its origin when ropescale did not register it."""
        return f"strategy {self.name!r}" + (f" ({self.origin})" if self.origin else "")

    def softmax_scale(self, params: dict[str, Any]) -> float:
        """The factor the strategy multiplies attention's softmax scale by.

        Args:
            params: the strategy's checked parameters.

        Returns:
            The factor (DeepSeek's YaRN ``mscale_all_dim``: its square); 1.0 for every strategy
            without one.
        """
        return 1.0 if self.softmax is None else float(self.softmax(params))

    @property
    def dynamic(self) -> bool:
        """True when the frequencies depend on the current sequence length."""
        return "seq_len" in self.needs

    @property
    def summary(self) -> str:
        """The first paragraph of the strategy function's docstring, as one line (tables, ``ropescale list``)."""
        first = (inspect.getdoc(self.fn) or "").split("\n\n")[0]
        return " ".join(first.replace("``", "").split())

    @property
    def scale_param(self) -> str | None:
        """The name of its scale factor s (L / T: the parameter whose ``auto`` is ``"scale"``; ``factor`` for the
        frequency rules, ``scale`` for DCA), or None: callers read the role, never a parameter's name."""
        return next((p.name for p in self.params if p.auto == "scale"), None)

    def frozen(self, params: dict[str, Any], *, at: int, train_length: int) -> tuple[Strategy, dict]:
        """The static strategy that rotates as this dynamic one does at sequence length F = ``at``.

        Args:
            params: this strategy's checked parameters.
            at: F, the length it is frozen at [tokens].
            train_length: T, the model's training window [tokens].

        Returns:
            ``(strategy, params)``: the static strategy and its checked parameters, from the ``freeze`` hook.

        Raises:
            ropescale.errors.InvalidInput: the strategy has no ``freeze`` hook (it is static, picks its sets from
                the length, or has no static form), or the hook's answer is not a valid static strategy.
        """
        if self.freeze is None:
            raise InvalidInput(f"{self.label} has no static form to freeze at a length")
        name, frozen = self.freeze(dict(params), int(at), int(train_length))
        static = get_strategy(name)
        if static.dynamic:
            raise InvalidInput(f"{self.label}'s freeze hook returned the dynamic strategy {name!r}; expected a "
                               "static one")
        return static, static.validate(frozen)

    def exact_below(self, params: dict[str, Any], *, train_length: int, context: dict[str, Any] | None = None
                    ) -> int | None:
        """The distance below which this strategy is vanilla RoPE, read from the rule it builds.

        For a relative-position rule whose first region is the plain band 0 ≤ i − j < w (``RelativeRule.window``)
        with attention factor 1, no softmax factor and no extra prefill regions, every pair closer than w is
        rotated by i − j exactly as vanilla: a sequence of L ≤ w tokens is vanilla RoPE. None where that is not
        certain (a frequency strategy, a rule that needs more than T to be built, chunked regions, a factor).

        Args:
            params: the strategy's checked parameters (``resolve``).
            train_length: T, the model's training window [tokens].
            context: the model's context arguments where known (``OPTIONAL_CONTEXT`` ones are read).

        Returns:
            w [tokens], or None.
        """
        if self.kind != "attention" or self.softmax_scale(params) != 1.0:
            return None
        if set(self.needs) - set(OPTIONAL_CONTEXT) - {"original_max_position_embeddings"}:
            return None
        given = {k: v for k, v in (context or {}).items() if k in OPTIONAL_CONTEXT}
        try:
            rule = self.compute({**given, "original_max_position_embeddings": train_length}, params)
        except InvalidInput:  # the rule's own refusal is the patch's to say; no band is certain
            return None
        if rule.attention_factor != 1.0 or rule.prefill_extra:
            return None
        return rule.window

    def param(self, name: str) -> Param:
        """One of the strategy's parameters.

        Args:
            name: the parameter's name.

        Returns:
            Its ``Param``.

        Raises:
            StopIteration: the strategy has no such parameter.
        """
        return next(p for p in self.params if p.name == name)

    def validate(self, params: dict[str, Any], *, partial: bool = False) -> dict:
        """Checked parameters with defaults filled in (no target length: ``resolve`` for that).

        Args:
            params: the parameters given, by name.
            partial: accept required ``auto`` parameters left out — a length fills them later
                (``resolve``) — and leave them out of the result.

        Returns:
            The checked parameters, defaults filled in.

        Raises:
            ropescale.errors.InvalidInput: an unknown, missing or out-of-range parameter (a
                ``ValueError``; one line naming it).
        """
        return self._checked(params, fill={}, partial=partial)

    def resolve(self, params: dict[str, Any], *, length: int, train_length: int,
                context: dict[str, Any] | None = None) -> dict:
        """Checked parameters for a run at a target length on a model with a training window.

        Those the user gave, ``auto`` ones left out filled by ``auto_value`` (e.g. ``factor`` =
        max(1, L / T)), then defaults. The one auto-fill rule every sweep, inspection and training
        run uses, and the strategy's full validation for that run: an attention rule is also built
        once with T, so the checks its function makes with the window (DCA's local_window <
        chunk_size and STRING's W < S with their T-derived defaults, Leaky ReRoPE's room below T)
        fail here, before any work — call it for every (strategy, length) before the first one runs.

        Args:
            params: the parameters given, by name.
            length: L, the target length [tokens].
            train_length: T, the model's training window [tokens].
            context: the model's context arguments where they are known (``rope_context``; its
                ``dual_chunk_attention_config`` gives DCA's defaults, as the patch will); None: none.

        Returns:
            The checked parameters, every one filled.

        Raises:
            ropescale.errors.InvalidInput: bad parameters, or lengths that are not whole numbers >= 2
                (a ``ValueError``; one line).
        """
        length = _check_length("length", length)
        train_length = _check_length("train_length", train_length)
        fill = {p.name: auto_value(p.auto, length=length, train_length=train_length)
                for p in self.params if p.auto}
        out = self._checked(params, fill=fill, partial=False)
        if self.kind == "attention" and set(self.needs) - set(OPTIONAL_CONTEXT) <= {"original_max_position_embeddings"}:
            given = {k: v for k, v in (context or {}).items() if k in OPTIONAL_CONTEXT}
            self.compute({**given, "original_max_position_embeddings": train_length}, out)  # a rule: no tensors built
        return out

    def _checked(self, params: dict[str, Any], *, fill: dict[str, Any], partial: bool) -> dict:
        if not isinstance(params, dict):
            raise InvalidInput(f"{self.name}: parameters must be a mapping of name to value, got {params!r}")
        known = {p.name for p in self.params}
        for key in params:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                raise InvalidInput(
                    f"{self.name} has no parameter {key!r}; its parameters: "
                    f"{', '.join(sorted(known)) or 'none'}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
        out, deferred = {}, False
        for p in self.params:
            if p.name in params and params[p.name] is not None:
                out[p.name] = p.check(self.name, params[p.name])
            elif p.name in fill:
                out[p.name] = p.check(self.name, fill[p.name])
            elif not p.required:
                out[p.name] = p.default
            elif partial and p.auto:
                deferred = True  # filled from the length later
            else:
                auto = f" (a sweep sets it to {p.auto_text} from its length)" if p.auto else ""
                raise InvalidInput(f"{self.name}: parameter {p.name} is required{auto}; allowed: {p.range_text()}")
        if self.check:
            try:
                self.check(out)
            except KeyError:
                if not deferred:
                    raise  # a check reading a parameter that will be filled later runs in resolve
        return out

    def compute(self, context: dict[str, Any], params: dict[str, Any]) -> RopeFrequencies:
        """Call the strategy's function with the context arguments it names and its parameters.

        Args:
            context: the model's context (``dim``, ``rope_theta``, ``original_max_position_embeddings``,
                ``seq_len``, ...); an ``OPTIONAL_CONTEXT`` argument it lacks is passed as None.
            params: validated parameters (``validate`` / ``resolve``).

        Returns:
            A frequency strategy's ``RopeFrequencies(inv_freq [d/2], attention_factor: float)``,
            checked (``check_frequencies``); a relative-position rule's ``RelativeRule``.

        Raises:
            ropescale.errors.InvalidInput: a context argument the model did not provide, or a result
                that is not valid frequencies (one line).
        """
        missing = [k for k in self.needs if context.get(k) is None and k not in OPTIONAL_CONTEXT]
        if missing:
            raise InvalidInput(f"{self.name} needs {', '.join(missing)}, which the model did not provide")
        out = self.fn(**{k: context.get(k) for k in self.needs}, **params)
        return check_frequencies(self.label, out, context.get("dim")) if self.kind == "frequency" else out


def _number(value: Any) -> float | None:
    """A real number (Python's, numpy's, a one-element tensor) as a float; None for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def check_frequencies(who: str, out: Any, dim: int | None) -> RopeFrequencies:
    """``out`` as ``RopeFrequencies`` when it is what a frequency strategy returns: ``(inv_freq,
    attention_factor)`` with ``inv_freq`` a floating torch tensor of shape ``[dim/2]`` (any 1-D
    shape when ``dim`` is None), finite and ≥ 0 [radians per token], and ``attention_factor`` a
    finite number > 0. Raises ``InvalidInput`` in one line naming ``who`` (the strategy, and its
    plugin): a NaN recorded PPL nan, a shape [d] failed deep inside attention before."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise InvalidInput(f"{who} returned {type(out).__name__}, not RopeFrequencies(inv_freq, attention_factor)")
    inv_freq, factor = out
    want = f"[{dim // 2}] (d/2 for rotary dim d = {dim})" if dim else "[d/2]"
    if not isinstance(inv_freq, torch.Tensor):
        raise InvalidInput(f"{who} returned inv_freq as a {type(inv_freq).__name__}; a frequency strategy returns a "
                           f"torch tensor of shape {want}")
    if inv_freq.dim() != 1 or (dim and inv_freq.shape[0] != dim // 2):
        raise InvalidInput(f"{who} returned inv_freq of shape {list(inv_freq.shape)}; expected {want}")
    if not inv_freq.is_floating_point():
        raise InvalidInput(f"{who} returned inv_freq of dtype {inv_freq.dtype}; expected a floating dtype (float32)")
    bad = (~torch.isfinite(inv_freq)) | (inv_freq < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidInput(f"{who} returned inv_freq[{i}] = {float(inv_freq[i])}; frequencies are finite and >= 0 "
                           "[radians per token]")
    number = _number(factor)
    if number is None or not (math.isfinite(number) and number > 0):
        shown = repr(factor) if number is None else repr(number)
        raise InvalidInput(f"{who} returned attention_factor = {shown[:40]}; expected a finite number > 0 (it "
                           "multiplies cos and sin)")
    return RopeFrequencies(inv_freq, number)


# every module of ropescale.strategies but this one registers strategies (imported when the package is),
# and installed plugins of the entry-point group ropescale.strategies do on the first lookup
REGISTRY: Registry[Strategy] = Registry("strategy", "strategies", UnknownStrategyError, package="ropescale.strategies",
                                        skip=("registry",), plugins="ropescale.strategies")


def register(name: str, *, params: tuple[Param, ...] = (), source: str,
             kind: StrategyKind = "frequency", check: Callable[[dict], None] | None = None,
             export: Exporter | None = None, softmax: Callable[[dict], float] | None = None,
             keeps_model: bool = False, served: DynamicServing | None = None, freeze: Freezer | None = None
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a strategy function to the registry (``REGISTRY``) under ``name``.

    Args:
        name: the registry name (``patch(model, name)``, ``--strategy name``).
        params: the strategy's parameters (``Param``: name, default, bounds, help), validated on every call.
        source: the paper (arXiv id) and reference implementation it follows.
        kind: ``"frequency"`` (computes ``inv_freq``) or ``"attention"`` (a relative-position rule).
        check: a validator of the resolved parameters (raises ``InvalidInput``), beside the ``Param`` bounds.
        export: its transformers ``rope_parameters`` writer (``Exporter``), where transformers can express it.
        softmax: validated params → the factor it multiplies attention's softmax scale by, where it has one.
        keeps_model: the strategy is the model's own rotation, left untouched (``Strategy.keeps_model``).
        served: how engines with one static rotation serve a dynamic strategy (``Strategy.served``).
        freeze: for ``served="freeze"``, its static form at a length (``Freezer``; required there, refused elsewhere).

    Returns:
        The decorator; the function comes back unchanged, registered.

    Raises:
        TypeError: an unknown ``kind`` or ``served``, a signature that does not match ``params``, or a parameter
            named as a patch option or strategy-entry key (``RESERVED_PARAMS``), ``served="freeze"``
            without a ``freeze`` hook or a hook without it.
    """
    if kind not in STRATEGY_KINDS:
        raise TypeError(f"{name}: kind={kind!r}; choose one of {', '.join(STRATEGY_KINDS)}")
    if served is not None and served not in DYNAMIC_SERVING:
        raise TypeError(f"{name}: served={served!r}; choose one of {', '.join(DYNAMIC_SERVING)} or None")
    if (served == "freeze") != (freeze is not None):
        raise TypeError(f"{name}: served='freeze' and a freeze hook go together (served={served!r}, "
                        f"freeze={'given' if freeze else 'None'})")

    def deco(fn: Callable[..., RopeFrequencies]) -> Callable[..., RopeFrequencies]:
        sig = inspect.signature(fn).parameters
        needs = tuple(a for a in CONTEXT_ARGS if a in sig)
        declared = {p.name for p in params}
        own = set(sig) - set(needs)
        if own != declared:
            raise TypeError(f"{name}: signature parameters {sorted(own)} != declared {sorted(declared)}")
        taken = sorted(declared & set(RESERVED_PARAMS))
        if taken:  # patch() would hand it to the patch, a config to the entry: never to the strategy
            raise TypeError(f"{name}: parameter {taken[0]!r} is the name of a patch option or strategy-entry key; "
                            "name it otherwise")
        for p in params:  # a default is what runs when the parameter is left out: within its own range
            if not p.required and p.default is not None:
                try:
                    p.check(name, p.default)
                except InvalidInput as e:
                    raise TypeError(f"{e} (its default)") from None
        module = getattr(fn, "__module__", "") or ""
        origin = "" if module.startswith("ropescale.") else (loading_plugin(module) or f"module {module}")
        REGISTRY.add(name, Strategy(name, fn, params, source, kind, check, needs, export, softmax, origin,
                                    keeps_model, served, freeze))
        return fn

    return deco


def strategy_names() -> list[str]:
    """The registered strategies' names.

    Returns:
        Every name ``get_strategy`` accepts, sorted (plugins' included).
    """
    return REGISTRY.names()


def get_strategy(name: str) -> Strategy:
    """A registered strategy by its name.

    Args:
        name: the strategy's registry name (``yarn``, ``ntk`` … — ``strategy_names()``; plugins' included).

    Returns:
        The ``Strategy``: its function, parameters (``Param``), kind and source.

    Raises:
        UnknownStrategyError: no strategy of that name (one line: a close match and the known names).
    """
    return REGISTRY.lookup(name)

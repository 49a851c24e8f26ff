"""What a patch changed, and how to put it back: ``PatchHandle`` and the model's active patch.

``ropescale.patching.patch`` builds a handle (``ropescale.patching.frequency`` for frequency strategies,
``ropescale.patching.attention`` for relative-position rules), each step recording what it changed through
``keep``, ``undo_with`` and ``hook``; ``unpatch`` undoes it in reverse, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from ropescale.rotary.frequencies import FrequencyPatch
from ropescale.rotary.modules import layer_rope_parameters_of, site_context
from ropescale.rotary.probe import layers_without_attention
from ropescale.rotary.sites import LayerRope, RotarySite
from ropescale.strategies import Strategy, get_strategy
from ropescale.temperature import NATIVE, Temperature

__all__ = ["PatchHandle", "current_patch"]

_HANDLE_ATTR = "_ropescale_patch"


@dataclass
class PatchHandle:
    """What ``patch`` changed; ``unpatch()`` (or leaving the ``with`` block) restores it.

    ``layers``: what each attention layer does with positions, read from the model
    (``ropescale.rotary.probe.probe_layers``; None when its attention is not observable); ``report()``
    says per layer what the patch did there."""

    model: nn.Module
    strategy: str
    params: dict[str, Any]
    context: dict[str, Any]
    layer_types: list[str | None] = field(default_factory=list)
    contexts: dict[str | None, dict[str, Any]] = field(default_factory=dict)  # per patched layer type
    options: dict[str, Any] = field(default_factory=dict)
    layers: list[LayerRope] | None = None
    sites: dict[RotarySite, dict[str, Any]] = field(default_factory=dict)  # patched frequency sets → context
    temperature: Temperature | None = None  # the query temperature on top (log-n or another rule)
    own_temperature: dict[bool, Temperature | None] = field(default_factory=dict)  # the model's, by "rotates"
    _frequencies: list[FrequencyPatch] = field(default_factory=list, repr=False)
    _hooks: list = field(default_factory=list, repr=False)
    _restore: list = field(default_factory=list, repr=False)
    _active: bool = field(default=False, repr=False)
    # patch() again with the same arguments (``suspended``), set by ``ropescale.patching.patch``
    repatch: Callable[[], PatchHandle] | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """Whether this patch is the model's now (False after ``unpatch``)."""
        return self._active

    @property
    def strategy_obj(self) -> Strategy:
        """The registered ``Strategy`` this patch applies."""
        return get_strategy(self.strategy)

    def unpatch(self) -> None:
        """Undo the patch in place: the hooks removed, every buffer, function and config value restored
        bit for bit. A second call does nothing.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        while self._restore:
            self._restore.pop()()
        for f in reversed(self._frequencies):
            f.restore()
        self._frequencies.clear()
        self._active = False
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)

    def keep(self, frequencies: FrequencyPatch) -> None:
        """Apply a rotary module's new frequencies; ``unpatch`` puts the module's own back.

        Args:
            frequencies: one rotary module's patch (``ropescale.rotary.frequencies.FrequencyPatch``).
        """
        frequencies.apply()
        self._frequencies.append(frequencies)

    @property
    def frequency_patches(self) -> tuple[FrequencyPatch, ...]:
        """The rotary modules' frequency patches this patch applied, in order."""
        return tuple(self._frequencies)

    def undo_with(self, restores: Iterable[Callable[[], None]]) -> None:
        """Functions that undo a change of this patch; ``unpatch`` calls them last first.

        Args:
            restores: functions of no argument, each undoing one change.
        """
        self._restore.extend(restores)

    def hook(self, hooks: Iterable[Any]) -> None:
        """Module hooks this patch registered; ``unpatch`` removes them first.

        Args:
            hooks: the handles ``register_*_hook`` returned (each with ``remove()``).
        """
        self._hooks.extend(hooks)

    def activate(self) -> None:
        """Every change made: this is the model's active patch (``current_patch``) from now on."""
        self._active = True
        setattr(self.model, _HANDLE_ATTR, self)

    def record_temperature(self) -> None:
        """Record the query temperature in ``options``: ``logn: true`` (the long-standing record), or
        ``temperature`` for another rule."""
        rule = self.temperature
        self.options |= {"logn": True} if rule.kind == "logn" and not rule.params else {"temperature": rule.spec()}

    @contextmanager
    def suspended(self) -> Iterator[nn.Module]:
        """Inside the block, the model as it was before the patch (bit for bit, as after ``unpatch``);
        on leaving it, the same patch again — this handle stays the model's active patch. What
        KL(P_unpatched ‖ P_patched) compares (``ropescale.runs.scoring``) without a second copy of
        the weights. A training length set with ``train_at`` is set again.

        Yields:
            The model, unpatched.

        Raises:
            RuntimeError: the patch has been undone (``unpatch``).
        """
        if not self.active:
            raise RuntimeError("this patch has been undone; patch the model again")
        training = [f.target_length for f in self._frequencies]
        self.unpatch()
        try:
            yield self.model
        finally:
            again = self.repatch()
            for f in fields(self):  # this object takes the new patch's state: callers hold this one
                setattr(self, f.name, getattr(again, f.name))
            setattr(self.model, _HANDLE_ATTR, self)
            for f, length in zip(self._frequencies, training):
                f.set_target_length(length)

    def train_at(self, length: int | None) -> None:
        """Train toward a target length: in training mode, dynamic strategies use L = max(``length``,
        max(position_ids) + 1) (``FrequencyPatch.set_target_length``). Static strategies and
        relative-position rules do not depend on L: no effect.

        Args:
            length: the target length L [tokens]; None undoes it.

        Raises:
            ropescale.errors.InvalidInput: a length that is not a whole number >= 1.
            RuntimeError: the patch has been undone (``unpatch``).
        """
        if not self.active:
            raise RuntimeError("this patch has been undone; patch the model again")
        for f in self._frequencies:
            f.set_target_length(length)

    def report(self) -> list[dict[str, Any]]:
        """What the patch does, per decoder layer.

        Returns:
            One row per decoder layer, in layer order: ``layer`` (cache index), ``module``, ``rope``
            (``"rope"``, ``"none"``, ``"unknown"``), ``frequencies`` (the rotary module and layer type it
            uses), ``rope_type`` (as the model's config has it), ``rope_theta``, ``rotary_dim`` [channels],
            ``channels`` ([start, end)), ``layout`` (``halves``/``interleaved``, ``mirrored`` for sign −1),
            ``original_max_position_embeddings`` [tokens], ``applied`` (the strategy, ``kept`` for an
            unpatched layer type, ``no RoPE, untouched``) and ``temperature`` (the model's own query
            temperature — kept, removed or replaced by a rule of ropescale's — or the rule added; "" for
            none). A layer without attention (linear attention, Mamba:
            ``layer_rope.layers_without_attention``) is a ``"none"`` row with its ``layer_type`` (the
            config's, e.g. ``linear_attention``) and no temperature. Empty when the model's attention could
            not be observed.
        """
        rows = self._attention_rows()
        for index, name, layer_type in layers_without_attention(self.model, self.layers or []):
            rows.append({"layer": index, "module": name, "rope": "none", "layer_type": layer_type,
                         "applied": f"no RoPE ({layer_type}), untouched" if layer_type else "no RoPE, untouched",
                         "temperature": ""})
        return sorted(rows, key=lambda r: r["layer"])

    def _attention_rows(self) -> list[dict[str, Any]]:
        rows = []
        for info in self.layers or []:
            row: dict[str, Any] = {"layer": info.index, "module": info.name, "rope": info.kind}
            if info.kind == "none":
                row["applied"] = "no RoPE, untouched"
            elif info.kind == "unknown":
                row["applied"] = "unknown rotation: refused for relative-position rules"
            else:
                ctx = self.sites.get(info.site) or site_context(self.model, info.site)
                # a relative-position rule is one rule from the primary layer type's context; each layer's θ is its own
                own = site_context(self.model, info.site) if self.strategy_obj.kind == "attention" else ctx
                rp = layer_rope_parameters_of(self.model, info.site)
                row |= {"frequencies": str(info.site), "rope_type": rp.get("rope_type", "default"),
                        "rope_theta": own.get("rope_theta"), "rotary_dim": info.dim,
                        "channels": [info.start, info.start + info.dim],
                        "layout": ("interleaved" if info.interleaved else "halves")
                        + (", mirrored" if info.sign < 0 else ""),
                        "original_max_position_embeddings": ctx.get("original_max_position_embeddings"),
                        "applied": self.strategy if info.site in self.sites or self.strategy_obj.kind == "attention"
                        else "kept"}
            row["temperature"] = self._temperature_of(info)
            rows.append(row)
        return rows

    def _temperature_of(self, info: LayerRope) -> str:
        """The report's ``temperature``: the model's own query temperature for this layer (``temperature.shipped``)
        and what the patch does with it — ``kept``, ``removed``, ``replaced by`` a rule of ropescale's — or the
        rule the patch adds; "" when the layer has none."""
        own = self.own_temperature.get(info.kind != "none")
        ours = self.temperature.spec() if self.temperature is not None else None
        if own is None:
            return f"{ours} (added)" if ours else ""
        removed = (own.kind == "beta" and not self.strategy_obj.keeps_model
                   and self.options.get("temperature") != NATIVE)
        if not removed:
            return f"{own.spec()} (model's, kept)" + (f" + {ours} (added)" if ours else "")
        return f"{own.spec()} (model's) replaced by {ours}" if ours else f"{own.spec()} (model's) removed"

    def to_dict(self) -> dict[str, Any]:
        """The patch as a record.

        Returns:
            A JSON-ready mapping: strategy, parameters, T, layer types and options (how
            ``ropescale.save_patched`` stores it).
        """
        windows = {lt: ctx.get("original_max_position_embeddings") for lt, ctx in self.contexts.items()}
        # T per layer type where they differ (a saved patch re-applied with one T would give every type the first's)
        train = (windows if len(set(windows.values())) > 1 and None not in windows
                 else self.context["original_max_position_embeddings"])
        out = {"strategy": self.strategy, "params": self.params, "original_max_position_embeddings": train}
        if self.layer_types != [None]:
            out["layer_types"] = self.layer_types
        return out | self.options

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def current_patch(model: nn.Module) -> PatchHandle | None:
    """The active patch of a model.

    Args:
        model: a loaded HF model.

    Returns:
        Its active ``PatchHandle``, or None when it is not patched.
    """
    return getattr(model, _HANDLE_ATTR, None)

"""Frequency patches: a rotary module's own ``inv_freq`` buffers and ``attention_scaling`` swapped in place.

ropescale never rebuilds a rotary module's output: a frequency strategy swaps the module's own buffers
(``FrequencyPatch``) and the module goes on producing its own format (cos/sin in halves or interleaved
layout, half-width tables, complex ``freqs_cis``, M-RoPE sections), so every contract the model has holds
by construction and code that reads the module's attributes keeps working. Pairs whose frequency the model
sets to zero (proportional RoPE) stay zero under every strategy. Dynamic strategies recompute per forward;
under a KV cache ``ropescale.rotary.cache`` keeps the cached keys consistent.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.errors import InvalidInput
from ropescale.rotary.cache import CacheWatch, rerotate_cache
from ropescale.rotary.modules import attention_scaling_name, attention_scaling_of, inv_freq_name
from ropescale.rotary.quirks import apply_quirk_overrides
from ropescale.rotary.sites import LayerRope
from ropescale.strategies import Strategy

__all__ = ["ABSENT", "FrequencyEntry", "FrequencyPatch", "keep_zero", "strategy_entry"]

ABSENT = object()  # an attribute the module did not have (restored by deleting it)


@dataclass
class FrequencyEntry:
    """Frequencies of one layer type: from a strategy (maybe dynamic) or kept from the model.

    ``zero``: ``[d/2]`` bool, the pairs the model itself leaves unrotated (proportional RoPE's
    zero frequencies); they stay zero whatever the strategy computes."""

    inv_freq: torch.Tensor
    attention_scaling: float
    strategy: Strategy | None = None
    params: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    cached_len: int | None = None
    block: int = 1
    zero: torch.Tensor | None = None
    _memo: tuple | None = None  # (length, result): would_change and update ask for the same length

    @property
    def dynamic(self) -> bool:
        """Whether this frequency set depends on the current sequence length (dynamic NTK)."""
        return self.strategy is not None and self.strategy.dynamic

    def compute(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """``(inv_freq [d/2], attention_scaling)`` of the strategy at L = ``seq_len`` rounded up to whole
        blocks, on the buffer's device; the model's zero pairs kept zero."""
        length = -(-seq_len // self.block) * self.block  # rounded up to whole blocks
        if self._memo is None or self._memo[0] != length:
            inv_freq, scaling = self.strategy.compute({**self.context, "seq_len": length}, self.params)
            self._memo = (length, (keep_zero(inv_freq, self.zero), scaling))
        inv_freq, scaling = self._memo[1]
        return inv_freq.to(self.inv_freq.device), scaling  # wherever the buffer lives now

    def would_change(self, seq_len: int) -> bool:
        """Whether a forward of ``seq_len`` tokens would change this set's ``inv_freq`` or scaling.

        Args:
            seq_len: the sequence length [tokens].

        Returns:
            True for a dynamic set whose frequencies at ``seq_len`` differ from the cached ones.
        """
        if not self.dynamic or seq_len == self.cached_len:
            return False
        inv_freq, scaling = self.compute(seq_len)
        return scaling != self.attention_scaling or not torch.equal(inv_freq, self.inv_freq)

    def update(self, seq_len: int) -> tuple[torch.Tensor, float] | None:
        """Recompute for ``seq_len``; the previous ``(inv_freq, attention_scaling)`` if they changed."""
        if seq_len == self.cached_len:
            return None
        old = (self.inv_freq, self.attention_scaling)
        self.inv_freq, self.attention_scaling = self.compute(seq_len)
        self.cached_len = seq_len
        changed = self.attention_scaling != old[1] or not torch.equal(self.inv_freq, old[0])
        return old if changed else None


def keep_zero(inv_freq: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``inv_freq`` ``[d/2]`` with the pairs ``zero`` marks set to 0 (the model's unrotated pairs)."""
    if zero is None or not bool(zero.any()):
        return inv_freq
    return torch.where(zero.to(inv_freq.device), torch.zeros_like(inv_freq), inv_freq)


def strategy_entry(module: nn.Module, layer_type: str | None, strat: Strategy, params: dict[str, Any],
                   context: dict[str, Any], dynamic_block: int) -> FrequencyEntry:
    """The frequencies ``strat`` gives one layer type of a rotary module: computed at L = T (``context``'s
    ``original_max_position_embeddings``) for a dynamic strategy (recomputed per forward after), once for a
    static one; the pairs the module leaves unrotated (p-RoPE's zero frequencies) stay zero. ``native`` sees
    the module's own ``inv_freq`` and ``attention_scaling`` as shipped (``model_inv_freq``,
    ``model_attention_scaling``)."""
    buffer = getattr(module, inv_freq_name(layer_type))
    own_scaling = attention_scaling_of(module, layer_type)
    start = {**context, "seq_len": context["original_max_position_embeddings"],
             "model_inv_freq": buffer.detach(), "model_attention_scaling": own_scaling}
    zero = buffer.detach() == 0  # [d/2] pairs the model leaves unrotated (p-RoPE)
    entry = FrequencyEntry(buffer, own_scaling, strat, params, context,
                           start["seq_len"] if strat.dynamic else None, dynamic_block, zero)
    if strat.dynamic:
        entry.inv_freq, entry.attention_scaling = entry.compute(start["seq_len"] or 1)
    else:
        inv_freq, scaling = strat.compute(start, params)
        entry.inv_freq, entry.attention_scaling = keep_zero(inv_freq, zero), scaling
    return entry


def _call_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, str | None]:
    """``(position_ids, layer_type)`` of a rotary module's call ``forward(x, position_ids, layer_type=None)``."""
    position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
    return position_ids, layer_type


class FrequencyPatch:
    """One rotary module's frequencies while a frequency strategy is on: its ``inv_freq`` and
    ``attention_scaling`` (per layer type where it has several) swapped in place by ``apply`` and
    put back, the very tensors, by ``restore``; the module's own ``rope_type`` reads ``default``
    meanwhile, so transformers' ``dynamic_rope_update`` does not overwrite them.

    Dynamic strategies recompute the frequencies from L = max(position_ids) + 1 (rounded up to a
    multiple of ``dynamic_block``) in a forward pre-hook on the module: one scale for the whole
    model forward, as transformers' ``dynamic`` type does; each layer type's entry is brought up to
    L when it is asked for, whatever order the base model asks in. Static strategies never read
    ``position_ids``' values (no host-device sync). In training mode with ``target_length`` set
    (``set_target_length``; ``PatchHandle.train_at``), dynamic strategies use L =
    max(``target_length``, max(position_ids) + 1) — the target length being trained for, whatever
    the positions of one batch reach (PoSE's skipped positions reach it only sometimes). Under a KV
    cache (``ropescale.rotary.cache``), ``dynamic_cache`` says what happens to cached tokens when the
    frequencies change: ``"recompute"`` re-runs the prefix (exact), ``"rerotate"`` re-rotates cached
    keys of the layers that use these frequencies (``cache_layers``: layer type → the layers' ``LayerRope``),
    exact in layer 0 only.
    """

    def __init__(self, module: nn.Module, entries: dict[str | None, FrequencyEntry], dynamic_cache: str = "recompute",
                 cache_layers: dict[str | None, list[LayerRope]] | None = None):
        self.module = module
        self.entries = entries
        self.dynamic_cache = dynamic_cache
        self.cache_layers = cache_layers or {}
        self.watch: CacheWatch | None = None
        self.target_length: int | None = None
        self._saved: list[tuple[str, Any, bool]] = []  # (name, original, was a buffer)
        self._hooks: list = []
        self._positions: torch.Tensor | None = None  # [b, s_cached] positions of cached keys (rerotate)
        self._forward_positions: torch.Tensor | None = None
        self._served: set[str | None] = set()
        self._seq_len: int | None = None
        self._cached_positions: torch.Tensor | None = None
        self._overrides: list = []  # the restores of the quirks rows applied to the module

    @property
    def dynamic(self) -> bool:
        """Whether any of the module's frequency sets is dynamic."""
        return any(e.dynamic for e in self.entries.values())

    def _set(self, layer_type: str | None, entry: FrequencyEntry) -> None:
        buf = self.module._buffers[inv_freq_name(layer_type)]
        self.module._buffers[inv_freq_name(layer_type)] = entry.inv_freq.to(device=buf.device, dtype=buf.dtype)
        setattr(self.module, attention_scaling_name(layer_type), entry.attention_scaling)

    def apply(self) -> None:
        """Swap the strategy's frequencies in (the originals are kept, to the tensor)."""
        m = self.module
        for lt in self.entries:
            self._saved.append((inv_freq_name(lt), m._buffers[inv_freq_name(lt)], True))
            self._saved.append((attention_scaling_name(lt), m.__dict__.get(attention_scaling_name(lt), ABSENT), False))
        if "rope_type" in m.__dict__ and self.entries:  # types kept as they are keep their own dynamic updates
            rt = m.__dict__["rope_type"]
            self._saved.append(("rope_type", rt, False))
            m.rope_type = {k: "default" if k in self.entries else v for k, v in rt.items()} \
                if isinstance(rt, dict) else "default"
        self._overrides = apply_quirk_overrides("frequencies", m, self.entries)  # a family's own (rotary.quirks)
        for lt, e in self.entries.items():
            self._set(lt, e)
        if self.dynamic:
            self._hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))

    def restore(self) -> None:
        """Put the module's own buffers and attributes back, moved to where the module lives now."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        while self._overrides:
            self._overrides.pop()()
        for name, value, is_buffer in reversed(self._saved):
            if is_buffer:
                now = self.module._buffers[name]
                self.module._buffers[name] = value.to(device=now.device) if value.device != now.device else value
            elif value is ABSENT:
                self.module.__dict__.pop(name, None)
            else:
                setattr(self.module, name, value)
        self._saved.clear()

    @contextlib.contextmanager
    def own(self):
        """The module's own ``inv_freq`` and ``attention_scaling`` meanwhile (its ``rope_type`` still reads
        ``default``), the strategy's put back after: what the model would compute, for a reader that must
        keep it (a sparse-attention indexer under a relative-position rule, ``ropescale.attention.indexers``)."""
        m, swapped = self.module, []
        for name, value, is_buffer in self._saved:
            if name == "rope_type":
                continue
            if is_buffer:
                now = m._buffers[name]
                swapped.append((name, now, True))
                m._buffers[name] = value.to(device=now.device)
            else:
                swapped.append((name, m.__dict__.get(name, ABSENT), False))
                if value is ABSENT:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
        try:
            yield
        finally:
            for name, value, is_buffer in reversed(swapped):
                if is_buffer:
                    m._buffers[name] = value
                elif value is ABSENT:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)

    def set_target_length(self, length: int | None) -> None:
        """Dynamic strategies' L in training mode: at least ``length`` [tokens]; None: from the
        positions only. Raises ``InvalidInput`` unless ``length`` is None or a whole number >= 1."""
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise InvalidInput(f"training length {length!r} must be a whole number of tokens >= 1 (or None)")
        self.target_length = length

    def use_watch(self, watch: CacheWatch) -> None:
        """Read the KV cache of each forward from ``watch`` (one ``ropescale.cache.CacheWatch`` per model)."""
        self.watch = watch

    @property
    def cache(self):
        """The KV cache watched for positions past the patched length (None: none watched)."""
        return self.watch.cache if self.watch is not None else None

    def would_change(self, seq_len: int) -> bool:
        """Whether a forward of ``seq_len`` tokens would change any of the module's frequency sets.

        Args:
            seq_len: the sequence length [tokens].

        Returns:
            True when one would change.
        """
        return any(e.would_change(seq_len) for e in self.entries.values())

    def _track(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Record positions of keys about to be cached; positions of those already cached."""
        cached = self.cache.get_seq_length() if self.cache is not None else 0
        if not cached or self._positions is None or self._positions.shape[0] != position_ids.shape[0]:
            self._positions = position_ids.detach()
            return None
        before = self._positions
        self._positions = torch.cat([before, position_ids.detach()], dim=-1)
        return before

    def _new_forward(self, position_ids: torch.Tensor, layer_type: str | None) -> bool:
        """Whether this call starts a model forward: the base model asks once per layer type per
        forward, in an order of its own, with the same ``position_ids`` tensor; a call starts a new
        forward when it brings other ``position_ids`` or asks again for a type already served."""
        if self._forward_positions is position_ids and layer_type not in self._served:
            self._served.add(layer_type)
            return False
        self._forward_positions, self._served = position_ids, {layer_type}
        return True

    @torch.no_grad()
    def _pre(self, module, args, kwargs):
        position_ids, layer_type = _call_args(args, kwargs)
        if position_ids is None or layer_type not in self.entries:
            return None
        for lt, e in self.entries.items():  # the buffers are the truth: they follow model.to(device)
            e.inv_freq = module._buffers[inv_freq_name(lt)]
        if self._new_forward(position_ids, layer_type):  # once per model forward
            self._cached_positions = self._track(position_ids) if self.dynamic_cache == "rerotate" else None
            seq_len = int(position_ids.max()) + 1  # a host-device sync: dynamic strategies only
            if module.training and self.target_length:
                seq_len = max(seq_len, self.target_length)
            self._seq_len = seq_len
        entry = self.entries[layer_type]
        if entry.dynamic and (old := entry.update(self._seq_len)) is not None:
            self._set(layer_type, entry)
            if self._cached_positions is not None:
                rerotate_cache(self.cache, self._cached_positions, old, (entry.inv_freq, entry.attention_scaling),
                               self.cache_layers.get(layer_type, []))
        return None

    def describe(self) -> str:
        """One line: the strategy per layer type (``all: yarn``, ``sliding_attention: kept``)."""
        return ", ".join(f"{lt or 'all'}: {e.strategy.name if e.strategy else 'kept'}"
                         for lt, e in self.entries.items())


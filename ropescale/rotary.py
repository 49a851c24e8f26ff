"""The model's rotary modules: how ropescale finds them, reads them, and changes their frequencies.

transformers 5.x models hold their rotary modules (``model.model.rotary_emb`` and kin; several in
some families, one per layer in others) with an ``inv_freq`` buffer — or ``{layer_type}_inv_freq``
buffers for per-layer-type frequencies (Gemma 3) — and an ``attention_scaling`` factor, from which
their forward builds whatever the model's attention consumes: cos/sin in halves or interleaved
layout, half-width cos/sin (gpt-oss), complex ``freqs_cis`` (Llama 4, DeepSeek-V2), M-RoPE sections
over 3-axis positions (Qwen 3.5), proportional RoPE with zero-frequency pairs (Gemma 4).
ropescale never rebuilds that output: a frequency strategy swaps the module's own buffers in place
(``FrequencyPatch``) and the module goes on producing its own format, so every contract the model
has holds by construction and code that reads the module's attributes keeps working. Pairs whose
frequency the model sets to zero stay zero under every strategy.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.cache import CacheWatch, rerotate_cache
from ropescale.errors import InvalidInput, RopescaleError
from ropescale.layer_rope import LayerRope, RotarySite
from ropescale.rope_config import NoRopeConfigError, rope_config_of
from ropescale.strategies import Strategy

__all__ = [
    "FrequencyPatch",
    "NoRotaryEmbeddingError",
    "attention_scaling_of",
    "find_rotary_modules",
    "ignores_buffers",
    "layer_types_of",
    "rope_context",
    "rotary_sites",
]

_SKIP = ("original", "long")  # `*_original_inv_freq`, `*_long_inv_freq` are bookkeeping buffers


class NoRotaryEmbeddingError(RopescaleError, ValueError):
    """The model has no rotary-embedding module that ropescale can patch."""


def layer_types_of(module: nn.Module) -> list[str | None]:
    """``[None]`` for a plain rotary module; the layer types of a per-type one (Gemma 3)."""
    if "inv_freq" in module._buffers:
        return [None]
    return [name[: -len("_inv_freq")] for name in module._buffers
            if name.endswith("_inv_freq") and not any(name.endswith(f"_{k}_inv_freq") or name == f"{k}_inv_freq"
                                                      for k in _SKIP)]


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every rotary module (``inv_freq`` or ``*_inv_freq`` buffers)."""
    return [(n, m) for n, m in model.named_modules() if layer_types_of(m)]


def rotary_sites(model: nn.Module) -> tuple[dict[str, nn.Module], list[RotarySite]]:
    """The model's named modules and every frequency set of its rotary modules."""
    modules = dict(model.named_modules())
    return modules, [RotarySite(n, lt) for n, m in find_rotary_modules(model) for lt in layer_types_of(m)]


def _buffer(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def _scaling_attr(layer_type: str | None) -> str:
    return "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"


def attention_scaling_of(module: nn.Module, layer_type: str | None) -> float:
    """The cos/sin scale the original module applies (``attention_scaling`` or per layer type)."""
    value = getattr(module, _scaling_attr(layer_type), None)
    return 1.0 if value is None else float(value)


def _config_of(model: nn.Module, module: nn.Module):
    cfg = getattr(module, "config", None) or getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_context(model: nn.Module, module: nn.Module, layer_type: str | None = None) -> dict[str, Any]:
    """``dim``, ``rope_theta`` and ``original_max_position_embeddings`` for a rotary module.

    ``dim`` comes from the module's own ``inv_freq`` (so partial rotary is honoured); θ and the
    training window from the config, read by ``ropescale.rope_config.rope_config_of`` (the one
    reader: rope parameters, nested per layer type for Gemma 3; the window from
    ``original_max_position_embeddings`` there, the config's own (Phi-3), or
    ``max_position_embeddings``). Raises ``NoRotaryEmbeddingError`` when the config has no θ.
    """
    cfg = _config_of(model, module)
    if layer_type is None and "inv_freq" not in module._buffers:
        layer_type = layer_types_of(module)[0]  # per-layer-type module: any type gives T
    try:
        rope = rope_config_of(cfg, layer_type, dim=2 * getattr(module, _buffer(layer_type)).numel())
    except NoRopeConfigError:
        raise NoRotaryEmbeddingError(
            f"found a rotary module ({type(module).__name__}) but no rope_theta in the model's "
            "config (looked in config.rope_parameters and config.rope_theta)") from None
    return rope.context()


@dataclass
class _Entry:
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
        return self.strategy is not None and self.strategy.dynamic

    def _compute(self, seq_len: int) -> tuple[torch.Tensor, float]:
        length = -(-seq_len // self.block) * self.block  # rounded up to whole blocks
        if self._memo is None or self._memo[0] != length:
            inv_freq, scaling = self.strategy.compute({**self.context, "seq_len": length}, self.params)
            self._memo = (length, (keep_zero(inv_freq, self.zero), scaling))
        inv_freq, scaling = self._memo[1]
        return inv_freq.to(self.inv_freq.device), scaling  # wherever the buffer lives now

    def would_change(self, seq_len: int) -> bool:
        if not self.dynamic or seq_len == self.cached_len:
            return False
        inv_freq, scaling = self._compute(seq_len)
        return scaling != self.attention_scaling or not torch.equal(inv_freq, self.inv_freq)

    def update(self, seq_len: int) -> tuple[torch.Tensor, float] | None:
        """Recompute for ``seq_len``; the previous ``(inv_freq, attention_scaling)`` if they changed."""
        if seq_len == self.cached_len:
            return None
        old = (self.inv_freq, self.attention_scaling)
        self.inv_freq, self.attention_scaling = self._compute(seq_len)
        self.cached_len = seq_len
        changed = self.attention_scaling != old[1] or not torch.equal(self.inv_freq, old[0])
        return old if changed else None


def keep_zero(inv_freq: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``inv_freq`` ``[d/2]`` with the pairs ``zero`` marks set to 0 (the model's unrotated pairs)."""
    if zero is None or not bool(zero.any()):
        return inv_freq
    return torch.where(zero.to(inv_freq.device), torch.zeros_like(inv_freq), inv_freq)


def ignores_buffers(module: nn.Module) -> bool:
    """Whether ``module``'s output stays the same when its ``inv_freq`` buffers change: a rotary module
    that recomputes its frequencies from the config at every call cannot be patched through them
    (Phi-3.5-MoE's does, through its ``rope_init_fn``, which ``FrequencyPatch`` points at the buffers).
    Calls the module at positions 1 and 2 with its buffers as they are and doubled; a
    module that cannot be called so (another signature) counts as following them."""
    types = layer_types_of(module)
    buf = next(iter(module._buffers[_buffer(lt)] for lt in types))
    x = torch.zeros(1, 2, 1, dtype=buf.dtype if buf.is_floating_point() else torch.float32, device=buf.device)
    pos = torch.arange(1, 3, device=buf.device)[None]  # [1, 2]

    def call():
        with torch.no_grad():
            out = module(x, pos) if types == [None] else module(x, pos, types[0])
        return [t.detach().clone() for t in (out if isinstance(out, (tuple, list)) else (out,))]

    saved = {lt: module._buffers[_buffer(lt)] for lt in types}
    rope_type = module.__dict__.get("rope_type", _ABSENT)  # transformers' dynamic update would reset the buffers
    if rope_type is not _ABSENT:
        module.rope_type = {k: "default" for k in rope_type} if isinstance(rope_type, dict) else "default"
    init = module.__dict__.get("rope_init_fn") if types == [None] else None
    if callable(init):  # FrequencyPatch reads it back from the buffers too
        module.rope_init_fn = _from_buffers(module)
    try:
        before = call()
        for lt, b in saved.items():
            module._buffers[_buffer(lt)] = b * 2
        after = call()
    except Exception:  # noqa: BLE001 — a signature of its own: nothing to conclude
        return False
    finally:
        for lt, b in saved.items():
            module._buffers[_buffer(lt)] = b
        if rope_type is not _ABSENT:
            module.rope_type = rope_type
        if callable(init):
            module.rope_init_fn = init
    return all(torch.equal(a, b) for a, b in zip(before, after))


def _from_buffers(module: nn.Module):
    """A ``rope_init_fn`` that returns what ``module`` holds now: (``inv_freq``, ``attention_scaling``)."""
    def rope_init_fn(*args, **kwargs):
        return module.inv_freq, module.attention_scaling
    return rope_init_fn


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
    ``position_ids``' values (no host-device sync). In training mode with ``training_length`` set
    (``set_training_length``; ``PatchHandle.train_at``), dynamic strategies use L =
    max(``training_length``, max(position_ids) + 1) — the target length being trained for, whatever
    the positions of one batch reach (PoSE's skipped positions reach it only sometimes). Under a KV
    cache (``ropescale.cache``), ``dynamic_cache`` says what happens to cached tokens when the
    frequencies change: ``"recompute"`` re-runs the prefix (exact), ``"rerotate"`` re-rotates cached
    keys of the layers that use these frequencies (``cache_layers``: layer type → the layers' ``LayerRope``),
    exact in layer 0 only.
    """

    def __init__(self, module: nn.Module, entries: dict[str | None, _Entry], dynamic_cache: str = "recompute",
                 cache_layers: dict[str | None, list[LayerRope]] | None = None):
        self.module = module
        self.entries = entries
        self.dynamic_cache = dynamic_cache
        self.cache_layers = cache_layers or {}
        self.watch: CacheWatch | None = None
        self.training_length: int | None = None
        self._saved: list[tuple[str, Any, bool]] = []  # (name, original, was a buffer)
        self._hooks: list = []
        self._positions: torch.Tensor | None = None  # [b, s_cached] positions of cached keys (rerotate)
        self._forward_positions: torch.Tensor | None = None
        self._served: set[str | None] = set()
        self._seq_len: int | None = None
        self._cached_positions: torch.Tensor | None = None
        self._config_rope_type: tuple[dict, str] | None = None  # (rope_parameters, its rope_type)

    @property
    def dynamic(self) -> bool:
        return any(e.dynamic for e in self.entries.values())

    def _set(self, layer_type: str | None, entry: _Entry) -> None:
        buf = self.module._buffers[_buffer(layer_type)]
        self.module._buffers[_buffer(layer_type)] = entry.inv_freq.to(device=buf.device, dtype=buf.dtype)
        setattr(self.module, _scaling_attr(layer_type), entry.attention_scaling)

    def apply(self) -> None:
        """Swap the strategy's frequencies in (the originals are kept, to the tensor)."""
        m = self.module
        for lt in self.entries:
            self._saved.append((_buffer(lt), m._buffers[_buffer(lt)], True))
            self._saved.append((_scaling_attr(lt), m.__dict__.get(_scaling_attr(lt), _ABSENT), False))
        if "rope_type" in m.__dict__ and self.entries:  # types kept as they are keep their own dynamic updates
            rt = m.__dict__["rope_type"]
            self._saved.append(("rope_type", rt, False))
            m.rope_type = {k: "default" if k in self.entries else v for k, v in rt.items()} \
                if isinstance(rt, dict) else "default"
        if callable(m.__dict__.get("rope_init_fn")) and list(self.entries) == [None]:
            # a module that recomputes its frequencies from the config at every call (Phi-3.5-MoE's
            # PhimoeRotaryEmbedding.forward calls self.rope_init_fn(self.config)): its own hook, read
            # back from the buffers; its config's rope type reads default meanwhile, so the shipped
            # short/long mscale gives way to the strategy's attention_scaling
            self._saved.append(("rope_init_fn", m.__dict__["rope_init_fn"], False))
            m.rope_init_fn = _from_buffers(m)
            rp = getattr(getattr(m, "config", None), "rope_parameters", None)
            if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
                self._config_rope_type = (rp, rp["rope_type"])
                rp["rope_type"] = "default"
        for lt, e in self.entries.items():
            self._set(lt, e)
        if self.dynamic:
            self._hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))

    def restore(self) -> None:
        """Put the module's own buffers and attributes back, moved to where the module lives now."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for name, value, is_buffer in reversed(self._saved):
            if is_buffer:
                now = self.module._buffers[name]
                self.module._buffers[name] = value.to(device=now.device) if value.device != now.device else value
            elif value is _ABSENT:
                self.module.__dict__.pop(name, None)
            else:
                setattr(self.module, name, value)
        self._saved.clear()
        if self._config_rope_type is not None:
            rp, rope_type = self._config_rope_type
            rp["rope_type"] = rope_type
            self._config_rope_type = None

    @contextlib.contextmanager
    def own(self):
        """The module's own ``inv_freq`` and ``attention_scaling`` meanwhile (its ``rope_type`` still reads
        ``default``), the strategy's put back after: what the model would compute, for a reader that must
        keep it (a sparse-attention indexer under a relative rule, ``ropescale.attention.indexers``)."""
        m, swapped = self.module, []
        for name, value, is_buffer in self._saved:
            if name in ("rope_type", "rope_init_fn"):
                continue
            if is_buffer:
                now = m._buffers[name]
                swapped.append((name, now, True))
                m._buffers[name] = value.to(device=now.device)
            else:
                swapped.append((name, m.__dict__.get(name, _ABSENT), False))
                if value is _ABSENT:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
        try:
            yield
        finally:
            for name, value, is_buffer in reversed(swapped):
                if is_buffer:
                    m._buffers[name] = value
                elif value is _ABSENT:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)

    def set_training_length(self, length: int | None) -> None:
        """Dynamic strategies' L in training mode: at least ``length`` [tokens]; None: from the
        positions only. Raises ``InvalidInput`` unless ``length`` is None or a whole number >= 1."""
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise InvalidInput(f"training length {length!r} must be a whole number of tokens >= 1 (or None)")
        self.training_length = length

    def use_watch(self, watch: CacheWatch) -> None:
        """Read the KV cache of each forward from ``watch`` (one ``ropescale.cache.CacheWatch`` per model)."""
        self.watch = watch

    @property
    def cache(self):
        return self.watch.cache if self.watch is not None else None

    def would_change(self, seq_len: int) -> bool:
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
            e.inv_freq = module._buffers[_buffer(lt)]
        if self._new_forward(position_ids, layer_type):  # once per model forward
            self._cached_positions = self._track(position_ids) if self.dynamic_cache == "rerotate" else None
            seq_len = int(position_ids.max()) + 1  # a host-device sync: dynamic strategies only
            if module.training and self.training_length:
                seq_len = max(seq_len, self.training_length)
            self._seq_len = seq_len
        entry = self.entries[layer_type]
        if entry.dynamic and (old := entry.update(self._seq_len)) is not None:
            self._set(layer_type, entry)
            if self._cached_positions is not None:
                rerotate_cache(self.cache, self._cached_positions, old, (entry.inv_freq, entry.attention_scaling),
                               self.cache_layers.get(layer_type, []))
        return None

    def describe(self) -> str:
        return ", ".join(f"{lt or 'all'}: {e.strategy.name if e.strategy else 'kept'}"
                         for lt, e in self.entries.items())


_ABSENT = object()

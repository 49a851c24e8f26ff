"""The model's rotary module: how ropescale finds it, reads it, and replaces it.

transformers 5.x models hold one rotary module (``model.model.rotary_emb`` and kin) that the
base model calls once per forward to build ``(cos, sin)`` for every layer. We find it
generically — any submodule with an ``inv_freq`` buffer, or ``{layer_type}_inv_freq`` buffers
for models with per-layer-type frequencies (Gemma 3) — learn its output layout by calling a copy
of it, and replace it with ``ScaledRotaryEmbedding``, driven by a frequency strategy.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``, smaller than
``head_dim`` for partial-rotary models, which we honour by reading d from the module).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.cache import CacheWatch, rerotate_cache
from ropescale.errors import InvalidInput, RopescaleError
from ropescale.rope_config import NoRopeConfigError, rope_config_of
from ropescale.strategies import Strategy

__all__ = [
    "NoRotaryEmbeddingError",
    "ScaledRotaryEmbedding",
    "attention_scaling_of",
    "find_rotary_modules",
    "layer_types_of",
    "probe_layout",
    "rope_context",
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


def _buffer(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def attention_scaling_of(module: nn.Module, layer_type: str | None) -> float:
    """The cos/sin scale the original module applies (``attention_scaling`` or per layer type)."""
    name = "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"
    value = getattr(module, name, None)
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
    """Frequencies of one layer type: from a strategy (maybe dynamic) or kept from the model."""

    inv_freq: torch.Tensor
    attention_scaling: float
    strategy: Strategy | None = None
    params: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    cached_len: int | None = None
    block: int = 1
    _memo: tuple | None = None  # (length, result): would_change and update ask for the same length

    @property
    def dynamic(self) -> bool:
        return self.strategy is not None and self.strategy.dynamic

    def _compute(self, seq_len: int) -> tuple[torch.Tensor, float]:
        length = -(-seq_len // self.block) * self.block  # rounded up to whole blocks
        if self._memo is None or self._memo[0] != length:
            self._memo = (length, self.strategy.compute({**self.context, "seq_len": length}, self.params))
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


class ScaledRotaryEmbedding(nn.Module):
    """Drop-in rotary module: ``forward(x, position_ids, layer_type=None) -> (cos, sin)``.

    ``x`` only gives dtype and device; ``position_ids`` ``[b, s]`` int. Returns ``cos``, ``sin``
    ``[b, s, d]`` built as ``cat(freqs, freqs)`` (the rotate-half layout of the Llama lineage) or
    interleaved pairs, whichever the original module produced, times the attention factor, in
    ``x.dtype`` (float32 where the original module kept float32, as OLMo's does).

    Dynamic strategies recompute the frequencies from ``L = max(position_ids) + 1`` (rounded up
    to a multiple of ``dynamic_block``) on each forward: one scale for the whole forward, as
    transformers' ``dynamic`` type does; each layer type's entry is brought up to L when it is
    asked for, whatever order the base model asks in. Static strategies never read
    ``position_ids``' values (no host-device sync). In training mode with ``training_length`` set
    (``set_training_length``; ``PatchHandle.train_at``), they use L = max(``training_length``, max(position_ids) + 1)
    instead: the target length the model is being trained for, whatever the positions of one
    batch reach (PoSE's skipped positions reach L only sometimes). Under a KV cache
    (``ropescale.cache``), ``dynamic_cache`` says what happens to cached tokens when the
    frequencies change: ``"recompute"`` re-runs the prefix (exact: equals a full forward),
    ``"rerotate"`` only re-rotates cached keys (cheap; exact in layer 0, deeper layers keep
    hidden states computed under the old scale).
    """

    def __init__(self, entries: dict[str | None, _Entry], keep_float32: bool,
                 layer_of_cache: list[str | None] | None, dynamic_cache: str = "recompute",
                 interleaved: bool = False):
        super().__init__()
        self.entries = entries
        self.keep_float32 = keep_float32
        self.interleaved = interleaved
        self.dynamic_cache = dynamic_cache
        self.layer_of_cache = layer_of_cache  # layer type of each decoder layer (cache index)
        for lt, e in entries.items():
            self.register_buffer(_buffer(lt), e.inv_freq, persistent=False)
        self.watch: CacheWatch | None = None  # the KV cache of each forward (dynamic strategies)
        self._positions: torch.Tensor | None = None  # [b, s_cached] positions of cached keys
        self.training_length: int | None = None  # dynamic strategies' L in training mode [tokens]
        self._forward_positions: torch.Tensor | None = None  # position_ids of the current forward
        self._served: set[str | None] = set()  # layer types already asked for in the current forward
        self._seq_len: int | None = None  # dynamic strategies' L for the current forward [tokens]
        self._cached_positions: torch.Tensor | None = None  # positions of keys cached before this forward

    def set_training_length(self, length: int | None) -> None:
        """Dynamic strategies' L in training mode: at least ``length`` [tokens] (the target length
        being trained for), whatever one batch's positions reach; None: from the positions only.
        Raises ``InvalidInput`` unless ``length`` is None or a whole number >= 1."""
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise InvalidInput(f"training length {length!r} must be a whole number of tokens >= 1 (or None)")
        self.training_length = length

    def watch_cache(self, base_model) -> list:
        """Follow the KV cache of every forward of ``base_model`` (the module calling this one),
        for dynamic strategies (``ropescale.cache.CacheWatch``); returns the hook handles."""
        self.watch = CacheWatch(self)
        return self.watch.attach(base_model)

    @property
    def cache(self):
        """The KV cache of the forward running now, or None."""
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
        """Whether this call starts a model forward.

        The base model asks once per layer type per forward, in an order of its own (Gemma 3
        iterates a ``set``: the order changes with ``PYTHONHASHSEED``), all with the same
        ``position_ids`` tensor. A call starts a new forward when it brings other
        ``position_ids`` or asks again for a layer type already served in the current one.
        """
        if self._forward_positions is position_ids and layer_type not in self._served:
            self._served.add(layer_type)
            return False
        self._forward_positions, self._served = position_ids, {layer_type}
        return True

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        for lt, e in self.entries.items():  # the buffers are the truth: they follow model.to(device)
            e.inv_freq = self._buffers[_buffer(lt)]
        entry = self.entries[layer_type]
        dynamic = any(e.dynamic for e in self.entries.values())
        if self._new_forward(position_ids, layer_type) and dynamic:  # once per model forward
            tracking = self.dynamic_cache == "rerotate"
            self._cached_positions = self._track(position_ids) if tracking else None
            seq_len = int(position_ids.max()) + 1  # a host-device sync: dynamic strategies only
            if self.training and self.training_length:
                seq_len = max(seq_len, self.training_length)
            self._seq_len = seq_len
        # the entry asked for, whenever its length is stale for this forward — whichever type comes first
        if entry.dynamic and (old := entry.update(self._seq_len)) is not None:
            setattr(self, _buffer(layer_type), entry.inv_freq)
            if self._cached_positions is not None:
                layers = [i for i, t in enumerate(self.layer_of_cache or []) if t == layer_type] \
                    if layer_type is not None else None
                rerotate_cache(self.cache, self._cached_positions, old, (entry.inv_freq, entry.attention_scaling),
                               layers)
        freqs = position_ids[..., None].float() * entry.inv_freq.to(device=x.device, dtype=torch.float)  # [b, s, d/2]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # [b, s, d]: θ0 θ0 θ1 θ1 …
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, d]: θ0 θ1 … θ0 θ1 …
        cos = emb.cos() * entry.attention_scaling
        sin = emb.sin() * entry.attention_scaling
        if self.keep_float32:
            return cos, sin
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return ", ".join(f"{lt or 'all'}: {e.strategy.name if e.strategy else 'kept'}"
                         for lt, e in self.entries.items())


def probe_layout(module: nn.Module, layer_type: str | None) -> tuple[bool, bool]:
    """How the original module lays out its output, learned by calling a copy of it.

    Returns ``(keeps_float32, interleaved)``: whether cos/sin stay float32 for a bf16 input
    (OLMo) and whether frequencies are interleaved (θ0 θ0 θ1 θ1 …, Cohere/GLM style) rather than
    split in halves (θ0 θ1 … θ0 θ1 …, every family of the Llama lineage). Raises
    ``NoRotaryEmbeddingError`` for any other layout.
    """
    probe = copy.deepcopy(module)
    dev = getattr(probe, _buffer(layer_type)).device
    pos = torch.arange(1, 9, device=dev)[None]  # [1, 8]

    def call(dtype):
        x = torch.zeros(1, 8, 1, dtype=dtype, device=dev)
        with torch.no_grad():
            return (probe(x, pos) if layer_type is None else probe(x, pos, layer_type))[0]

    keeps_float32 = call(torch.bfloat16).dtype == torch.float32
    cos = call(torch.float32)[0].float()  # [8, d]
    half = cos.shape[-1] // 2
    if half == 1 or torch.equal(cos[:, :half], cos[:, half:]):
        return keeps_float32, False
    if torch.equal(cos[:, 0::2], cos[:, 1::2]):
        return keeps_float32, True
    raise NoRotaryEmbeddingError(f"{type(module).__name__} returns cos/sin in a layout ropescale does "
                                 "not recognise (neither halves nor interleaved pairs)")

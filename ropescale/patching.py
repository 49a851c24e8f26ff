"""Patch a loaded Hugging Face causal LM's rotary embedding with a strategy, reversibly.

transformers 5.x models hold one rotary module (``model.model.rotary_emb`` and kin) that the
base model calls once per forward to build ``(cos, sin)`` for every layer. We find it
generically — any submodule with an ``inv_freq`` buffer, or ``{layer_type}_inv_freq`` buffers
for models with per-layer-type frequencies (Gemma 3) — and swap it for a
``ScaledRotaryEmbedding`` driven by the strategy. The original module object is kept untouched
and put back by ``unpatch``, so logits are restored bit for bit.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``, smaller than
``head_dim`` for partial-rotary models, which we honour by reading d from the module),
n_kv = key/value heads.

Patch *after* ``from_pretrained``: loading recomputes ``inv_freq`` of rotary modules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.cache import rerotate_cache, watch_cache
from ropescale.strategies import Strategy, get_strategy

__all__ = ["NoRotaryEmbeddingError", "PatchHandle", "ScaledRotaryEmbedding", "patch", "unpatch",
           "current_patch", "find_rotary_modules", "rope_context", "layer_types_of"]

_HANDLE_ATTR = "_ropescale_patch"
_SKIP = ("original", "long")  # `*_original_inv_freq`, `*_long_inv_freq` are bookkeeping buffers


class NoRotaryEmbeddingError(ValueError):
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


def _config_of(model: nn.Module, module: nn.Module):
    cfg = getattr(module, "config", None) or getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_context(model: nn.Module, module: nn.Module, layer_type: str | None = None) -> dict[str, Any]:
    """``dim``, ``rope_theta`` and ``original_max_position_embeddings`` for a rotary module.

    ``dim`` comes from the module's own ``inv_freq`` (so partial rotary is honoured);
    ``rope_theta`` from ``config.rope_parameters`` (v5; nested per layer type for Gemma 3) or the
    legacy ``config.rope_theta``; the training window from the rope parameters'
    ``original_max_position_embeddings``, the config's own (Phi-3 keeps it there), or
    ``config.max_position_embeddings``.
    """
    cfg = _config_of(model, module)
    rp = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    if theta is None:
        raise NoRotaryEmbeddingError(
            f"found a rotary module ({type(module).__name__}) but no rope_theta in the model's "
            "config (looked in config.rope_parameters and config.rope_theta)")
    orig = (rp.get("original_max_position_embeddings") if isinstance(rp, dict) else None) \
        or getattr(cfg, "original_max_position_embeddings", None) \
        or getattr(cfg, "max_position_embeddings", None)
    return {"dim": 2 * getattr(module, _buffer(layer_type)).numel(), "rope_theta": float(theta),
            "original_max_position_embeddings": orig}


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

    @property
    def dynamic(self) -> bool:
        return self.strategy is not None and self.strategy.dynamic

    def _compute(self, seq_len: int) -> tuple[torch.Tensor, float]:
        length = -(-seq_len // self.block) * self.block  # rounded up to whole blocks
        inv_freq, scaling = self.strategy.compute({**self.context, "seq_len": length}, self.params)
        return inv_freq.to(self.inv_freq.device), scaling

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
    transformers' ``dynamic`` type does. Under a KV cache (``ropescale.cache``), ``dynamic_cache``
    says what happens to cached tokens when the frequencies change: ``"recompute"`` re-runs the
    prefix (exact: equals a full forward), ``"rerotate"`` only re-rotates cached keys (cheap;
    exact in layer 0, deeper layers keep hidden states computed under the old scale).
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
        self.cache = None  # set for the duration of a forward by the base model's pre-hook
        self._positions: torch.Tensor | None = None  # [b, s_cached] positions of cached keys
        self.history = None  # (input_ids, position_ids) of the tokens in the cache (recompute mode)
        self.n_new: int | None = None  # tokens of this forward when the prefix is being recomputed

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

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        entry = self.entries[layer_type]
        if layer_type == next(iter(self.entries)):  # once per model forward
            cached_positions = self._track(position_ids)
            seq_len = int(position_ids.max()) + 1
            for lt, e in self.entries.items():
                if e.dynamic and (old := e.update(seq_len)) is not None:
                    setattr(self, _buffer(lt), e.inv_freq)
                    if cached_positions is not None and self.dynamic_cache == "rerotate":
                        layers = [i for i, t in enumerate(self.layer_of_cache or []) if t == lt] \
                            if lt is not None else None
                        rerotate_cache(self.cache, cached_positions, old, (e.inv_freq, e.attention_scaling), layers)
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
        return ", ".join(f"{lt or 'all'}: {e.strategy.name if e.strategy else 'kept'}" for lt, e in self.entries.items())


@dataclass
class PatchHandle:
    """What ``patch`` changed; ``unpatch()`` (or leaving the ``with`` block) restores it."""

    model: nn.Module
    strategy: str
    params: dict[str, Any]
    context: dict[str, Any]
    layer_types: list[str | None] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    _swaps: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)
    _hooks: list = field(default_factory=list, repr=False)
    _restore: list = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(self._swaps)

    @property
    def strategy_obj(self) -> Strategy:
        return get_strategy(self.strategy)

    def unpatch(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        while self._restore:
            self._restore.pop()()
        for parent, attr, original in reversed(self._swaps):
            setattr(parent, attr, original)
        self._swaps.clear()
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the patch (how ``ropescale.save_patched`` stores it)."""
        out = {"strategy": self.strategy, "params": self.params,
               "original_max_position_embeddings": self.context["original_max_position_embeddings"]}
        if self.layer_types != [None]:
            out["layer_types"] = self.layer_types
        return out | self.options

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def current_patch(model: nn.Module) -> PatchHandle | None:
    """The active ``PatchHandle`` of ``model``, or None."""
    return getattr(model, _HANDLE_ATTR, None)


def _probe(module: nn.Module, layer_type: str | None) -> tuple[bool, bool]:
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


def _default_layer_types(model: nn.Module, module: nn.Module, available: list[str | None]) -> list[str | None]:
    """All types, except sliding-window ones when the model mixes them with global attention:
    a sliding layer never sees relative positions beyond its window, so it needs no scaling
    (Gemma 3's own long-context configs scale only ``full_attention``)."""
    if available == [None]:
        return available
    cfg = _config_of(model, module)
    keep = [t for t in available if "sliding" not in t] if getattr(cfg, "sliding_window", None) else available
    return keep or available


DYNAMIC_CACHE_MODES = ("recompute", "rerotate")


def patch(model: nn.Module, strategy: str, *, original_max_position_embeddings: int | None = None,
          layer_types: list[str] | None = None, dynamic_cache: str = "recompute",
          dynamic_block: int = 1, logn: bool = False, attention_path: str = "blocked",
          block_size: int = 512, **params: Any) -> PatchHandle:
    """Apply ``strategy`` to the rotary embedding of ``model`` in place.

    Args:
        model: a loaded HF model with RoPE (any family whose rotary module has ``inv_freq``).
        strategy: registry name (``ropescale strategies`` lists them).
        original_max_position_embeddings: training window L_train [tokens]; default from config.
        layer_types: for per-layer-type rotary modules (Gemma 3), which types to patch; default
            all but sliding-window types. The others keep the model's own frequencies.
        dynamic_cache: dynamic strategies under a KV cache: ``"recompute"`` (exact; re-runs the
            cached prefix whenever the frequencies change) or ``"rerotate"`` (re-rotates cached
            keys only; cheaper, approximate past layer 0). See ``ropescale.cache``.
        dynamic_block: dynamic strategies take L rounded up to a multiple of this [tokens], so
            the frequencies (and, with ``"recompute"``, the prefix) change once per block.
        logn: also scale queries by max(1, ln(p+1)/ln(L_train)) (Su 2023), through the
            attention interface (``ropescale.attention``); works with any strategy.
        attention_path: truncation rules only: ``"blocked"`` (exact, O(n) memory) or ``"naive"``
            (explicit n × n relative positions; the tests' oracle).
        block_size: truncation rules only: query/key block of the blocked path [tokens].
        **params: the strategy's parameters (validated).

    Returns a ``PatchHandle``; ``handle.unpatch()`` or ``with patch(...):`` restores the model.

    Raises:
        UnknownStrategyError: unknown ``strategy`` (message lists the known ones).
        ValueError: bad parameter (names it and the allowed range); unknown layer type; model
            already patched.
        NoRotaryEmbeddingError: no rotary module, or no ``rope_theta`` in the config.
        AttentionNotPluggableError: ``logn`` on a model whose attention bypasses the interface.
    """
    strat = get_strategy(strategy)
    params = strat.validate(params)
    if dynamic_cache not in DYNAMIC_CACHE_MODES:
        raise ValueError(f"dynamic_cache={dynamic_cache!r}; choose one of {', '.join(DYNAMIC_CACHE_MODES)}")
    if not isinstance(dynamic_block, int) or dynamic_block < 1:
        raise ValueError(f"dynamic_block={dynamic_block!r} must be a whole number >= 1")
    if attention_path not in ("blocked", "naive"):
        raise ValueError(f"attention_path={attention_path!r}; choose 'blocked' or 'naive'")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a whole number >= 1")
    if current_patch(model) is not None:
        raise ValueError(f"model is already patched with {current_patch(model).strategy!r}; "
                         "call unpatch() first")
    found = find_rotary_modules(model)
    if not found:
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__} has no rotary embedding: no submodule holds an `inv_freq` "
            "(or `<layer_type>_inv_freq`) buffer; models with learned, ALiBi or sinusoidal "
            "positions cannot be patched")
    modules = dict(model.named_modules())
    handle = PatchHandle(model, strategy, params, {})
    if strat.kind == "attention":
        return _patch_attention(model, handle, strat, found, modules, original_max_position_embeddings,
                                logn, attention_path == "naive", block_size)
    try:
        for name, module in found:
            available = layer_types_of(module)
            chosen = list(layer_types) if layer_types is not None else _default_layer_types(model, module, available)
            unknown = [t for t in chosen if t not in available]
            if unknown:
                raise ValueError(f"layer_types {unknown} not in this model's rotary module; it has {available}")
            entries = {}
            for lt in available:
                if lt not in chosen:  # kept as the model computes it
                    entries[lt] = _Entry(getattr(module, _buffer(lt)).clone(),
                                         getattr(module, f"{lt}_attention_scaling", 1.0))
                    continue
                context = rope_context(model, module, lt)
                if original_max_position_embeddings is not None:
                    context["original_max_position_embeddings"] = int(original_max_position_embeddings)
                if context["original_max_position_embeddings"] is None and any(
                        k in strat.needs for k in ("original_max_position_embeddings", "seq_len")):
                    raise ValueError(f"{strategy} needs original_max_position_embeddings; the config has none")
                start = {**context, "seq_len": context["original_max_position_embeddings"]}
                inv_freq, scaling = strat.compute(start, params)
                device = getattr(module, _buffer(lt)).device
                entries[lt] = _Entry(inv_freq.to(device), scaling, strat, params, context,
                                     start["seq_len"] if strat.dynamic else None, dynamic_block)
                handle.context = context
            cfg = _config_of(model, module)
            keeps_float32, interleaved = _probe(module, available[0])
            if interleaved and strat.dynamic and dynamic_cache == "rerotate":
                raise ValueError("dynamic_cache='rerotate' supports the rotate-half layout only; "
                                 f"{type(module).__name__} interleaves: use 'recompute'")
            replacement = ScaledRotaryEmbedding(entries, keeps_float32, getattr(cfg, "layer_types", None),
                                                dynamic_cache, interleaved)
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name]
            setattr(parent, attr, replacement)
            handle._swaps.append((parent, attr, module))
            handle.layer_types = chosen
            if strat.dynamic:
                handle._hooks += watch_cache(parent, replacement)
                handle.options = {"dynamic_cache": dynamic_cache, "dynamic_block": dynamic_block}
        if logn:
            from ropescale.attention import enable_logn

            handle._restore.append(enable_logn(model, handle.context["original_max_position_embeddings"]))
            handle.options["logn"] = True
    except Exception:
        handle.unpatch()
        raise
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _patch_attention(model, handle: PatchHandle, strat: Strategy, found, modules, train_override,
                     logn: bool, naive: bool, block: int) -> PatchHandle:
    """Truncation rules: identity rotary module + the rule inside attention."""
    from ropescale.attention import IdentityRotary, enable_truncation

    if len(found) != 1:
        raise NoRotaryEmbeddingError(f"expected one rotary module, found {len(found)}: {[n for n, _ in found]}")
    (name, module), = found
    available = layer_types_of(module)
    context = rope_context(model, module, available[0])
    if train_override is not None:
        context["original_max_position_embeddings"] = int(train_override)
    rule = strat.compute(context, handle.params)
    freqs = {lt: (getattr(module, _buffer(lt)).detach().clone(), getattr(module, f"{lt}_attention_scaling", None)
                  if lt is not None else getattr(module, "attention_scaling", 1.0)) for lt in available}
    freqs = {lt: (f, 1.0 if a is None else float(a)) for lt, (f, a) in freqs.items()}
    keeps_float32, interleaved = _probe(module, available[0])
    identity = IdentityRotary({lt: 2 * f.numel() for lt, (f, _) in freqs.items()}, keeps_float32)
    parent_name, _, attr = name.rpartition(".")
    parent = modules[parent_name]
    setattr(parent, attr, identity)
    handle._swaps.append((parent, attr, module))
    handle.context, handle.layer_types = context, [None]
    try:
        handle._restore.append(enable_truncation(
            model, rule, freqs, interleaved=interleaved, naive=naive, block=block,
            logn=context["original_max_position_embeddings"] if logn else None))
    except Exception:
        handle.unpatch()
        raise
    if logn:
        handle.options["logn"] = True
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def unpatch(model: nn.Module) -> None:
    """Undo the active patch of ``model`` (no-op when none)."""
    handle = current_patch(model)
    if handle is not None:
        handle.unpatch()

"""Patch a loaded Hugging Face causal LM with a strategy, in place and reversibly.

Frequency strategies replace the model's rotary module (``ropescale.rotary``); truncation rules
make it an identity and move RoPE into attention (``ropescale.attention``); log-n scaling wraps
attention. The original module object is kept untouched and put back by ``unpatch``, so logits
are restored bit for bit.

Patch *after* ``from_pretrained``: loading recomputes ``inv_freq`` of rotary modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ropescale.errors import InvalidInput
from ropescale.rotary import (
    NoRotaryEmbeddingError,
    ScaledRotaryEmbedding,
    _buffer,
    _config_of,
    _Entry,
    attention_scaling_of,
    find_rotary_modules,
    layer_types_of,
    probe_layout,
    rope_context,
)
from ropescale.strategies import Strategy, get_strategy

__all__ = [
    "NoRotaryEmbeddingError",
    "PatchHandle",
    "ScaledRotaryEmbedding",
    "current_patch",
    "find_rotary_modules",
    "layer_types_of",
    "patch",
    "rope_context",
    "unpatch",
]

_HANDLE_ATTR = "_ropescale_patch"


@dataclass
class PatchHandle:
    """What ``patch`` changed; ``unpatch()`` (or leaving the ``with`` block) restores it."""

    model: nn.Module
    strategy: str
    params: dict[str, Any]
    context: dict[str, Any]
    layer_types: list[str | None] = field(default_factory=list)
    contexts: dict[str | None, dict[str, Any]] = field(default_factory=dict)  # per patched layer type
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

    def train_at(self, length: int | None) -> None:
        """Train toward target length ``length`` [tokens]: in training mode, dynamic strategies use
        L = max(``length``, max(position_ids) + 1) (``ScaledRotaryEmbedding.set_training_length``);
        None undoes it. Static strategies and truncation rules do not depend on L: no effect. Raises
        ``InvalidInput`` for a length that is not a whole number >= 1, ``RuntimeError`` after unpatch."""
        if not self.active:
            raise RuntimeError("this patch has been undone; patch the model again")
        for parent, attr, _ in self._swaps:
            rotary = getattr(parent, attr)
            if isinstance(rotary, ScaledRotaryEmbedding):
                rotary.set_training_length(length)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the patch (how ``ropescale.save_patched`` stores it)."""
        out = {"strategy": self.strategy, "params": self.params,
               "original_max_position_embeddings": self.context["original_max_position_embeddings"]}
        if self.layer_types != [None]:
            out["layer_types"] = self.layer_types
        return out | self.options

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def current_patch(model: nn.Module) -> PatchHandle | None:
    """The active ``PatchHandle`` of ``model``, or None."""
    return getattr(model, _HANDLE_ATTR, None)


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
          dynamic_block: int = 1, logn: bool = False, attention_path: str = "fused",
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
        attention_path: truncation rules only: ``"fused"`` (default: the rule's regions in fused
            CPU kernels, about the cost of vanilla attention, with backward; on a non-CPU device
            it runs ``"flex"``), ``"flex"`` (the regions in FlexAttention, compiled on CUDA;
            eager and unfused on the CPU, where torch has no FlexAttention backward, so training
            there runs ``"fused"``), ``"blocked"`` (a Python online softmax; also what
            ``"fused"`` uses for attention dropout, and on the CPU for soft-capping) or
            ``"naive"`` (explicit n × n relative positions; the tests' oracle). All are exact and
            differentiable.
        block_size: truncation rules only: query/key block of the blocked path [tokens].
        **params: the strategy's parameters (validated).

    Returns a ``PatchHandle``; ``handle.unpatch()`` or ``with patch(...):`` restores the model.

    Raises:
        UnknownStrategyError: unknown ``strategy`` (message lists the known ones).
        ValueError: bad parameter (names it and the allowed range); unknown layer type; model
            already patched; a model whose rotary buffers are on the meta device.
        NoRotaryEmbeddingError: no rotary module, or no ``rope_theta`` in the config.
        AttentionNotPluggableError: ``logn`` on a model whose attention bypasses the interface.
    """
    strat = get_strategy(strategy)
    params = strat.validate(params)
    found = _check_options(model, strat, original_max_position_embeddings=original_max_position_embeddings,
                           layer_types=layer_types, dynamic_cache=dynamic_cache, dynamic_block=dynamic_block,
                           logn=logn, attention_path=attention_path, block_size=block_size)
    modules = dict(model.named_modules())
    handle = PatchHandle(model, strategy, params, {})
    if strat.kind == "attention":
        return _patch_attention(model, handle, strat, found, modules, original_max_position_embeddings,
                                logn, attention_path, block_size)
    return _patch_frequency(model, handle, strat, found, modules, original_max_position_embeddings, layer_types,
                            dynamic_cache, dynamic_block, logn)


def _check_options(model: nn.Module, strat: Strategy, *, original_max_position_embeddings: int | None,
                   layer_types: list[str] | None, dynamic_cache: str, dynamic_block: int, logn: bool,
                   attention_path: str, block_size: int) -> list[tuple[str, nn.Module]]:
    """Validation: every option checked (one-line ``InvalidInput``), options ``strat`` does not use
    refused, the model checked patchable; returns its rotary modules (``find_rotary_modules``)."""
    # the rotary buffers only: accelerate's offloading (device_map) leaves offloaded weights on meta
    # but keeps buffers on a real device; a rotary buffer on meta has no frequencies to read
    meta = [n for n, m in find_rotary_modules(model) if any(b.is_meta for b in m.buffers(recurse=False))]
    if meta:
        raise InvalidInput(f"{type(model).__name__} is on the meta device ({meta[0]}'s inv_freq has a shape but no "
                         "values): no weights to patch; load the model with its weights (from_pretrained, or "
                         "to_empty() then load_state_dict) first")
    if original_max_position_embeddings is not None and (
            isinstance(original_max_position_embeddings, bool) or not isinstance(original_max_position_embeddings, int)
            or original_max_position_embeddings < 2):
        raise InvalidInput(f"original_max_position_embeddings={original_max_position_embeddings!r} must be a whole "
                         "number of tokens >= 2 (the training window)")
    if not isinstance(logn, bool):
        raise InvalidInput(f"logn={logn!r} must be True or False")
    if dynamic_cache not in DYNAMIC_CACHE_MODES:
        raise InvalidInput(f"dynamic_cache={dynamic_cache!r}; choose one of {', '.join(DYNAMIC_CACHE_MODES)}")
    if not isinstance(dynamic_block, int) or dynamic_block < 1:
        raise InvalidInput(f"dynamic_block={dynamic_block!r} must be a whole number >= 1")
    if attention_path not in ("fused", "flex", "blocked", "naive"):
        raise InvalidInput(f"attention_path={attention_path!r}; choose 'fused', 'blocked' or 'naive' (or 'flex')")
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidInput(f"block_size={block_size!r} must be a whole number >= 1")
    if current_patch(model) is not None:
        raise InvalidInput(f"model is already patched with {current_patch(model).strategy!r}; "
                         "call unpatch() first")
    found = find_rotary_modules(model)
    if not found:
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__} has no rotary embedding: no submodule holds an `inv_freq` "
            "(or `<layer_type>_inv_freq`) buffer; models with learned, ALiBi or sinusoidal "
            "positions cannot be patched")
    _refuse_inapplicable(strat, layer_types=layer_types, dynamic_cache=dynamic_cache, dynamic_block=dynamic_block,
                         attention_path=attention_path, block_size=block_size)
    return found


def _patch_frequency(model: nn.Module, handle: PatchHandle, strat: Strategy, found, modules, train_override,
                     layer_types, dynamic_cache: str, dynamic_block: int, logn: bool) -> PatchHandle:
    """Frequency strategies: each rotary module replaced by a ``ScaledRotaryEmbedding`` (chosen
    layer types driven by ``strat``, the others kept), plus log-n scaling in attention."""
    params = handle.params
    try:
        for name, module in found:
            available = layer_types_of(module)
            chosen = list(layer_types) if layer_types is not None else _default_layer_types(model, module, available)
            unknown = [t for t in chosen if t not in available]
            if unknown:
                raise InvalidInput(f"layer_types {unknown} not in this model's rotary module; it has {available}")
            entries = {}
            for lt in available:
                if lt not in chosen:  # kept as the model computes it
                    entries[lt] = _Entry(getattr(module, _buffer(lt)).clone(), attention_scaling_of(module, lt))
                    continue
                context = rope_context(model, module, lt)
                if train_override is not None:
                    context["original_max_position_embeddings"] = int(train_override)
                if context["original_max_position_embeddings"] is None and any(
                        k in strat.needs for k in ("original_max_position_embeddings", "seq_len")):
                    raise InvalidInput(f"{strat.name} needs original_max_position_embeddings; the config has none")
                start = {**context, "seq_len": context["original_max_position_embeddings"]}
                inv_freq, scaling = strat.compute(start, params)
                device = getattr(module, _buffer(lt)).device
                entries[lt] = _Entry(inv_freq.to(device), scaling, strat, params, context,
                                     start["seq_len"] if strat.dynamic else None, dynamic_block)
                handle.context = context
                handle.contexts[lt] = context
            cfg = _config_of(model, module)
            keeps_float32, interleaved = probe_layout(module, available[0])
            if interleaved and strat.dynamic and dynamic_cache == "rerotate":
                raise InvalidInput("dynamic_cache='rerotate' supports the rotate-half layout only; "
                                 f"{type(module).__name__} interleaves: use 'recompute'")
            replacement = ScaledRotaryEmbedding(entries, keeps_float32, getattr(cfg, "layer_types", None),
                                                dynamic_cache, interleaved)
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name]
            setattr(parent, attr, replacement)
            handle._swaps.append((parent, attr, module))
            handle.layer_types = chosen
            if strat.dynamic:
                handle._hooks += replacement.watch_cache(parent)
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


def _refuse_inapplicable(strat: Strategy, **options: Any) -> None:
    """``ValueError`` naming the options given away from their defaults that ``strat`` does not
    use: ``layer_types`` (frequency strategies only: a truncation rule acts in every layer's
    attention), ``dynamic_cache``/``dynamic_block`` (dynamic strategies), ``attention_path``/
    ``block_size`` (truncation rules)."""
    defaults = {"layer_types": None, "dynamic_cache": "recompute", "dynamic_block": 1, "attention_path": "fused",
                "block_size": 512}
    applies = {"layer_types": strat.kind != "attention", "dynamic_cache": strat.dynamic,
               "dynamic_block": strat.dynamic, "attention_path": strat.kind == "attention",
               "block_size": strat.kind == "attention"}
    unused = [f"{k}={v!r}" for k, v in options.items() if v != defaults[k] and not applies[k]]
    if unused:
        raise InvalidInput(f"{strat.name} does not use {', '.join(unused)} (layer_types: frequency strategies; "
                         "dynamic_cache, dynamic_block: dynamic strategies; attention_path, block_size: truncation "
                         "rules)")


def _patch_attention(model, handle: PatchHandle, strat: Strategy, found, modules, train_override,
                     logn: bool, path: str, block: int) -> PatchHandle:
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
    freqs = {lt: (getattr(module, _buffer(lt)).detach().clone(), attention_scaling_of(module, lt))
             for lt in available}
    keeps_float32, interleaved = probe_layout(module, available[0])
    identity = IdentityRotary({lt: 2 * f.numel() for lt, (f, _) in freqs.items()}, keeps_float32)
    parent_name, _, attr = name.rpartition(".")
    parent = modules[parent_name]
    setattr(parent, attr, identity)
    handle._swaps.append((parent, attr, module))
    handle.context, handle.layer_types, handle.contexts = context, [None], {None: context}
    try:
        handle._restore.append(enable_truncation(
            model, rule, freqs, interleaved=interleaved, path=path, block=block,
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

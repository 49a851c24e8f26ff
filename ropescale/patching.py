"""Patch a loaded Hugging Face causal LM with a strategy, in place and reversibly.

This module orchestrates; the model side lives in ``ropescale.rotary`` (finding and probing the rotary
modules, swapping their frequencies, the KV cache, per-family quirks) and the attention side in
``ropescale.attention``. Frequency strategies swap each rotary module's own buffers
(``ropescale.rotary.frequencies``); relative-position rules make RoPE an identity and move it into attention
(``ropescale.attention.interface``); a query temperature (log-n) wraps attention. What a patch changes is
kept and put back by ``unpatch``, so logits are restored bit for bit.

Patch *after* ``from_pretrained``: loading recomputes ``inv_freq`` of rotary modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ropescale.errors import InvalidInput
from ropescale.rope_config import nope_layer_types
from ropescale.rotary import quirks
from ropescale.rotary.cache import CacheWatch, WatchedRotaries, decoder_of
from ropescale.rotary.frequencies import FrequencyEntry, FrequencyPatch, strategy_entry
from ropescale.rotary.modules import (
    NoRotaryEmbeddingError,
    attention_scaling_of,
    default_layer_types,
    find_rotary_modules,
    inv_freq_name,
    layer_rope_parameters_of,
    layer_types_of,
    rope_context,
    rotary_sites,
    site_context,
    text_config_of,
)
from ropescale.rotary.probe import layers_without_attention, probe_layers
from ropescale.rotary.sites import LayerRope, RotarySite
from ropescale.strategies import Strategy, get_strategy
from ropescale.temperature import NATIVE, Temperature, parse_temperature, shipped

__all__ = [
    "LayerRope",
    "NoRotaryEmbeddingError",
    "PatchHandle",
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
    _call: dict[str, Any] = field(default_factory=dict, repr=False)  # patch()'s keyword arguments

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
            again = patch(self.model, self.strategy, **self._call)
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
    """The active patch of a model.

    Args:
        model: a loaded HF model.

    Returns:
        Its active ``PatchHandle``, or None when it is not patched.
    """
    return getattr(model, _HANDLE_ATTR, None)


DYNAMIC_CACHE_MODES = ("recompute", "rerotate")


def patch(model: nn.Module, strategy: str, *, original_max_position_embeddings: int | None = None,
          layer_types: list[str] | None = None, dynamic_cache: str = "recompute",
          dynamic_block: int = 1, logn: bool = False, attention_path: str = "fused",
          block_size: int = 512, temperature: Any = None, **params: Any) -> PatchHandle:
    """Apply ``strategy`` to the rotary embedding of ``model`` in place.

    Args:
        model: a loaded HF model with RoPE (any family whose rotary module has ``inv_freq``).
        strategy: registry name (``ropescale strategies`` lists them).
        original_max_position_embeddings: training window T [tokens]; default from config.
        layer_types: for per-layer-type rotary modules (Gemma 3), which types to patch; default
            all but sliding-window types. The others keep the model's own frequencies.
        dynamic_cache: dynamic strategies under a KV cache: ``"recompute"`` (exact; re-runs the
            cached prefix whenever the frequencies change) or ``"rerotate"`` (re-rotates cached
            keys only; cheaper, approximate past layer 0). See ``ropescale.rotary.cache``.
        dynamic_block: dynamic strategies take L rounded up to a multiple of this [tokens], so
            the frequencies (and, with ``"recompute"``, the prefix) change once per block.
        logn: also scale queries by max(1, ln(p+1)/ln(T)) (Su 2023), through the
            attention interface (``ropescale.attention.interface``); works with any strategy.
        temperature: another query-temperature rule instead of log-n (``ropescale.temperature``):
            ``"llama4"`` (Llama 4's stepped one), ``"beta:beta=0.1"`` (Mistral's ``llama_4_scaling_beta``),
            ``"logn"``, a mapping, or None. Exact under the KV cache like log-n.
        attention_path: relative-position rules only: ``"fused"`` (default: the rule's regions in fused
            CPU kernels, about the cost of vanilla attention, with backward; on a non-CPU device
            it runs ``"flex"``), ``"flex"`` (the regions in FlexAttention, compiled on CUDA;
            eager and unfused on the CPU, where torch has no FlexAttention backward, so training
            there runs ``"fused"``), ``"blocked"`` (a Python online softmax; also what
            ``"fused"`` uses for attention dropout, and on the CPU for soft-capping) or
            ``"naive"`` (explicit n × n relative positions; the tests' oracle). All are exact and
            differentiable.
        block_size: relative-position rules only: query/key block of the blocked path [tokens].
        params: the strategy's parameters, as keywords (validated).

    Returns:
        The ``PatchHandle``: ``handle.unpatch()`` or ``with patch(...):`` restores the model.

    Raises:
        UnknownStrategyError: unknown ``strategy`` (message lists the known ones).
        ValueError: bad parameter (names it and the allowed range); unknown layer type; model
            already patched; a model whose rotary buffers are on the meta device.
        NoRotaryEmbeddingError: no rotary module, or no ``rope_theta`` in the config.
        AttentionNotPluggableError: ``logn`` on a model whose attention bypasses the interface.
    """
    strat = get_strategy(strategy)
    params = strat.validate(params)
    rule = parse_temperature(temperature)
    if rule is not None and logn:
        raise InvalidInput(f"logn=True and temperature={temperature!r}: name one query temperature")
    keep_own = rule is not None and rule.kind == NATIVE  # the model's shipped temperature, no rule of ours
    rule = None if keep_own else rule
    if rule is not None:
        logn = True  # the option that routes attention through the temperature wrapper
    found = _check_options(model, strat, original_max_position_embeddings=original_max_position_embeddings,
                           layer_types=layer_types, dynamic_cache=dynamic_cache, dynamic_block=dynamic_block,
                           logn=logn, attention_path=attention_path, block_size=block_size)
    modules, sites = rotary_sites(model)
    handle = PatchHandle(model, strategy, params, {}, layers=probe_layers(model, modules, sites))
    handle._call = {"original_max_position_embeddings": original_max_position_embeddings, "layer_types": layer_types,
                    "dynamic_cache": dynamic_cache, "dynamic_block": dynamic_block, "logn": logn and rule is None,
                    "attention_path": attention_path, "block_size": block_size, "temperature": temperature, **params}
    handle.temperature = rule or (Temperature("logn") if logn else None)
    text = text_config_of(model, model)
    handle.own_temperature = {r: shipped(text, r) for r in (True, False)}  # read before a patch changes it
    if keep_own:
        handle.options["temperature"] = NATIVE
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
        quirks.refuse("unrotated", model)
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__} has no rotary embedding: no submodule holds an `inv_freq` "
            "(or `<layer_type>_inv_freq`) buffer; models with learned or ALiBi positions, or none, cannot be "
            "patched")
    _refuse_inapplicable(strat, layer_types=layer_types, dynamic_cache=dynamic_cache, dynamic_block=dynamic_block,
                         attention_path=attention_path, block_size=block_size)
    quirks.refuse("modules", model, found)
    return found


def _layers_of(handle: PatchHandle, site: RotarySite) -> list[LayerRope]:
    return [info for info in handle.layers or [] if info.kind == "rope" and info.site == site]


def _check_layer_types(model: nn.Module, module: nn.Module, chosen: list, available: list) -> None:
    """``InvalidInput`` (one line) for layer types to patch that the rotary module has no frequencies for; one
    whose rope parameters the config sets to None is named as NoPE (its layers run without position encoding)."""
    unknown = [t for t in chosen if t not in available]
    if not unknown:
        return
    nope = [t for t in unknown if t in nope_layer_types(text_config_of(model, module))]
    if nope:
        raise InvalidInput(f"layer_types {nope}: the config's rope parameters for them are None: those layers run "
                           f"without position encoding (NoPE), there is no RoPE to scale; the layer types that "
                           f"rotate: {available}")
    raise InvalidInput(f"layer_types {unknown} not in this model's rotary module; it has {available}")


def _patch_frequency(model: nn.Module, handle: PatchHandle, strat: Strategy, found, modules, train_override,
                     layer_types, dynamic_cache: str, dynamic_block: int, logn: bool) -> PatchHandle:
    """Frequency strategies: each rotary module's own buffers swapped for the strategy's (chosen
    layer types; the others kept), plus log-n scaling in attention."""
    params = handle.params
    if strat.dynamic and dynamic_cache == "rerotate" and handle.layers is None:
        raise InvalidInput("dynamic_cache='rerotate' re-rotates the cached keys of the layers that rotate; this "
                           "model's attention cannot be observed (it bypasses transformers' AttentionInterface): "
                           "use 'recompute'")
    try:
        for name, module in found:
            available = layer_types_of(module)
            chosen = list(layer_types) if layer_types is not None else default_layer_types(model, module, available)
            _check_layer_types(model, module, chosen, available)
            entries, cache_layers = {}, {}
            for lt in chosen:
                context = rope_context(model, module, lt)
                if train_override is not None:
                    context["original_max_position_embeddings"] = int(train_override)
                if context["original_max_position_embeddings"] is None and any(
                        k in strat.needs for k in ("original_max_position_embeddings", "seq_len")):
                    raise InvalidInput(f"{strat.name} needs original_max_position_embeddings; the config has none")
                if not strat.keeps_model:  # the model as shipped: its buffers and updates stay its own
                    entries[lt] = strategy_entry(module, lt, strat, params, context, dynamic_block)
                site = RotarySite(name, lt)
                cache_layers[lt] = _layers_of(handle, site)
                handle.sites[site] = context
                handle.context = context
                handle.contexts[lt] = context
            frequencies = FrequencyPatch(module, entries, dynamic_cache, cache_layers)
            frequencies.apply()
            handle._frequencies.append(frequencies)
            for lt in chosen:  # a family's own softmax scale under the shipped rope (quirks: DeepSeek's mscale²)
                handle._restore += quirks.apply_overrides("site", model, handle, strat, RotarySite(name, lt), modules)
            handle._active = True
            handle.layer_types = chosen
        handle._restore += quirks.apply_overrides("patch", model, handle, strat)  # shipped temperatures (β)
        dynamic = [f for f in handle._frequencies if f.dynamic]
        if dynamic:
            name, module = found[0]
            parent = modules[name.rpartition(".")[0]] if "." in name else model
            watch = CacheWatch(WatchedRotaries(dynamic, dynamic_cache))
            handle._hooks += watch.attach(decoder_of(model, parent))
            for f in dynamic:
                f.use_watch(watch)
            handle.options |= {"dynamic_cache": dynamic_cache, "dynamic_block": dynamic_block}
        if logn:
            from ropescale.attention import enable_logn

            handle._restore.append(enable_logn(model, handle.context["original_max_position_embeddings"],
                                               handle.temperature, [m for _, m in found]))
            handle.options |= _temperature_options(handle.temperature)
    except Exception:
        handle.unpatch()
        raise
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _refuse_inapplicable(strat: Strategy, **options: Any) -> None:
    """``ValueError`` naming the options given away from their defaults that ``strat`` does not
    use: ``layer_types`` (frequency strategies only: a relative-position rule acts in every layer's
    attention), ``dynamic_cache``/``dynamic_block`` (dynamic strategies), ``attention_path``/
    ``block_size`` (relative-position rules)."""
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
    """Relative-position rules: every rotary module's frequencies set to zero (RoPE becomes the identity, times
    each module's own attention factor, in whatever format the model consumes), and the rule applied
    inside the attention of each layer that rotates — with that layer's own frequencies, channels,
    pairing and sign, as ``probe_layers`` read them; layers without RoPE keep the model's attention."""
    from ropescale.attention import AttentionNotPluggableError, enable_truncation
    from ropescale.attention.indexers import find_indexers, hook_indexers

    if handle.layers is None:
        raise AttentionNotPluggableError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface (its layers "
            "could not be observed), so ropescale cannot tell which layers rotate and how; relative-position rules "
            "apply inside attention and cannot be used on it")
    unknown = [info for info in handle.layers if info.kind == "unknown"]
    if unknown:
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__}: layer {unknown[0].index} ({unknown[0].name}) rotates q and k in a way "
            "ropescale does not recognise (no frequency set, channel range, pairing and sign of the model "
            f"reproduces it); {strat.name} cannot be applied")
    quirks.refuse("layers", model, handle.layers, strat.name)
    rotating = [info for info in handle.layers if info.kind == "rope"]
    if not rotating:
        raise NoRotaryEmbeddingError(f"{type(model).__name__}: no attention layer rotates q and k; "
                                     f"{strat.name} has nothing to act on")
    primary = next((i.site for i in rotating if i.site.layer_type == "full_attention"), rotating[0].site)
    context = rope_context(model, modules[primary.module_name], primary.layer_type)
    if train_override is not None:
        context["original_max_position_embeddings"] = int(train_override)
    rule = strat.compute(context, handle.params)
    by_module = {}
    for info in rotating:
        module = modules[info.site.module_name]
        inv_freq = getattr(module, inv_freq_name(info.site.layer_type)).detach().clone() * info.sign  # [d/2]
        by_module[modules[info.name]] = (info, inv_freq)
    handle.context, handle.layer_types, handle.contexts = context, [None], {None: context}
    handle.sites = {info.site: context for info in rotating}
    try:
        for _, module in found:  # RoPE as the identity: zero frequencies, the modules' own scale kept
            entries = {lt: FrequencyEntry(torch.zeros_like(getattr(module, inv_freq_name(lt))),
                                          attention_scaling_of(module, lt)) for lt in layer_types_of(module)}
            frequencies = FrequencyPatch(module, entries)
            frequencies.apply()
            handle._frequencies.append(frequencies)
        handle._active = True
        handle._restore += quirks.apply_overrides("patch", model, handle, strat)
        rotaries = [m for _, m in found]
        indexers = [ix for info in rotating if info.full_mask for ix in find_indexers(modules[info.name])]
        if indexers:  # they select keys with the model's own rotation, not the identity the rule leaves
            own = {f.module: f for f in handle._frequencies}
            handle._restore.append(hook_indexers(indexers, rotaries, lambda m: own[m].own()))
        handle._restore.append(enable_truncation(
            model, rule, by_module, rotaries, path=path, block=block,
            logn=context["original_max_position_embeddings"] if logn else None,
            without_rope=any(info.kind == "none" or info.full_mask for info in handle.layers),
            full_masks=any(info.full_mask for info in handle.layers),
            temperature=handle.temperature))
    except Exception:
        handle.unpatch()
        raise
    if logn:
        handle.options |= _temperature_options(handle.temperature)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _temperature_options(rule: Temperature) -> dict[str, Any]:
    """How a handle records its query temperature: ``logn: true`` (the long-standing record), plus
    ``temperature`` for another rule."""
    return {"logn": True} if rule.kind == "logn" and not rule.params else {"temperature": rule.spec()}


def unpatch(model: nn.Module) -> None:
    """Undo the active patch of a model: its rotary modules, attention and config as they were.

    Args:
        model: a loaded HF model, patched or not (a no-op when it is not).
    """
    handle = current_patch(model)
    if handle is not None:
        handle.unpatch()

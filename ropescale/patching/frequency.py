"""Frequency strategies: each rotary module's own buffers swapped for the strategy's, per layer type (the
chosen ones; the others kept), the KV cache watched for dynamic ones, and a query temperature in attention."""

from __future__ import annotations

from typing import Any

from torch import nn

from ropescale.errors import InvalidInput
from ropescale.patching.handle import PatchHandle
from ropescale.patching.options import PatchOptions
from ropescale.rope_config import nope_layer_types
from ropescale.rotary import quirks
from ropescale.rotary.cache import CacheWatch, WatchedRotaries, decoder_of
from ropescale.rotary.frequencies import FrequencyPatch, strategy_entry
from ropescale.rotary.modules import default_layer_types, layer_types_of, rope_context, text_config_of
from ropescale.rotary.sites import RotarySite
from ropescale.strategies import Strategy

__all__ = ["PRIMARY_LAYER_TYPE", "patch_frequencies", "primary_layer_type"]

PRIMARY_LAYER_TYPE = "full_attention"  # the layer type whose context is the patch's own, where it has one


def primary_layer_type(layer_types: list) -> Any:
    """The layer type whose rotary context is the patch's (``PatchHandle.context``: the window T its
    record, log-n and the exports read): ``full_attention`` where it is among ``layer_types``, else the
    first — whatever order the caller named them in."""
    return PRIMARY_LAYER_TYPE if PRIMARY_LAYER_TYPE in layer_types else layer_types[0]


def patch_frequencies(handle: PatchHandle, strat: Strategy, found: list[tuple[str, nn.Module]],
                      modules: dict[str, nn.Module], options: PatchOptions) -> None:
    """Apply frequency strategy ``strat`` to the rotary modules ``found`` of ``handle.model`` (``modules``:
    its named modules), recording every change in ``handle``; on an error, everything is undone."""
    if strat.dynamic and options.dynamic_cache == "rerotate" and handle.layers is None:
        raise InvalidInput("dynamic_cache='rerotate' re-rotates the cached keys of the layers that rotate; this "
                           "model's attention cannot be observed (it bypasses transformers' AttentionInterface): "
                           "use 'recompute'")
    try:
        patched: list = []
        for name, module in found:
            chosen = _chosen_layer_types(handle.model, module, options.layer_types)
            _patch_module(handle, strat, (name, module), chosen, options)
            for lt in chosen:  # a family's own softmax scale under the shipped rope (quirks: DeepSeek's mscale²)
                handle.undo_with(quirks.apply_quirk_overrides("site", handle.model, handle, strat, RotarySite(name, lt),
                                                        modules))
            patched += [lt for lt in chosen if lt not in patched]
        handle.layer_types = patched
        if patched:
            handle.context = handle.contexts[primary_layer_type(patched)]
        handle.undo_with(quirks.apply_quirk_overrides("patch", handle.model, handle, strat))  # shipped temperatures (β)
        _watch_dynamic(handle, found, modules, options)
        if options.logn:
            from ropescale.attention import enable_logn

            handle.undo_with([enable_logn(handle.model, handle.context["original_max_position_embeddings"],
                                          handle.temperature, [m for _, m in found])])
            handle.record_temperature()
    except Exception:
        handle.unpatch()
        raise


def _chosen_layer_types(model: nn.Module, module: nn.Module, layer_types: list[str] | None) -> list:
    """The layer types of ``module`` to patch: ``layer_types`` as given, checked, or the module's default."""
    available = layer_types_of(module)
    chosen = list(layer_types) if layer_types is not None else default_layer_types(model, module, available)
    unknown = [t for t in chosen if t not in available]
    if not unknown:
        return chosen
    nope = [t for t in unknown if t in nope_layer_types(text_config_of(model, module))]
    if nope:
        raise InvalidInput(f"layer_types {nope}: the config's rope parameters for them are None: those layers run "
                           f"without position encoding (NoPE), there is no RoPE to scale; the layer types that "
                           f"rotate: {available}")
    raise InvalidInput(f"layer_types {unknown} not in this model's rotary module; it has {available}")


def _patch_module(handle: PatchHandle, strat: Strategy, named: tuple[str, nn.Module], chosen: list,
                  options: PatchOptions) -> None:
    """One rotary module: each chosen layer type's frequencies computed from its own context and swapped in
    (the model's own kept under ``keeps_model``), its context and layers recorded per layer type."""
    name, module = named
    entries, cache_layers = {}, {}
    for lt in chosen:
        context = rope_context(handle.model, module, lt)
        if options.window(lt) is not None:
            context["original_max_position_embeddings"] = options.window(lt)
        if context["original_max_position_embeddings"] is None and any(
                k in strat.needs for k in ("original_max_position_embeddings", "seq_len")):
            raise InvalidInput(f"{strat.name} needs original_max_position_embeddings; the config has none")
        if not strat.keeps_model:  # the model as shipped: its buffers and updates stay its own
            entries[lt] = strategy_entry(module, lt, strat, handle.params, context, options.dynamic_block)
        site = RotarySite(name, lt)
        cache_layers[lt] = [info for info in handle.layers or [] if info.kind == "rope" and info.site == site]
        handle.sites[site] = context
        handle.contexts[lt] = context
    handle.keep(FrequencyPatch(module, entries, options.dynamic_cache, cache_layers))


def _watch_dynamic(handle: PatchHandle, found: list[tuple[str, nn.Module]], modules: dict[str, nn.Module],
                   options: PatchOptions) -> None:
    """Dynamic strategies: one cache watch on the decoder recomputes (or re-rotates) what the cache holds
    whenever the frequencies change."""
    dynamic = [f for f in handle.frequency_patches if f.dynamic]
    if not dynamic:
        return
    name, _ = found[0]
    parent = modules[name.rpartition(".")[0]] if "." in name else handle.model
    watch = CacheWatch(WatchedRotaries(dynamic, options.dynamic_cache))
    handle.hook(watch.attach(decoder_of(handle.model, parent)))
    for f in dynamic:
        f.use_watch(watch)
    handle.options |= {"dynamic_cache": options.dynamic_cache, "dynamic_block": options.dynamic_block}

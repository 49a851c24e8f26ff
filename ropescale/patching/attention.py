"""Relative-position rules: every rotary module's frequencies set to zero (RoPE becomes the identity, times each
module's own attention factor, in whatever format the model consumes), and the rule applied inside the
attention of each layer that rotates — with that layer's own frequencies, channels, pairing and sign, as
``ropescale.rotary.probe.probe_layers`` read them; layers without RoPE keep the model's attention."""

from __future__ import annotations

import torch
from torch import nn

from ropescale.patching.handle import PatchHandle
from ropescale.patching.options import PatchOptions
from ropescale.rotary import quirks
from ropescale.rotary.frequencies import FrequencyEntry, FrequencyPatch
from ropescale.rotary.modules import (
    NoRotaryEmbeddingError,
    attention_scaling_of,
    inv_freq_name,
    layer_types_of,
    rope_context,
)
from ropescale.rotary.sites import LayerRope
from ropescale.strategies import Strategy

__all__ = ["patch_attention"]


def patch_attention(handle: PatchHandle, strat: Strategy, found: list[tuple[str, nn.Module]],
                    modules: dict[str, nn.Module], options: PatchOptions) -> None:
    """Apply relative-position rule ``strat`` to ``handle.model`` (``found``: its rotary modules, ``modules``:
    its named modules), recording every change in ``handle``; on an error, everything is undone."""
    model = handle.model
    rotating = _rotating_layers(handle, strat)
    primary = next((i.site for i in rotating if i.site.layer_type == "full_attention"), rotating[0].site)
    context = rope_context(model, modules[primary.module_name], primary.layer_type)
    if options.window(primary.layer_type) is not None:
        context["original_max_position_embeddings"] = options.window(primary.layer_type)
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
            handle.keep(FrequencyPatch(module, entries))
        handle.undo_with(quirks.apply_quirk_overrides("patch", model, handle, strat))
        _apply_rule(handle, rule, by_module, [m for _, m in found], modules, options)
    except Exception:
        handle.unpatch()
        raise
    if options.logn:
        handle.record_temperature()


def _rotating_layers(handle: PatchHandle, strat: Strategy) -> list[LayerRope]:
    """The layers that rotate q and k, once the model is checked to let ``strat`` act in its attention."""
    from ropescale.attention import AttentionNotPluggableError

    model = handle.model
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
    return rotating


def _apply_rule(handle: PatchHandle, rule, by_module: dict, rotaries: list[nn.Module], modules: dict[str, nn.Module],
                options: PatchOptions) -> None:
    """The rule inside attention (``ropescale.attention.enable_truncation``), and the model's key indexers
    (DeepSeek's sparse attention) kept selecting keys with the model's own rotation."""
    from ropescale.attention import enable_truncation
    from ropescale.attention.indexers import find_indexers, hook_indexers

    layers = handle.layers
    indexers = [ix for info in layers if info.kind == "rope" and info.full_mask
                for ix in find_indexers(modules[info.name])]
    if indexers:  # they select keys with the model's own rotation, not the identity the rule leaves
        own = {f.module: f for f in handle.frequency_patches}
        handle.undo_with([hook_indexers(indexers, rotaries, lambda m: own[m].own())])
    handle.undo_with([enable_truncation(
        handle.model, rule, by_module, rotaries, path=options.attention_path, block=options.block_size,
        logn=handle.context["original_max_position_embeddings"] if options.logn else None,
        without_rope=any(info.kind == "none" or info.full_mask for info in layers),
        full_masks=any(info.full_mask for info in layers),
        temperature=handle.temperature)])

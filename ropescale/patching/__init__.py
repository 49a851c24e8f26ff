"""Patch a loaded Hugging Face causal LM with a strategy, in place and reversibly.

This package orchestrates; the model side lives in ``ropescale.rotary`` (finding and probing the rotary
modules, swapping their frequencies, the KV cache, per-family quirks) and the attention side in
``ropescale.attention``. Frequency strategies swap each rotary module's own buffers, per layer type
(``ropescale.patching.frequency``); relative-position rules make RoPE an identity and move it into attention
(``ropescale.patching.attention``); a query temperature (log-n) wraps attention. What a patch changes is
kept in its ``PatchHandle`` (``ropescale.patching.handle``) and put back by ``unpatch``, so logits are
restored bit for bit. ``ropescale.patching.options`` checks a patch's options before anything changes.

Patch *after* ``from_pretrained``: loading recomputes ``inv_freq`` of rotary modules.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from torch import nn

from ropescale.errors import InvalidInput
from ropescale.patching.attention import patch_attention
from ropescale.patching.frequency import patch_frequencies
from ropescale.patching.handle import PatchHandle, current_patch
from ropescale.patching.options import DYNAMIC_CACHE_MODES, PatchOptions, patchable_rotaries
from ropescale.rotary.modules import (
    NoRotaryEmbeddingError,
    find_rotary_modules,
    layer_types_of,
    rope_context,
    rotary_sites,
    text_config_of,
)
from ropescale.rotary.probe import probe_layers
from ropescale.rotary.sites import LayerRope
from ropescale.strategies import get_strategy
from ropescale.temperature import NATIVE, Temperature, parse_temperature, shipped

__all__ = [
    "DYNAMIC_CACHE_MODES",
    "LayerRope",
    "NoRotaryEmbeddingError",
    "PatchHandle",
    "PatchOptions",
    "current_patch",
    "find_rotary_modules",
    "layer_types_of",
    "patch",
    "probe_layers",
    "rope_context",
    "unpatch",
]


def patch(model: nn.Module, strategy: str, **keywords: Any) -> PatchHandle:
    """Apply ``strategy`` to the rotary embedding of ``model`` in place.

    After ``strategy`` every argument is a keyword: an option (``PatchOptions``) or a strategy parameter.

    Args:
        model: a loaded HF model with RoPE (any family whose rotary module has ``inv_freq``).
        strategy: registry name (``ropescale strategies`` lists them).
        keywords: the options below, and the strategy's parameters (validated; ``ropescale strategies``
            lists each strategy's): every keyword not naming an option is one.

    Keyword Args:
        original_max_position_embeddings (int | dict[str, int] | None): T [tokens], or T per layer type; default config.
        layer_types (list[str] | None): for per-layer-type rotary modules (Gemma 3), which types to patch; default
            all but sliding-window types. The others keep the model's own frequencies.
        dynamic_cache (str): dynamic strategies under a KV cache: ``"recompute"`` (exact; re-runs the
            cached prefix whenever the frequencies change) or ``"rerotate"`` (re-rotates cached
            keys only; cheaper, approximate past layer 0). See ``ropescale.rotary.cache``.
        dynamic_block (int | None): dynamic strategies take L rounded up to a multiple of this [tokens], so
            the frequencies (and, with ``"recompute"``, the prefix) change once per block.
        logn (bool): also scale queries by max(1, ln(p+1)/ln(T)) (Su 2023), through the
            attention interface (``ropescale.attention.interface``); works with any strategy.
        temperature (str | dict | None): another query-temperature rule instead of log-n (``ropescale.temperature``):
            ``"llama4"`` (Llama 4's stepped one), ``"beta:beta=0.1"`` (Mistral's ``llama_4_scaling_beta``),
            ``"logn"``, a mapping, or None. Exact under the KV cache like log-n.
        attention_path (str): relative-position rules only: ``"fused"`` (default: the rule's regions in fused
            CPU kernels, about the cost of vanilla attention, with backward; on a non-CPU device
            it runs ``"flex"``), ``"flex"`` (the regions in FlexAttention, compiled on CUDA;
            eager and unfused on the CPU, where torch has no FlexAttention backward, so training
            there runs ``"fused"``), ``"blocked"`` (a Python online softmax; also what
            ``"fused"`` uses for attention dropout, and on the CPU for soft-capping) or
            ``"naive"`` (explicit n × n relative positions; the tests' oracle). All are exact and
            differentiable.
        block_size (int): relative-position rules only: query/key block of the blocked path [tokens].
    Returns:
        The ``PatchHandle``: ``handle.unpatch()`` or ``with patch(...):`` restores the model.

    Raises:
        UnknownStrategyError: unknown ``strategy`` (message lists the known ones).
        ValueError: bad parameter (names it and the allowed range); unknown layer type; model
            already patched; a model whose rotary buffers are on the meta device.
        NoRotaryEmbeddingError: no rotary module, or no ``rope_theta`` in the config.
        AttentionNotPluggableError: ``logn`` on a model whose attention bypasses the interface.
    """
    options, params = PatchOptions.split(keywords)
    strat, params = _strategy(strategy, params)
    rule, keep_own = _query_temperature(options)
    applied = replace(options, logn=True) if rule is not None else options  # a rule of ours wraps attention as logn
    found = patchable_rotaries(model, strat, applied, current_patch(model))
    modules, sites = rotary_sites(model)
    handle = PatchHandle(model, strategy, params, {}, layers=probe_layers(model, modules, sites),
                         repatch=partial(patch, model, strategy, **options.keywords(), **params))
    handle.temperature = rule or (Temperature("logn") if applied.logn else None)
    text = text_config_of(model, model)  # read before a patch changes it
    handle.own_temperature = {r: shipped(text, r) for r in (True, False)}
    if keep_own:
        handle.options["temperature"] = NATIVE
    (patch_attention if strat.kind == "attention" else patch_frequencies)(handle, strat, found, modules, applied)
    handle.activate()
    return handle


def _strategy(name: str, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(the registered strategy, its validated parameters)``; ``InvalidInput`` for a parameter it lacks (named as
    the patch option it is near, if any) or one out of range."""
    strat = get_strategy(name)
    PatchOptions.refuse_misspelled(params, strat)
    return strat, strat.validate(params)


def _query_temperature(options: PatchOptions) -> tuple[Temperature | None, bool]:
    """``(the query-temperature rule of ours, or None; whether the model keeps its shipped one)`` from
    ``temperature`` and ``logn`` (``InvalidInput`` when both are given)."""
    rule = parse_temperature(options.temperature)
    if rule is not None and options.logn:
        raise InvalidInput(f"logn=True and temperature={options.temperature!r}: name one query temperature")
    keep_own = rule is not None and rule.kind == NATIVE  # the model's shipped temperature, no rule of ours
    return (None if keep_own else rule), keep_own


def unpatch(model: nn.Module) -> None:
    """Undo the active patch of a model: its rotary modules, attention and config as they were.

    Args:
        model: a loaded HF model, patched or not (a no-op when it is not).
    """
    handle = current_patch(model)
    if handle is not None:
        handle.unpatch()

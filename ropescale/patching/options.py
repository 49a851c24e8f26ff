"""The options of a patch — ``ropescale.patching.patch``'s keywords beside the strategy's parameters — and
the checks a model and its options pass before anything changes."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from ropescale.errors import InvalidInput
from ropescale.rotary import quirks
from ropescale.rotary.modules import NoRotaryEmbeddingError, find_rotary_modules
from ropescale.strategies import Strategy

__all__ = ["ATTENTION_PATHS", "DYNAMIC_CACHE_MODES", "PatchOptions", "patchable_rotaries"]

DYNAMIC_CACHE_MODES = ("recompute", "rerotate")
ATTENTION_PATHS = ("fused", "flex", "blocked", "naive")


@dataclass(frozen=True)
class PatchOptions:
    """How a strategy is applied (``ropescale.patching.patch`` documents each); the defaults are the
    options left out."""

    original_max_position_embeddings: int | dict[str, int] | None = None  # one T, or T per layer type
    layer_types: list[str] | None = None
    dynamic_cache: str = "recompute"
    dynamic_block: int = 1
    logn: bool = False
    attention_path: str = "fused"
    block_size: int = 512
    temperature: Any = None

    @classmethod
    def split(cls, keywords: dict[str, Any]) -> tuple[PatchOptions, dict[str, Any]]:
        """``patch``'s keywords as ``(options, the strategy's parameters)``: a keyword naming an option is
        the option (as when ``patch`` spelled each one out), every other one a parameter of the strategy."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in keywords.items() if k in names}), {
            k: v for k, v in keywords.items() if k not in names}

    @classmethod
    def refuse_misspelled(cls, params: dict[str, Any], strat: Strategy) -> None:
        """``InvalidInput`` for a keyword ``split`` took for a parameter that ``strat`` does not have and whose nearest
        name is an option's (``dynamic_cach=``): the strategy's own refusal would list its parameters only."""
        known = {p.name for p in strat.params}
        options = {f.name for f in fields(cls)}
        for key in params:
            if key not in known:
                near = difflib.get_close_matches(key, sorted(known | options), n=1)
                if near and near[0] in options:
                    raise InvalidInput(f"{strat.name} has no parameter {key!r} and patch has no option {key!r} "
                                       f"(did you mean the option {near[0]!r}?)")

    def window(self, layer_type: str | None) -> int | None:
        """The training window T [tokens] given for ``layer_type`` (None: the model's own): the one T, or the
        layer type's entry of a mapping (how a saved patch whose layer types have different windows records
        them)."""
        train = self.original_max_position_embeddings
        if isinstance(train, dict):
            if layer_type not in train:
                raise InvalidInput(f"original_max_position_embeddings={train!r} names no window for "
                                   + (f"layer type {layer_type!r}" if layer_type else
                                      "this model, whose layers have no types: give one T")
                                   + (f"; it names {', '.join(map(repr, train))}" if layer_type else ""))
            train = train[layer_type]
        return None if train is None else int(train)

    def keywords(self) -> dict[str, Any]:
        """The options as ``patch`` keywords (every one, defaults included)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check(self) -> None:
        """``InvalidInput`` (one line) for an option outside its values."""
        train = self.original_max_position_embeddings
        values = list(train.values()) if isinstance(train, dict) and train else [train]
        keys_ok = not isinstance(train, dict) or all(isinstance(k, str) for k in train)
        if train is not None and (not keys_ok or any(isinstance(t, bool) or not isinstance(t, int) or t < 2
                                                     for t in values)):
            raise InvalidInput(f"original_max_position_embeddings={train!r} must be a whole number of tokens >= 2 "
                               "(the training window), or one per layer type ({'full_attention': 8192, ...})")
        layers = self.layer_types
        if layers is not None and (not isinstance(layers, list | tuple) or not layers
                                   or not all(isinstance(t, str) for t in layers)):
            raise InvalidInput(f"layer_types={layers!r} must be a non-empty list of layer type names (e.g. "
                               "['full_attention']), or None for the default")
        if not isinstance(self.logn, bool):
            raise InvalidInput(f"logn={self.logn!r} must be True or False")
        if self.dynamic_cache not in DYNAMIC_CACHE_MODES:
            raise InvalidInput(f"dynamic_cache={self.dynamic_cache!r}; choose one of {', '.join(DYNAMIC_CACHE_MODES)}")
        if isinstance(self.dynamic_block, bool) or not isinstance(self.dynamic_block, int) or self.dynamic_block < 1:
            raise InvalidInput(f"dynamic_block={self.dynamic_block!r} must be a whole number >= 1")
        if self.attention_path not in ATTENTION_PATHS:
            raise InvalidInput(f"attention_path={self.attention_path!r}; choose 'fused', 'blocked' or 'naive' "
                               "(or 'flex')")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidInput(f"block_size={self.block_size!r} must be a whole number >= 1")

    def refuse_inapplicable(self, strat: Strategy) -> None:
        """``InvalidInput`` naming the options given away from their defaults that ``strat`` does not use:
        ``layer_types`` (frequency strategies only: a relative-position rule acts in every layer's attention),
        ``dynamic_cache``/``dynamic_block`` (dynamic strategies), ``attention_path``/``block_size``
        (relative-position rules)."""
        defaults = PatchOptions()
        applies = {"layer_types": strat.kind != "attention", "dynamic_cache": strat.dynamic,
                   "dynamic_block": strat.dynamic, "attention_path": strat.kind == "attention",
                   "block_size": strat.kind == "attention"}
        unused = [f"{k}={getattr(self, k)!r}" for k in applies
                  if getattr(self, k) != getattr(defaults, k) and not applies[k]]
        if unused:
            raise InvalidInput(f"{strat.name} does not use {', '.join(unused)} (layer_types: frequency strategies; "
                               "dynamic_cache, dynamic_block: dynamic strategies; attention_path, block_size: "
                               "truncation rules)")


def patchable_rotaries(model: nn.Module, strat: Strategy, options: PatchOptions,
                       current: Any) -> list[tuple[str, nn.Module]]:
    """The model's rotary modules (``find_rotary_modules``) once the model, its active patch ``current``
    (None: none) and ``options`` are checked for ``strat``; ``InvalidInput`` (one line) otherwise."""
    # the rotary buffers only: accelerate's offloading (device_map) leaves offloaded weights on meta
    # but keeps buffers on a real device; a rotary buffer on meta has no frequencies to read
    meta = [n for n, m in find_rotary_modules(model) if any(b.is_meta for b in m.buffers(recurse=False))]
    if meta:
        raise InvalidInput(f"{type(model).__name__} is on the meta device ({meta[0]}'s inv_freq has a shape but no "
                           "values): no weights to patch; load the model with its weights (from_pretrained, or "
                           "to_empty() then load_state_dict) first")
    options.check()
    if current is not None:
        raise InvalidInput(f"model is already patched with {current.strategy!r}; call unpatch() first")
    found = find_rotary_modules(model)
    if not found:
        quirks.refuse("unrotated", model)
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__} has no rotary embedding: no submodule holds an `inv_freq` "
            "(or `<layer_type>_inv_freq`) buffer; models with learned or ALiBi positions, or none, cannot be "
            "patched")
    options.refuse_inapplicable(strat)
    quirks.refuse("modules", model, found)
    return found

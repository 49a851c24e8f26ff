"""Key-selecting indexers under a relative-position rule: they keep the model's own rotation.

Sparse-attention families (DeepSeek-V3.2's DSA and its descendants GLM-MoE-DSA, dots3, A.X K2,
HY-V4; Qwen4's QSA) give each attention layer an *indexer*, a small scorer that picks, per query,
the keys the layer may attend to (``index_topk`` / ``indexer_budget`` of them). The indexer rotates its
own queries and keys with the position embeddings the layer receives — the model's rotary output.
A relative-position rule sets the rotary modules' frequencies to zero (RoPE as the identity, the rule rotates
inside attention), so without this module the indexer would score position-blind and select other
keys: at lengths inside the rule's window the patched model would no longer equal the model.

``hook_indexers`` gives every indexer the rotary output the model computes with its own frequencies
at the same call (same positions, same layer type), while attention applies the rule over the keys
the indexer selected. A rule's positions are not the indexer's: past the window the indexer still
selects with the model's own RoPE, which is what it was trained with.

An indexer is a submodule of a rotating attention layer that reads masks as built (``LayerRope.full_mask``)
whose ``forward`` takes ``position_embeddings``. Its argument is matched to the rotary call that produced
it by tensor identity; an argument no rotary call produced is refused (``InvalidInput``), never guessed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.errors import InvalidInput

__all__ = ["find_indexers", "hook_indexers"]


def find_indexers(attention: nn.Module) -> list[nn.Module]:
    """The submodules of ``attention`` (itself excluded) whose ``forward`` takes ``position_embeddings``."""
    found = []
    for m in attention.modules():
        if m is attention:
            continue
        try:
            params = inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            continue
        if "position_embeddings" in params:
            found.append(m)
    return found


@dataclass
class _Call:
    """One rotary call of the current forward: what it returned (the identity rotation) and how it was called."""

    output: Any
    args: tuple
    kwargs: dict
    real: Any = None  # the model's own rotary output for the same call, computed when an indexer asks


@dataclass
class _Indexers:
    rotation: Callable[[nn.Module], AbstractContextManager]
    calls: dict = field(default_factory=dict)  # (rotary module, layer type) → _Call


def _first_tensor(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def hook_indexers(indexers: list[nn.Module], rotaries: list[nn.Module],
                  rotation: Callable[[nn.Module], AbstractContextManager]) -> Callable[[], None]:
    """Give each module of ``indexers`` the model's own rotary output in place of the patched one.

    ``rotaries``: the model's rotary modules (their frequencies zeroed by the rule); ``rotation(module)``:
    a context manager under which ``module`` holds its own frequencies again. Returns the function that
    removes the hooks. The model's own output is computed once per rotary call, when an indexer first
    asks for it, by the module's ``forward`` on the call's own arguments (no host-device sync).
    """
    state = _Indexers(rotation)
    hooks = []

    def record(module, args, kwargs, output):
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        state.calls[(module, layer_type)] = _Call(output, args, kwargs)

    def give_real(indexer, args, kwargs):
        signature = inspect.signature(indexer.forward)
        bound = signature.bind(*args, **kwargs)
        given = _first_tensor(bound.arguments.get("position_embeddings"))
        for (module, _), call in state.calls.items():
            if given is not None and given is _first_tensor(call.output):
                if call.real is None:
                    with torch.no_grad(), state.rotation(module):
                        call.real = module.forward(*call.args, **call.kwargs)
                bound.arguments["position_embeddings"] = call.real
                return bound.args, bound.kwargs
        raise InvalidInput(f"{type(indexer).__name__} (a key-selecting indexer) receives position embeddings that "
                           "no rotary module of the model produced in this forward; a relative-position rule cannot "
                           "keep its selection exact")

    for r in rotaries:
        hooks.append(r.register_forward_hook(record, with_kwargs=True))
    for ix in indexers:
        hooks.append(ix.register_forward_pre_hook(give_real, with_kwargs=True))

    def remove() -> None:
        for h in hooks:
            h.remove()
        state.calls.clear()

    return remove

"""FSDP2 with torch's ``fully_shard`` where accelerate will not shard: processes on the CPU (gloo).

accelerate 1.15 turns an FSDP plugin into plain data parallelism on CPU processes without a
word (``Accelerator(cpu=True)`` makes them a ``MULTI_CPU`` group and drops the plugin), so there
the training loop shards the model itself, as accelerate's FSDP2 does on GPUs: every decoder
layer (the classes in the model's ``_no_split_modules``) is one ``fully_shard`` unit, and the
root unit holds the rest — embeddings, final norm, LM head. Parameters, gradients and AdamW's
moments are split over the processes (``DTensor`` ``Shard(0)``); a unit's parameters are
gathered for its forward and backward and freed after (FULL_SHARD, ``reshard_after_forward``).

The root unit is ``ShardedModel``, whose forward runs a function of the causal LM — the chunked
loss (``ropescale.lm_head``: the LM head over chunks of positions, recomputed in backward),
held-out perplexity, sequence parallelism's loss — so the LM head's weight is gathered inside
the sharded forward where the chunked loss reads it (outside a forward it is a shard).

Checkpoints: the sharded model and optimiser states through torch's distributed checkpoint
(``torch.distributed.checkpoint``: each process writes its shards into ``<checkpoint>/sharded``),
next to accelerate's ``save_state`` (RNG states, scheduler), so a resumed run continues exactly.
The saved model: the full state dict gathered to the main process (``full_state_dict``).

Sources: torch ``torch.distributed.fsdp.fully_shard`` (FSDP2; Zhao et al. 2023, arXiv:2304.11277
for FSDP), ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["SHARDED", "ShardedModel", "full_state_dict", "load_sharded", "save_sharded", "shard_model"]

SHARDED = "sharded"  # inside a checkpoint folder: the distributed checkpoint of model and optimiser


class ShardedModel(nn.Module):
    """The root ``fully_shard`` unit around a causal LM: ``sharded(fn, *args)`` returns
    ``fn(model, *args)`` computed inside the sharded forward (root parameters gathered)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def shard_model(model: nn.Module) -> ShardedModel:
    """``fully_shard`` each decoder layer of ``model`` (``_no_split_modules``), then the root
    ``ShardedModel`` around it, over all processes of the default process group. Raises
    ``ValueError`` when the model names no decoder layer class, or none of its modules is one."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layer to shard by (_no_split_modules: "
                         f"{sorted(names) or 'none'})")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    wrapper = ShardedModel(model)
    fully_shard(wrapper, reshard_after_forward=True)
    return wrapper


def _states(model: ShardedModel, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_sharded(model: ShardedModel, optimizer, folder: Path) -> None:
    """Every process writes its shards of the model and optimiser states into ``folder/sharded``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_states(model, optimizer), checkpoint_id=str(Path(folder) / SHARDED))


def load_sharded(model: ShardedModel, optimizer, folder: Path) -> None:
    """Load what ``save_sharded`` wrote (same number of processes) into ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _states(model, optimizer)
    dcp.load(state, checkpoint_id=str(Path(folder) / SHARDED))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state_dict(model: ShardedModel) -> dict[str, torch.Tensor]:
    """The causal LM's full state dict (names as ``model.model.state_dict()``), gathered to the CPU
    of the main process (the others get an empty dict). Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("model."): v for k, v in full.items()}

"""``tiled_mlp``: each decoder layer's MLP computed over shards of the sequence, through DeepSpeed's
``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``; ``pip install "ropescale[scale]"``).

An MLP's activations — gate, up, their product: 3·f values per token, f the intermediate size
(14,336 for Llama 3 8B: 84 KiB a token in bf16, 10.5 GiB at 128k) — are what the one decoder layer
recomputed in backward holds at its peak. ``TiledMLP`` runs the MLP on ``shards`` slices of the
sequence without autograd and, in backward, recomputes it slice by slice with the gradient of each,
so only one slice's activations exist at a time; the output and the gradients are those of the
whole MLP (float sums in another order). The MLP of each decoder layer — its ``mlp`` submodule, as
transformers' decoder layers name it — gets an instance ``forward`` that calls ``TiledMLP.apply``
with the module's own forward; its weights are untouched, so saving, LoRA, checkpointing and
FSDP see the same module. Shards: the given count, or ⌈n / hidden⌉ per call (DeepSpeed's and
ALST's choice: slices about as long as the model is wide).

Source: Arctic Long Sequence Training (Bekman et al. 2025, arXiv:2506.13996), DeepSpeed's
``TiledMLP``. Shapes: x ``[b, s, hidden]`` (or ``[s, hidden]``) in, the same out.
"""

from __future__ import annotations

import math

from ropescale.runs.config import ConfigError

__all__ = ["enable_tiled_mlp", "tiled_mlp_available"]


def tiled_mlp_available() -> bool:
    """Whether DeepSpeed's ``TiledMLP`` can be imported."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: F401
    except Exception:  # noqa: BLE001 — DeepSpeed's import raises more than ImportError without its ops
        return False
    return True


def _mlps(model) -> list:
    """Each decoder layer's ``mlp`` submodule (named so by transformers' decoder layers)."""
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp" and ".layers." in f".{name}"]


def enable_tiled_mlp(model, shards: int | None = None, source: str = "config") -> int:
    """Tile every decoder layer's MLP of ``model`` over ``shards`` slices of the sequence (None: ⌈n / hidden⌉
    per call); returns how many MLPs. Raises ``ConfigError`` (one line) without DeepSpeed or without an MLP
    found."""
    if not tiled_mlp_available():
        raise ConfigError(f"{source}: tiled_mlp: DeepSpeed's TiledMLP is not installed: pip install 'ropescale[scale]'")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlps = _mlps(model)
    if not mlps:
        raise ConfigError(f"{source}: tiled_mlp: {type(model).__name__} has no decoder-layer `mlp` module to tile")
    for mlp in mlps:
        own = mlp.forward  # the bound forward of this instance

        def tiled(x, *args, _own=own, _mlp=mlp, **kwargs):
            if args or kwargs:  # an MLP taking more than the hidden states: as it is
                return _own(x, *args, **kwargs)
            n = shards or max(1, math.ceil(x.shape[-2] / x.shape[-1]))
            params = [p for p in _mlp.parameters() if p.requires_grad]
            return TiledMLP.apply(lambda _module, part: _own(part), _mlp, x, n, params)

        mlp.forward = tiled
    return len(mlps)

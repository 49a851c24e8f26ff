"""Per-token modules computed over slices of the sequence through DeepSpeed's ``TiledMLP``
(``deepspeed.runtime.sequence_parallel.ulysses_sp``; ``pip install "ropescale[scale]"``):
``tiled_mlp`` (each decoder layer's MLP) and ``tiled_norms`` (each decoder layer's norms and the
final one).

An MLP's activations — gate, up, their product: 3·f values per token, f the intermediate size
(14,336 for Llama 3 8B: 84 KiB a token in bf16, 10.5 GiB at 128k) — are what the one decoder layer
recomputed in backward holds at its peak. Next come the RMSNorms: transformers' eager RMSNorm
computes in float32, and its autograd keeps the float32 input and normalised values and, in
backward, makes about five more float32 [n, hidden] temporaries (2 GiB each for Llama 3 8B at
128k) — what a fused norm (Liger's, torch's CUDA ``_fused_rms_norm``) avoids by saving only the
input and 1/rms.

``TiledMLP`` runs a module on ``shards`` slices of the sequence without autograd, keeps only its
input, and in backward recomputes it slice by slice with each slice's gradient, so only one
slice's intermediates exist at a time; the output and the gradients are the whole module's
(float sums in another order; a norm is per token, so its output is bit for bit the same). Each
tiled module gets an instance ``forward`` that calls ``TiledMLP.apply`` with its own forward; its
weights are untouched, so saving, LoRA, checkpointing and FSDP see the same module; each slice runs
under the forward's autocast state, in backward too (``TiledMLP`` itself does not restore it, and
backward runs outside the forward's autocast). Shards: the
given count, or ⌈n / hidden⌉ per call (DeepSpeed's and ALST's choice: slices about as long as the
model is wide).

Source: Arctic Long Sequence Training (Bekman et al. 2025, arXiv:2506.13996), DeepSpeed's
``TiledMLP``. Shapes: x ``[b, s, hidden]`` (or ``[s, hidden]``) in, the same out.
"""

from __future__ import annotations

import math

import torch

from ropescale.runs.config import ConfigError

__all__ = ["enable_tiled_mlp", "enable_tiled_norms", "tiled_mlp_available"]


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


def _hidden_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.hidden_size


def _norms(model) -> list:
    """The norms over the residual stream: modules whose class name ends in ``Norm`` with one weight of
    ``[hidden]`` values (each decoder layer's input / post-attention norms, Gemma's pre/post-feedforward
    ones, the final ``norm``); per-head ``q_norm`` / ``k_norm`` over ``[head_dim]`` are left as they are."""
    hidden = _hidden_size(model)
    out = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__.endswith("Norm") and weight is not None and tuple(weight.shape) == (hidden,):
            out.append(module)
    return out


def _tile(module, shards: int | None, name: str) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    own = module.forward  # the bound forward of this instance

    def tiled(x, *args, _own=own, _module=module, **kwargs):
        if args or kwargs or x.dim() < 2:  # a module taking more than the hidden states: as it is
            return _own(x, *args, **kwargs)
        n = shards or max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        params = [p for p in _module.parameters() if p.requires_grad]
        # TiledMLP recomputes the module in backward, where the forward's autocast is no longer on (the
        # engine runs backward outside it): each slice runs under the forward's autocast state, as
        # torch.utils.checkpoint's recomputation does
        kind = x.device.type
        on, dtype = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)

        def run(_m, part):
            with torch.autocast(kind, dtype=dtype, enabled=on):
                return _own(part)

        return TiledMLP.apply(run, _module, x, n, params)

    tiled.ropescale_tiled = name
    module.forward = tiled


def _enable(model, modules: list, shards: int | None, key: str, what: str, source: str) -> int:
    if not tiled_mlp_available():
        raise ConfigError(f"{source}: {key}: DeepSpeed's TiledMLP is not installed: pip install 'ropescale[scale]'")
    if not modules:
        raise ConfigError(f"{source}: {key}: {type(model).__name__} has no {what} to tile")
    for module in modules:
        if getattr(module.forward, "ropescale_tiled", None) != key:  # once: a second call keeps one tiling
            _tile(module, shards, key)
    return len(modules)


def enable_tiled_mlp(model, shards: int | None = None, source: str = "config") -> int:
    """Tile every decoder layer's MLP of ``model`` over ``shards`` slices of the sequence (None: ⌈n / hidden⌉
    per call); returns how many MLPs. Raises ``ConfigError`` (one line) without DeepSpeed or without an MLP
    found."""
    return _enable(model, _mlps(model), shards, "tiled_mlp", "decoder-layer `mlp` module", source)


def enable_tiled_norms(model, shards: int | None = None, source: str = "config") -> int:
    """Tile every norm over the residual stream of ``model`` (``_norms``) over ``shards`` slices of the
    sequence (None: ⌈n / hidden⌉ per call); returns how many norms. Raises ``ConfigError`` (one line) without
    DeepSpeed or without such a norm."""
    return _enable(model, _norms(model), shards, "tiled_norms", "norm over [hidden]", source)

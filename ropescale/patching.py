"""Patch a loaded Hugging Face causal LM's rotary embedding with a strategy, reversibly.

transformers 5.x models hold one rotary module (``model.model.rotary_emb`` and kin) that the
base model calls once per forward to build ``(cos, sin)`` for every layer. We find it
generically — any submodule with an ``inv_freq`` buffer — and swap it for a
``ScaledRotaryEmbedding`` driven by the strategy. The original module object is kept
untouched and put back by ``unpatch``, so logits are restored bit for bit.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``, smaller than
``head_dim`` for partial-rotary models, which we honour by reading d from the module).

Patch *after* ``from_pretrained``: loading recomputes ``inv_freq`` of rotary modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ropescale.strategies import Strategy, get_strategy

__all__ = ["NoRotaryEmbeddingError", "PatchHandle", "ScaledRotaryEmbedding", "patch", "unpatch",
           "current_patch", "find_rotary_modules", "rope_context"]

_HANDLE_ATTR = "_ropescale_patch"


class NoRotaryEmbeddingError(ValueError):
    """The model has no rotary-embedding module that ropescale can patch."""


class ScaledRotaryEmbedding(nn.Module):
    """Drop-in rotary module: ``forward(x, position_ids, layer_type=None) -> (cos, sin)``.

    Args:
        strategy: a frequency strategy from the registry.
        params: its validated parameters.
        context: ``dim``, ``rope_theta``, ``original_max_position_embeddings``.
        device: where ``inv_freq`` lives (the original module's buffer device).

    ``x`` only gives dtype and device; ``position_ids`` ``[b, s]`` int. Returns ``cos``, ``sin``
    ``[b, s, d]`` in ``x.dtype`` built as ``cat(freqs, freqs)`` (the rotate-half layout of every
    HF RoPE family) times the strategy's attention factor. Dynamic strategies recompute the
    frequencies from ``L = max(position_ids) + 1`` on each forward: one scale for the whole
    forward, as transformers' ``dynamic`` type does.
    """

    def __init__(self, strategy: Strategy, params: dict[str, Any], context: dict[str, Any],
                 device: torch.device):
        super().__init__()
        self.strategy, self.params, self.context = strategy, params, dict(context)
        start = {**self.context, "seq_len": self.context["original_max_position_embeddings"]}
        inv_freq, self.attention_scaling = strategy.compute(start, params)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._cached_len: int | None = None

    def _update(self, position_ids: torch.Tensor) -> None:
        seq_len = int(position_ids.max()) + 1
        if seq_len != self._cached_len:
            inv_freq, self.attention_scaling = self.strategy.compute(
                {**self.context, "seq_len": seq_len}, self.params)
            self.inv_freq = inv_freq.to(self.inv_freq.device)
            self._cached_len = seq_len

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        if self.strategy.dynamic:
            self._update(position_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, d]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy.name}, params={self.params}, dim={self.context['dim']}"


@dataclass
class PatchHandle:
    """What ``patch`` changed; ``unpatch()`` (or leaving the ``with`` block) restores it."""

    model: nn.Module
    strategy: str
    params: dict[str, Any]
    context: dict[str, Any]
    _swaps: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(self._swaps)

    def unpatch(self) -> None:
        for parent, attr, original in reversed(self._swaps):
            setattr(parent, attr, original)
        self._swaps.clear()
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the patch (how ``ropescale.save_patched`` stores it)."""
        return {"strategy": self.strategy, "params": self.params,
                "original_max_position_embeddings": self.context["original_max_position_embeddings"]}

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every submodule holding an ``inv_freq`` buffer."""
    return [(n, m) for n, m in model.named_modules() if "inv_freq" in m._buffers]


def _config_of(model: nn.Module, module: nn.Module):
    cfg = getattr(module, "config", None) or getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_context(model: nn.Module, module: nn.Module) -> dict[str, Any]:
    """``dim``, ``rope_theta`` and ``original_max_position_embeddings`` for a rotary module.

    ``dim`` comes from the module's own ``inv_freq`` (so partial rotary is honoured);
    ``rope_theta`` from ``config.rope_parameters`` (v5) or the legacy ``config.rope_theta``;
    the training window from ``rope_parameters["original_max_position_embeddings"]`` or
    ``config.max_position_embeddings``.
    """
    cfg = _config_of(model, module)
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    if theta is None:
        raise NoRotaryEmbeddingError(
            f"found a rotary module ({type(module).__name__}) but no rope_theta in the model's "
            "config (looked in config.rope_parameters and config.rope_theta)")
    orig = (rp.get("original_max_position_embeddings") if isinstance(rp, dict) else None) \
        or getattr(cfg, "max_position_embeddings", None)
    return {"dim": 2 * module.inv_freq.numel(), "rope_theta": float(theta),
            "original_max_position_embeddings": orig}


def current_patch(model: nn.Module) -> PatchHandle | None:
    """The active ``PatchHandle`` of ``model``, or None."""
    return getattr(model, _HANDLE_ATTR, None)


def patch(model: nn.Module, strategy: str, *, original_max_position_embeddings: int | None = None,
          **params: Any) -> PatchHandle:
    """Apply ``strategy`` to every rotary module of ``model`` in place.

    Args:
        model: a loaded HF model with RoPE (any family whose rotary module has ``inv_freq``).
        strategy: registry name (``ropescale strategies`` lists them).
        original_max_position_embeddings: training window L_train [tokens]; default from config.
        **params: the strategy's parameters (validated).

    Returns a ``PatchHandle``; ``handle.unpatch()`` or ``with patch(...):`` restores the model.

    Raises:
        UnknownStrategyError: unknown ``strategy`` (message lists the known ones).
        ValueError: bad parameter (names it and the allowed range); model already patched.
        NoRotaryEmbeddingError: no module with an ``inv_freq`` buffer, or no ``rope_theta``.
    """
    strat = get_strategy(strategy)
    params = strat.validate(params)
    if current_patch(model) is not None:
        raise ValueError(f"model is already patched with {current_patch(model).strategy!r}; "
                         "call unpatch() first")
    found = find_rotary_modules(model)
    if not found:
        raise NoRotaryEmbeddingError(
            f"{type(model).__name__} has no rotary embedding: no submodule holds an `inv_freq` "
            "buffer (models with learned, ALiBi or sinusoidal positions cannot be patched)")
    modules = dict(model.named_modules())
    handle = PatchHandle(model, strategy, params, {})
    for name, module in found:
        context = rope_context(model, module)
        if original_max_position_embeddings is not None:
            context["original_max_position_embeddings"] = int(original_max_position_embeddings)
        if context["original_max_position_embeddings"] is None and any(
                k in strat.needs for k in ("original_max_position_embeddings", "seq_len")):
            raise ValueError(f"{strategy} needs original_max_position_embeddings; the config has none")
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        replacement = ScaledRotaryEmbedding(strat, params, context, module.inv_freq.device)
        setattr(parent, attr, replacement)
        handle._swaps.append((parent, attr, module))
        handle.context = context
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def unpatch(model: nn.Module) -> None:
    """Undo the active patch of ``model`` (no-op when none)."""
    handle = current_patch(model)
    if handle is not None:
        handle.unpatch()

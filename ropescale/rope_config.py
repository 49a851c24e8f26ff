"""One reader for a model's RoPE settings in its transformers config: rotary dim d, base
``rope_theta`` and training window T (``original_max_position_embeddings``).

Everything that needs them — patching a loaded model (``ropescale.rotary.rope_context``),
``ropescale inspect``, sweeps and fine-tuning through ``ropescale.models.model_rope_config`` —
reads them here, so they cannot disagree. Where transformers 5 keeps them:

- ``rope_theta``: ``config.rope_parameters["rope_theta"]``, nested per layer type for models
  with per-type frequencies (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``,
  different θ each); legacy configs: ``config.rope_theta``.
- T: ``rope_parameters["original_max_position_embeddings"]`` (scaled configs), else the config's
  own ``original_max_position_embeddings`` (Phi-3 keeps it there even unscaled), else
  ``max_position_embeddings``.
- d = ``head_dim`` (or ``hidden_size / num_attention_heads``) × ``partial_rotary_factor``, made
  even; a loaded module's ``inv_freq`` gives it exactly (``dim=`` overrides).

Multimodal configs are read through ``get_text_config()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ropescale.errors import InvalidInput, RopescaleError

__all__ = [
    "NoRopeConfigError",
    "RopeConfig",
    "config_layer_type",
    "layer_rope_parameters",
    "rope_config_of",
    "text_config",
    "training_window",
]


class NoRopeConfigError(RopescaleError, ValueError):
    """The config has no RoPE settings (no ``rope_theta``): not a rotary-embedding model."""


@dataclass(frozen=True)
class RopeConfig:
    """d, b and T of one layer type.

    dim: rotary dim d (even) [channels]; rope_theta: base b; original_max_position_embeddings:
    training window T [tokens], None when the config has no window at all; rope_parameters: the
    layer type's own transformers ``rope_parameters`` (a copy; ``rope_type`` and its keys);
    layer_type: the layer type read (None for a config with one set of rope parameters);
    dual_chunk_attention_config: the config's own (Qwen2.5-1M: ``chunk_size``, ``local_size``,
    ``original_max_position_embeddings`` [tokens]; a copy), None when it has none.
    """

    dim: int
    rope_theta: float
    original_max_position_embeddings: int | None
    rope_parameters: dict[str, Any]
    layer_type: str | None = None
    dual_chunk_attention_config: dict[str, Any] | None = None

    def context(self) -> dict[str, Any]:
        """The strategies' context arguments ``dim``, ``rope_theta``, ``original_max_position_embeddings``
        and, where the config has one, ``dual_chunk_attention_config`` (DCA's defaults)."""
        out = {"dim": self.dim, "rope_theta": self.rope_theta,
               "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.dual_chunk_attention_config is not None:
            out["dual_chunk_attention_config"] = dict(self.dual_chunk_attention_config)
        return out


def text_config(config):
    """The text part of a (possibly multimodal) transformers config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_layer_type(config, layer_type: str | None = None) -> str | None:
    """The layer type whose rope parameters are read: None for a config with one set of them;
    for a per-layer-type config (Gemma 3) ``layer_type``, or when None ``full_attention`` if there
    is one (the layers long context reaches), else the first type. Raises ``ValueError`` for a
    ``layer_type`` the config does not have."""
    rp = getattr(text_config(config), "rope_parameters", None) or {}
    nested = [k for k, v in rp.items() if isinstance(v, dict)] if isinstance(rp, dict) else []
    if not nested:
        return None
    if layer_type is None:
        return "full_attention" if "full_attention" in nested else nested[0]
    if layer_type not in nested:
        raise InvalidInput(f"layer type {layer_type!r} not in the config's rope_parameters; it has {sorted(nested)}")
    return layer_type


def layer_rope_parameters(config, layer_type: str | None = None) -> dict[str, Any]:
    """The ``rope_parameters`` of ``layer_type`` (a copy; which type: ``config_layer_type``), {}
    for a config without them."""
    rp = getattr(text_config(config), "rope_parameters", None) or {}
    if not isinstance(rp, dict):
        return {}
    chosen = config_layer_type(config, layer_type)
    return dict(rp if chosen is None else rp[chosen])


def training_window(config, layer_type: str | None = None) -> int | None:
    """T [tokens]: the rope parameters' ``original_max_position_embeddings``, else the config's own
    (Phi-3), else its ``dual_chunk_attention_config``'s (Qwen2.5-1M: 262144, where
    ``max_position_embeddings`` says 1010000), else ``max_position_embeddings``, else, for a model
    whose attention is local only (RecurrentGemma: no ``max_position_embeddings``), its
    ``attention_window_size``, the farthest any key is seen; None when the config has none of them."""
    text = text_config(config)
    dca = getattr(text, "dual_chunk_attention_config", None)
    orig = (layer_rope_parameters(text, layer_type).get("original_max_position_embeddings")
            or getattr(text, "original_max_position_embeddings", None)
            or (dca.get("original_max_position_embeddings") if isinstance(dca, dict) else None)
            or getattr(text, "max_position_embeddings", None)
            or getattr(text, "attention_window_size", None))
    return None if orig is None else int(orig)


def _config_dim(text, rp: dict[str, Any], layer_type: str | None = None) -> int:
    """The rotary dim from the config: head_dim (the first ``layer_type`` layer's own where the
    config sets it per layer: Gemma 4's global layers are wider) × partial_rotary_factor."""
    per_layer, types = getattr(text, "per_layer_config", None), getattr(text, "layer_types", None)
    if per_layer is not None and types and layer_type in types:
        text = per_layer[list(types).index(layer_type)]
    try:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    except AttributeError:
        raise NoRopeConfigError(f"{type(text).__name__} names no head_dim, hidden_size or num_attention_heads at its "
                                "top level (its sub-models have their own): the rotary dim cannot be read from the "
                                "config; load the model (patching reads it from the rotary module)") from None
    factor = rp.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
    if rp.get("rope_type") == "proportional":  # Gemma 4: every pair is in the exponent θ^(-2i/head_dim); the
        factor = 1.0  # pairs past partial_rotary_factor have frequency 0 (as the loaded module's inv_freq)
    dim = int(head_dim * factor)
    return dim - dim % 2


def rope_config_of(config, layer_type: str | None = None, *, dim: int | None = None) -> RopeConfig:
    """d, b and T of ``layer_type`` (see ``layer_rope_parameters`` for None) from a transformers
    config. ``dim``: the rotary dim when it is known exactly (2 · len(inv_freq) of a loaded rotary
    module); otherwise computed from the config. Raises ``NoRopeConfigError`` when the config has
    no ``rope_theta``."""
    text = text_config(config)
    rp = layer_rope_parameters(text, layer_type)
    theta = rp.get("rope_theta")
    theta = theta if theta is not None else getattr(text, "rope_theta", None)
    if theta is None:
        raise NoRopeConfigError(f"{type(text).__name__} has no rope_theta (looked in config.rope_parameters and "
                                "config.rope_theta): not a RoPE model")
    chosen = config_layer_type(text, layer_type)
    dual = getattr(text, "dual_chunk_attention_config", None)
    return RopeConfig(int(dim) if dim is not None else _config_dim(text, rp, chosen), float(theta),
                      training_window(text, layer_type), rp, chosen, dict(dual) if isinstance(dual, dict) else None)

"""One reader for a model's RoPE settings in its transformers config: rotary dim d, base
``rope_theta`` and training window T (``original_max_position_embeddings``).

Everything that needs them — patching a loaded model (``ropescale.rotary.rope_context``),
``ropescale inspect``, sweeps and fine-tuning through ``ropescale.models.model_rope_config`` —
reads them here, so they cannot disagree. Where transformers 5 keeps them:

- ``rope_theta``: ``config.rope_parameters["rope_theta"]``, nested per layer type for models
  with per-type frequencies (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``,
  different θ each; ``per_layer_type``); legacy configs: ``config.rope_theta``. A layer type whose
  rope parameters are None runs without position encoding (NoPE: Beam's and Ergo's
  ``full_attention`` layers, ``nope_layer_types``): nothing of it is read.
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
    "nope_layer_types",
    "per_layer_type",
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


_FLAT_KEYS = ("rope_type", "type", "rope_theta")  # keys of one set of rope parameters, never a layer type


def per_layer_type(rope_parameters: Any) -> dict[str, dict[str, Any] | None] | None:
    """``rope_parameters`` (a config's, or a config.json dict's) read as keyed by layer type: ``{layer type:
    its rope parameters}`` — the entries that are dicts, and those that are None: a layer type that runs
    without position encoding (NoPE: Beam's and Ergo's ``full_attention``) — when some entry is a dict (or
    every one is None); None for one set of rope parameters (``rope_type``, ``rope_theta`` …) or none."""
    if not isinstance(rope_parameters, dict) or not rope_parameters:
        return None
    nested = any(isinstance(v, dict) for v in rope_parameters.values())
    if not nested and (any(v is not None for v in rope_parameters.values()) or set(_FLAT_KEYS) & set(rope_parameters)):
        return None
    return {k: v for k, v in rope_parameters.items() if v is None or isinstance(v, dict)}


def nope_layer_types(config) -> list[str]:
    """The layer types whose rope parameters the config sets to None: their layers run without
    position encoding (NoPE), so no strategy applies to them ([] for a config with one set)."""
    sets = per_layer_type(getattr(text_config(config), "rope_parameters", None)) or {}
    return [k for k, v in sets.items() if v is None]


def config_layer_type(config, layer_type: str | None = None) -> str | None:
    """The layer type whose rope parameters are read: None for a config with one set of them (or
    whose every layer type is NoPE); for a per-layer-type config (Gemma 3) ``layer_type``, or when
    None ``full_attention`` if it rotates (the layers long context reaches), else the first type that
    rotates. Raises ``InvalidInput`` for a ``layer_type`` the config does not have, and
    ``NoRopeConfigError`` for one whose rope parameters are None (NoPE: nothing to read)."""
    sets = per_layer_type(getattr(text_config(config), "rope_parameters", None))
    if sets is None:
        return None
    nested = [k for k, v in sets.items() if v is not None]
    if layer_type is None:
        return None if not nested else "full_attention" if "full_attention" in nested else nested[0]
    if layer_type in sets and layer_type not in nested:
        raise NoRopeConfigError(f"layer type {layer_type!r} has rope parameters None: its layers run without "
                                f"position encoding (NoPE), there is no RoPE to read or scale; the layer types "
                                f"that rotate: {nested}")
    if layer_type not in nested:
        raise InvalidInput(f"layer type {layer_type!r} not in the config's rope_parameters; it has {sorted(nested)}")
    return layer_type


def layer_rope_parameters(config, layer_type: str | None = None) -> dict[str, Any]:
    """The ``rope_parameters`` of ``layer_type`` (a copy; which type: ``config_layer_type``), {}
    for a config without them (or whose every layer type is NoPE)."""
    rp = getattr(text_config(config), "rope_parameters", None) or {}
    if not isinstance(rp, dict):
        return {}
    chosen = config_layer_type(config, layer_type)
    if chosen is None:
        return {} if per_layer_type(rp) is not None else dict(rp)
    return dict(rp[chosen])


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
    no ``rope_theta``, or ``layer_type``'s (or every layer type's) rope parameters are None (NoPE)."""
    text = text_config(config)
    sets = per_layer_type(getattr(text, "rope_parameters", None))
    if sets is not None and all(v is None for v in sets.values()):
        raise NoRopeConfigError(f"{type(text).__name__}: every layer type's rope parameters are None ({sorted(sets)}): "
                                "its layers run without position encoding (NoPE), not a RoPE model")
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

"""The model's rotary modules: how ropescale finds them and reads them.

transformers 5.x models hold their rotary modules (``model.model.rotary_emb`` and kin; several in
some families, one per layer in others) with an ``inv_freq`` buffer — or ``{layer_type}_inv_freq``
buffers for per-layer-type frequencies (Gemma 3) — and an ``attention_scaling`` factor, from which
their forward builds whatever the model's attention consumes: cos/sin in halves or interleaved
layout, half-width cos/sin (gpt-oss), complex ``freqs_cis`` (Llama 4, DeepSeek-V2), M-RoPE sections
over 3-axis positions (Qwen 3.5), proportional RoPE with zero-frequency pairs (Gemma 4).
ropescale never rebuilds that output: a frequency strategy swaps the module's own buffers in place
(``ropescale.rotary.frequencies.FrequencyPatch``) and the module goes on producing its own format.

Shapes: b = batch, s = sequence length, d = rotary dim (``2 · len(inv_freq)``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ropescale.errors import RopescaleError
from ropescale.rope_config import NoRopeConfigError, rope_config_of
from ropescale.rotary.sites import RotarySite

__all__ = [
    "NoRotaryEmbeddingError",
    "attention_scaling_name",
    "attention_scaling_of",
    "default_layer_types",
    "find_rotary_modules",
    "inv_freq_name",
    "layer_rope_parameters_of",
    "layer_types_of",
    "rope_context",
    "rotary_sites",
    "site_context",
    "text_config_of",
]

_SKIP = ("original", "long")  # `*_original_inv_freq`, `*_long_inv_freq` are bookkeeping buffers


class NoRotaryEmbeddingError(RopescaleError, ValueError):
    """The model has no rotary-embedding module that ropescale can patch."""


def layer_types_of(module: nn.Module) -> list[str | None]:
    """``[None]`` for a plain rotary module; the layer types of a per-type one (Gemma 3)."""
    if "inv_freq" in module._buffers:
        return [None]
    return [name[: -len("_inv_freq")] for name in module._buffers
            if name.endswith("_inv_freq") and not any(name.endswith(f"_{k}_inv_freq") or name == f"{k}_inv_freq"
                                                      for k in _SKIP)]


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every rotary module of a model: those holding an ``inv_freq`` (or per-layer-type ``*_inv_freq``) buffer.

    Args:
        model: a loaded HF model.

    Returns:
        ``(qualified name, module)`` pairs in ``named_modules`` order; empty for a model without RoPE.
    """
    return [(n, m) for n, m in model.named_modules() if layer_types_of(m)]


def rotary_sites(model: nn.Module) -> tuple[dict[str, nn.Module], list[RotarySite]]:
    """The model's named modules and every frequency set of its rotary modules."""
    modules = dict(model.named_modules())
    return modules, [RotarySite(n, lt) for n, m in find_rotary_modules(model) for lt in layer_types_of(m)]


def inv_freq_name(layer_type: str | None) -> str:
    """The buffer holding a layer type's ``inv_freq``: ``inv_freq``, or ``{layer_type}_inv_freq`` (Gemma 3)."""
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


def attention_scaling_name(layer_type: str | None) -> str:
    """The attribute holding a layer type's ``attention_scaling`` (``{layer_type}_attention_scaling`` per type)."""
    return "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"


def attention_scaling_of(module: nn.Module, layer_type: str | None) -> float:
    """The cos/sin scale the original module applies (``attention_scaling`` or per layer type)."""
    value = getattr(module, attention_scaling_name(layer_type), None)
    return 1.0 if value is None else float(value)


def text_config_of(model: nn.Module, module: nn.Module):
    """The text config a rotary module reads: the module's own ``config``, else the model's; a multimodal
    config's text part (``get_text_config``)."""
    cfg = getattr(module, "config", None) or getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_context(model: nn.Module, module: nn.Module, layer_type: str | None = None) -> dict[str, Any]:
    """``dim``, ``rope_theta`` and ``original_max_position_embeddings`` for a rotary module.

    ``dim`` comes from the module's own ``inv_freq`` (so partial rotary is honoured); θ and the
    training window from the config, read by ``ropescale.rope_config.rope_config_of`` (the one
    reader: rope parameters, nested per layer type for Gemma 3; the window from
    ``original_max_position_embeddings`` there, the config's own (Phi-3), or
    ``max_position_embeddings``).

    Args:
        model: the loaded model.
        module: one of its rotary modules (``find_rotary_modules``).
        layer_type: the layer type whose parameters to read, for a module holding one set per layer
            type (None: the module's own, or its first type's).

    Returns:
        ``{"dim": d, "rope_theta": b, "original_max_position_embeddings": T, ...}``.

    Raises:
        NoRotaryEmbeddingError: the config has no θ.
    """
    cfg = text_config_of(model, module)
    if layer_type is None and "inv_freq" not in module._buffers:
        layer_type = layer_types_of(module)[0]  # per-layer-type module: any type gives T
    try:
        rope = rope_config_of(cfg, layer_type, dim=2 * getattr(module, inv_freq_name(layer_type)).numel())
    except NoRopeConfigError:
        raise NoRotaryEmbeddingError(
            f"found a rotary module ({type(module).__name__}) but no rope_theta in the model's "
            "config (looked in config.rope_parameters and config.rope_theta)") from None
    return rope.context()


def layer_rope_parameters_of(model: nn.Module, site: RotarySite) -> dict[str, Any]:
    """The config's ``rope_parameters`` of the layer type a frequency set belongs to ({} if none)."""
    from ropescale.rope_config import layer_rope_parameters

    modules = dict(model.named_modules())
    try:
        return layer_rope_parameters(text_config_of(model, modules[site.module_name]), site.layer_type)
    except (KeyError, ValueError):
        return {}


def site_context(model: nn.Module, site: RotarySite) -> dict[str, Any]:
    """``rope_context`` of a frequency set ({} when its module or the config's θ is missing)."""
    modules = dict(model.named_modules())
    try:
        return rope_context(model, modules[site.module_name], site.layer_type)
    except (KeyError, NoRotaryEmbeddingError):
        return {}


def default_layer_types(model: nn.Module, module: nn.Module, available: list[str | None]) -> list[str | None]:
    """The layer types a frequency strategy scales by default: all, except sliding-window ones when the model
    mixes them with global attention: a sliding layer never sees relative positions beyond its window, so it
    needs no scaling (Gemma 3's own long-context configs scale only ``full_attention``)."""
    if available == [None]:
        return available
    cfg = text_config_of(model, module)
    keep = [t for t in available if "sliding" not in t] if getattr(cfg, "sliding_window", None) else available
    return keep or available


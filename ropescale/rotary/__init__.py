"""The model side of RoPE: how ropescale reads a loaded model's rotary embedding and changes it.

- ``modules``: finding the rotary modules (``inv_freq`` buffers, per layer type for Gemma 3) and reading
  their frequency sets, attention factors and config context;
- ``probe``: what each attention layer does with positions, watched per layer (``probe_layers``);
- ``frequencies``: a frequency strategy swapped into a module's own buffers (``FrequencyPatch``);
- ``cache``: dynamic strategies under a KV cache (recompute the prefix or re-rotate cached keys);
- ``quirks``: what a family does differently, in one declared table (``QUIRKS``, ``PROBE_CONTRACTS``);
- ``sites``: the names they share (``RotarySite``, ``LayerRope``).

``ropescale.patching`` orchestrates these; the attention side of the relative-position rules is ``ropescale.attention``.
"""

from ropescale.rotary.modules import (
    NoRotaryEmbeddingError,
    attention_scaling_of,
    find_rotary_modules,
    inv_freq_name,
    layer_types_of,
    rope_context,
    rotary_sites,
)
from ropescale.rotary.probe import layers_without_attention, probe_layers, rotate_pairs
from ropescale.rotary.sites import LayerRope, RotarySite

__all__ = [
    "LayerRope",
    "NoRotaryEmbeddingError",
    "RotarySite",
    "attention_scaling_of",
    "find_rotary_modules",
    "inv_freq_name",
    "layer_types_of",
    "layers_without_attention",
    "probe_layers",
    "rope_context",
    "rotary_sites",
    "rotate_pairs",
]

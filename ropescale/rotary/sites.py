"""What the model side names: a frequency set of the model (``RotarySite``) and what one attention layer
does with positions (``LayerRope``, read by ``ropescale.rotary.probe``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerRope", "RotarySite"]


@dataclass(frozen=True)
class RotarySite:
    """One set of frequencies of the model: rotary module ``module_name`` (qualified name) and its
    layer type (``None`` for a module with one set; Gemma 3's ``sliding_attention``, …)."""

    module_name: str
    layer_type: str | None = None

    def __str__(self) -> str:
        return self.module_name + (f"[{self.layer_type}]" if self.layer_type else "")


@dataclass(frozen=True)
class LayerRope:
    """What one attention layer does with positions.

    index: the layer's cache index (``layer_idx``, else call order); name: its qualified module name;
    kind: ``"rope"`` (it rotates q and k as described below), ``"none"`` (no RoPE: q and k do not
    depend on positions) or ``"unknown"`` (it rotates, but no contract ropescale knows reproduces it);
    site: the frequency set it rotates with (``"rope"`` only); full_mask: an indexer reads or selects keys from
    the full causal mask (DeepSeek-V3.2's DSA, Qwen4's QSA, MiniMax M3's blocks), so attention gets masks as the model
    builds them;
    additive_mask: its mask adds a learned per-head bias; start, dim: the rotary
    channels [start, start + dim) of each q/k head; interleaved: pairs (2i, 2i+1) instead of (i, i + d/2);
    sign: +1 (the Llama lineage) or −1 (a mirrored ``rotate_half``); head_dim, v_head_dim: q/k and value
    head dims (they differ under MLA); passes_position_ids: whether the model hands ``position_ids`` to
    the attention function (else ropescale takes them from the rotary module's call).
    """

    index: int
    name: str
    kind: str
    site: RotarySite | None = None
    start: int = 0
    dim: int = 0
    interleaved: bool = False
    sign: int = 1
    head_dim: int = 0
    v_head_dim: int = 0
    passes_position_ids: bool = True
    full_mask: bool = False  # an indexer reads or selects from the full causal mask (DSA, QSA, MiniMax M3)
    additive_mask: bool = False  # the mask carries a per-head additive bias (Doge's dynamic mask)

    @property
    def rotates(self) -> bool:
        """Whether q and k depend on positions in this layer (``"rope"`` or ``"unknown"``)."""
        return self.kind != "none"

"""``native``: the model as it was loaded, and the transformers ``rope_parameters`` that reproduce it.

The strategy changes nothing (``keeps_model``): the rotary modules keep their own frequencies,
cos/sin scale and dynamic updates. What it exports is the model's own rope parameters, with every
value transformers derives from them at load time written out (``shipped_rope_parameters``), so an
engine that rewrites ``max_position_embeddings`` (the served length) or reads a key transformers
defaults (vLLM's LongRoPE magnitude, llama.cpp's YaRN betas) serves the same rotation.

Notation: s = ``factor``, T = ``original_max_position_embeddings`` [tokens], mpe =
``max_position_embeddings`` [tokens].
"""

from __future__ import annotations

from typing import Any

import torch

from ropescale.strategies.by_parts import longrope_attention_factor, yarn_attention_factor
from ropescale.strategies.registry import RopeFrequencies, register

__all__ = ["native", "shipped_rope_parameters"]

_OWN = ("rope_theta", "partial_rotary_factor")  # kept from the layer's base by ropescale.models


def shipped_rope_parameters(base: dict[str, Any], max_position_embeddings: int | None) -> dict[str, Any]:
    """A copy of one layer type's transformers ``rope_parameters`` ``base`` with the values
    transformers derives when they are absent written out, exactly as transformers 5 computes them
    (``modeling_rope_utils``):

    - ``yarn``, ``longrope``: s = mpe / T when ``factor`` is absent or None (Phi-3's LongRoPE
      configs), with ``max_position_embeddings`` = the config's mpe [tokens];
    - ``yarn``: ``attention_factor`` (mscale(s, mscale)/mscale(s, mscale_all_dim) where both are set,
      else 0.1·ln s + 1), ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` true;
    - ``longrope``: ``attention_factor`` √(1 + ln s / ln T) for s > 1, else 1.

    Other rope types are returned as they are: ``dynamic`` keeps reading mpe as its window, which
    no rope parameter can carry (the export keeps mpe). Raises ``KeyError`` for a yarn/longrope
    ``base`` without T, which transformers' config standardization always sets."""
    out = dict(base)
    kind = out.get("rope_type", out.get("type", "default"))
    if kind not in ("yarn", "longrope"):
        return out
    t = out["original_max_position_embeddings"]
    if out.get("factor") is None and max_position_embeddings:
        out["factor"] = max_position_embeddings / t
    if out.get("attention_factor") is None and out.get("factor") is not None:
        out["attention_factor"] = float(yarn_attention_factor(out) if kind == "yarn" else
                                        longrope_attention_factor(out["factor"], t))
    if kind == "yarn":
        out["beta_fast"] = out.get("beta_fast") or 32.0  # transformers: `or 32` (None and 0 alike)
        out["beta_slow"] = out.get("beta_slow") or 1.0
        out.setdefault("truncate", True)
    return out


def _export_native(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    return {k: v for k, v in shipped_rope_parameters(base, max_position_embeddings).items() if k not in _OWN}


@register("native", export=_export_native, keeps_model=True,
          source="the model's own config (transformers rope_parameters)")
def native(model_inv_freq: torch.Tensor, model_attention_scaling: float) -> RopeFrequencies:
    """The model as shipped: its own frequencies and cos/sin scale, whatever its config's rope type
    (a natively scaled model keeps its scaling, a dynamic one its updates: ``patch`` leaves the rotary
    modules untouched). Lets a sweep put the shipped scaling beside the alternatives."""
    return RopeFrequencies(model_inv_freq.clone(), float(model_attention_scaling))

"""What each serving engine reads, in declared tables (the style of ``ropescale.rotary.quirks``).

Every engine module re-implementing an engine's rotary code (``ropescale.serving.engines.vllm``,
``sglang``, ``mlx``, ``llama_cpp``) declares two tables:

- ``ROPE_TYPES``: rope type → ``RopeRow``, the rope type(s) the engine computes, the function computing
  that type's rotation as the engine does (its ``*_rope``), the function translating a transformers rope
  type into the engine's settings (its export), and the source both were read from. The re-implementation
  looks the row up (``ROPE_TYPES.get(kind)``); a type without a row keeps the engine's own refusal.
- ``FAMILIES``: name → ``Family``, the architectures or model types the engine treats apart (per-layer-type
  rope parameters, DeepSeek's MLA YaRN, Mistral's query temperature, sliding-window architectures...), what
  it does for them, and the source.

A rope type or a family is added in one row per engine; no re-implementation compares a rope type with a
name (``tests/serving/test_engines.py`` walks them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEEPSEEK_ARCHS", "Family", "RopeRow", "families", "rope_types"]

# transformers architectures of DeepSeek's MLA attention, which vLLM 0.32.0 and SGLang 0.5.23 both serve with
# deepseek_v2.py (DeepseekScalingRotaryEmbedding for every scaled rope type)
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class RopeRow:
    """One row of an engine's ``ROPE_TYPES``: ``kinds`` (the rope type names it answers, as the engine's
    config spells them); ``compute`` (the engine's rotation for them, signature per engine; None: not
    re-implemented); ``translate`` (transformers rope parameters → the engine's, signature per engine; None:
    not exported); ``source`` (the engine's files the row was read from); ``mla`` (vLLM/SGLang: computed as
    DeepSeek's YaRN on a ``DEEPSEEK_ARCHS`` model, as the engine's ``get_rope`` orders its types); ``unscaled``
    (the plain rotation, ``default``: a DeepSeek export keeps it, every other type is DeepSeek's YaRN)."""

    kinds: tuple[str, ...]
    compute: Callable[..., Any] | None
    translate: Callable[..., Any] | None
    source: str
    mla: bool = False
    unscaled: bool = False


@dataclass(frozen=True)
class Family:
    """One row of an engine's ``FAMILIES``: ``name``; ``members`` (architectures or model types, as ``key``
    says: ``architectures`` or ``model_type``); ``does`` (what the engine does for them); ``source``;
    ``target`` (llama.cpp: the GGUF architecture the converter writes for them; None elsewhere)."""

    name: str
    members: tuple[str, ...]
    key: str
    does: str
    source: str
    target: str | None = None

    def has(self, config: dict[str, Any]) -> bool:
        """Whether a config.json dict belongs to the family (any of its ``architectures``, or its ``model_type``)."""
        if self.key == "architectures":
            return any(a in self.members for a in config.get("architectures") or [])
        return str(config.get("model_type", "")) in self.members


def rope_types(*rows: RopeRow) -> dict[str, RopeRow]:
    """The ``ROPE_TYPES`` table of ``rows``: each of a row's ``kinds`` → the row, in declaration order."""
    return {kind: row for row in rows for kind in row.kinds}


def families(*rows: Family) -> dict[str, Family]:
    """The ``FAMILIES`` table of ``rows``: name → row, in declaration order."""
    return {row.name: row for row in rows}

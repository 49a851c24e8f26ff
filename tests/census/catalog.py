"""Every causal-LM type of the installed transformers, with its config and model classes.

``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type → causal-LM class name) is the list a user's
``AutoModelForCausalLM`` draws from; ``CONFIG_MAPPING`` gives each type's config class. A type that
a new transformers release adds appears here, and so in the census, with no edit.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["CausalLMType", "causal_lm_types"]


@dataclass(frozen=True)
class CausalLMType:
    name: str  # model type, e.g. "llama"
    model_class_name: str  # e.g. "LlamaForCausalLM"

    @property
    def config_class(self):
        return CONFIG_MAPPING[self.name]

    @property
    def model_class(self):
        return getattr(transformers, self.model_class_name)


def causal_lm_types() -> list[CausalLMType]:
    """All causal-LM types of the installed transformers, sorted by name."""
    return [CausalLMType(k, v) for k, v in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]

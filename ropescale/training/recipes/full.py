"""Full fine-tuning: every weight of the patched model trains; saved whole with its patch
(``ropescale.save_patched``)."""

from __future__ import annotations

from pathlib import Path

from ropescale.training.recipes import Recipe


class Full(Recipe):
    """Full fine-tuning: every parameter trained, the model saved whole with its patch."""

    name = "full"

    def prepare(self, model, cfg, source: str = "config"):
        return model

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        from ropescale.training.lora import save_trained

        return save_trained(model, tokenizer, output, state_dict=state_dict)

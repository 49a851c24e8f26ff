"""LoRA (Hu et al. 2021, arXiv:2106.09685) through PEFT on the frozen, patched model, with
LongLoRA's optional "LoRA+" (embeddings and norms trained fully): ``recipe: lora`` or the
``lora:`` config section. Options: ``ropescale.training.lora.LoraSettings``; the work is done
by ``ropescale.training.lora`` (``apply_lora``, ``save_trained``)."""

from __future__ import annotations

from pathlib import Path

from ropescale.training.lora import DEFAULT_LORA_TARGETS, LoraSettings, apply_lora, save_trained
from ropescale.training.recipes import Recipe

__all__ = ["DEFAULT_LORA_TARGETS", "Lora", "LoraSettings"]


class Lora(Recipe):
    name = "lora"
    Options = LoraSettings
    label = " + LoRA"
    requires = (("peft", "ropescale[lora]"),)
    shards = False  # LoRA freezes the base weights: with gradient_checkpointing an 8B model fits one GPU

    def prepare(self, model, cfg, source: str = "config"):
        key = "lora" if cfg is not None and cfg.lora is not None else "recipe"  # where the options were given
        return apply_lora(model, self.options, source, key)

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        return save_trained(model, tokenizer, output, self.options, state_dict=state_dict)

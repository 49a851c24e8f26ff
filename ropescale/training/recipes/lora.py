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
    """LoRA (Hu et al. 2021, arXiv:2106.09685) through peft: the base frozen, adapters trained; saved merged
    or as the adapter."""

    name = "lora"
    Options = LoraSettings
    label = " + LoRA"
    requires = (("peft", "ropescale[lora]"),)
    shards = False  # LoRA freezes the base weights: with gradient_checkpointing an 8B model fits one GPU
    frozen_base = True

    def prepare(self, model, cfg, source: str = "config"):
        key = "lora" if cfg is not None and cfg.lora is not None else "recipe"  # where the options were given
        autocast = cfg is not None and cfg.mixed_precision != "no"  # mixed precision: the adapters on autocast's path
        return apply_lora(model, self.options, source, key, autocast=autocast)

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        return save_trained(model, tokenizer, output, self.options, state_dict=state_dict)

"""LongLoRA's "LoRA+" (Chen et al. 2023, arXiv:2309.12307 §3.3): LoRA on the attention
projections q, k, v, o with the embedding and normalisation layers trained fully — what
dvlab-research/LongLoRA ``fine-tune.py`` does (commit d4eb344): ``LoraConfig(r=8, lora_alpha=16,
target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0, bias="none")``, then
``requires_grad_()`` on every parameter whose name contains one of ``trainable_params``
(default ``"embed,norm"``). Here those parameters' modules go through PEFT's ``modules_to_save``
so they are saved with an adapter too; a merged save holds the trained embeddings and norms.

Not included: LongLoRA's shifted sparse attention (S²-Attn) — attention is the strategy's part
(ropescale's truncation rules); this recipe only decides what trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from ropescale.training.recipes import Recipe, RecipeOptions

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # LongLoRA's targets for Llama-style models


class LongLoraOptions(RecipeOptions):
    r: int = Field(8, ge=1, description="LoRA rank (LongLoRA: 8)")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r (LongLoRA: 16)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch's input (LongLoRA: 0)")
    trainable_params: list[str] = Field(["embed", "norm"], min_length=1, description=(
        "parameters trained fully: those whose name contains one of these (LongLoRA's --trainable_params)"))
    save: Literal["merged", "adapter"] = "merged"

    @field_validator("trainable_params", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v  # "embed,norm"


def fully_trained_modules(model, patterns: list[str]) -> list[str]:
    """Modules owning a parameter whose full name contains one of ``patterns`` (LongLoRA's rule
    ``any(k in n for k in trainable_params)`` over ``model.named_parameters()``)."""
    owners = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if any(k in n for k in patterns)}
    return sorted(owners)


class LongLora(Recipe):
    name = "longlora"
    Options = LongLoraOptions
    label = " + LongLoRA"
    requires = (("peft", "ropescale[lora]"),)
    shards = False

    def settings(self, model):
        """The ``LoraSettings`` this recipe amounts to on ``model``."""
        from ropescale.training.config import LoraSettings

        o = self.options
        return LoraSettings(r=o.r, alpha=o.alpha, dropout=o.dropout, target_modules=list(TARGETS),
                            modules_to_save=fully_trained_modules(model, o.trainable_params), save=o.save)

    def prepare(self, model, cfg, source: str = "config"):
        from ropescale.training.lora import apply_lora

        return apply_lora(model, self.settings(model), source)

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        from ropescale.training.config import LoraSettings
        from ropescale.training.lora import save_trained

        return save_trained(model, tokenizer, output, LoraSettings(save=self.options.save), state_dict=state_dict)

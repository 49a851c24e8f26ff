"""LongLoRA's "LoRA+" (Chen et al. 2023, arXiv:2309.12307 §3.3): LoRA on the attention
projections q, k, v, o with the embedding and normalisation layers trained fully — what
dvlab-research/LongLoRA ``fine-tune.py`` does (commit d4eb344): ``LoraConfig(r=8, lora_alpha=16,
target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0, bias="none")``, then
``requires_grad_()`` on every parameter whose name contains one of ``trainable_params``
(default ``"embed,norm"``). Here those parameters' modules go through PEFT's ``modules_to_save``
so they are saved with an adapter too; a merged save holds the trained embeddings and norms.

Not included: LongLoRA's shifted sparse attention (S²-Attn) — attention is the strategy's part
(ropescale's relative-position rules); this recipe only decides what trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from ropescale.training.recipes import Recipe, RecipeOptions

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # LongLoRA's targets for Llama-style models


class LongLoraOptions(RecipeOptions):
    """LongLoRA's options: LoRA rank and scale, and the parameters trained fully (embeddings, norms)."""

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


def fully_trained_modules(model, patterns: list[str], source: str = "config") -> list[str]:
    """Modules owning a parameter whose full name contains one of ``patterns`` (LongLoRA's rule
    ``any(k in n for k in trainable_params)`` over ``model.named_parameters()``). Raises
    ``ConfigError`` (one line, naming the names it matched against) for a pattern in no parameter
    name: it would train nothing more without a word (``embed`` on GPT-2, whose embeddings are
    ``transformer.wte``)."""
    from ropescale.runs.config import ConfigError

    names = [n for n, _ in model.named_parameters()]
    unmatched = [k for k in patterns if not any(k in n for n in names)]
    if unmatched:
        parts = sorted({p for n in names for p in n.split(".")[:-1] if not p.isdigit()})
        raise ConfigError(f"{source}: recipe.trainable_params: {', '.join(map(repr, unmatched))} "
                          f"{'is' if len(unmatched) == 1 else 'are'} in no parameter name of the model (matched "
                          f"against model.named_parameters(), e.g. {names[0]}; the parts of those names: "
                          f"{', '.join(parts)})")
    owners = {n.rsplit(".", 1)[0] for n in names if any(k in n for k in patterns)}
    return sorted(owners)


class LongLora(Recipe):
    """LongLoRA's "LoRA+" (Chen et al. 2023, arXiv:2309.12307; dvlab-research/LongLoRA): LoRA on q, k, v, o
    plus fully trained embeddings and norms (its S²-Attn is not part of the recipe: see the module docstring)."""

    name = "longlora"
    Options = LongLoraOptions
    label = " + LongLoRA"
    requires = (("peft", "ropescale[lora]"),)
    shards = False
    frozen_base = True

    def settings(self, model, source: str = "config"):
        """The ``LoraSettings`` this recipe amounts to on ``model`` (``ConfigError`` for
        ``trainable_params`` in no parameter name)."""
        from ropescale.training.lora import LoraSettings

        o = self.options
        return LoraSettings(r=o.r, alpha=o.alpha, dropout=o.dropout, target_modules=list(TARGETS),
                            modules_to_save=fully_trained_modules(model, o.trainable_params, source), save=o.save)

    def prepare(self, model, cfg, source: str = "config"):
        from ropescale.training.lora import apply_lora

        autocast = cfg is not None and cfg.mixed_precision != "no"
        return apply_lora(model, self.settings(model, source), source, "recipe", autocast=autocast)

    def save(self, model, tokenizer, output: str | Path, *, state_dict: dict | None = None) -> Path:
        from ropescale.training.lora import LoraSettings, save_trained

        return save_trained(model, tokenizer, output, LoraSettings(save=self.options.save), state_dict=state_dict)

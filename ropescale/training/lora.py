"""LoRA fine-tuning through PEFT: which modules to wrap, LongLoRA's "LoRA+" (embeddings and norms
trained fully), and saving the result merged or as an adapter that reloads with its patch.

Sources: LoRA, Hu et al. 2021, arXiv:2106.09685 (PEFT, huggingface/peft); LongLoRA, Chen et al.
2023, arXiv:2309.12307 (dvlab-research/LongLoRA).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ropescale.compat import peft_wrapping
from ropescale.models import save_adapter, save_patched
from ropescale.patching import current_patch
from ropescale.runs.config import ConfigError
from ropescale.training.config import DEFAULT_LORA_TARGETS, LoraSettings

__all__ = ["apply_lora", "embedding_and_norm_modules", "save_trained"]


def embedding_and_norm_modules(model) -> list[str]:
    """Names of the modules LongLoRA's "LoRA+" trains fully (Chen et al. 2023, arXiv:2309.12307;
    dvlab-research/LongLoRA ``trainable_params="embed,norm"``): embeddings (``nn.Embedding``) and
    normalisation layers (a class name containing ``Norm``: LlamaRMSNorm, LayerNorm, ...) that
    hold parameters of their own. For Llama: ``model.embed_tokens``, each layer's
    ``input_layernorm`` and ``post_attention_layernorm``, ``model.norm`` — the modules of the
    parameters whose names contain ``embed`` or ``norm``, LongLoRA's rule."""
    out = []
    for name, module in model.named_modules():
        if not name or not any(True for _ in module.parameters(recurse=False)):
            continue
        if isinstance(module, torch.nn.Embedding) or "Norm" in type(module).__name__:
            out.append(name)
    return out


def apply_lora(model, lora: LoraSettings, source: str = "config"):
    """Wrap a (patched) causal LM in PEFT's LoRA: the base weights frozen, LoRA matrices on
    ``lora.target_modules`` (default ``q_proj, k_proj, v_proj, o_proj`` when the model has them,
    else PEFT's default for the architecture), ``modules_to_save`` (plus, with
    ``trainable_embeddings_norms``, ``embedding_and_norm_modules``) trained fully and saved with
    the adapter. The ropescale patch (rotary module swapped, attention function set) is left as it
    is and stays active inside the wrapper; ``current_patch`` reaches it through PEFT.

    Returns the ``PeftModel``. Raises ``ConfigError`` (one line) for target modules the model
    does not have."""
    from peft import LoraConfig, get_peft_model

    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = list(lora.target_modules) if lora.target_modules else (
        list(DEFAULT_LORA_TARGETS) if set(DEFAULT_LORA_TARGETS) <= leaves else None)
    save = list(lora.modules_to_save)
    if lora.trainable_embeddings_norms:
        save += [n for n in embedding_and_norm_modules(model) if n not in save]
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        modules_to_save=save or None, task_type="CAUSAL_LM")
    handle = current_patch(model)
    try:
        with peft_wrapping():
            wrapped = get_peft_model(model, config)
    except ValueError as e:
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"{source}: lora: {first}") from None
    if current_patch(wrapped) is not handle:  # the patch must survive the wrapping
        raise RuntimeError("the ropescale patch is not reachable through the PEFT model")
    return wrapped


def save_trained(model, tokenizer, output: str | Path, lora: LoraSettings | None = None, *,
                 state_dict: dict | None = None) -> Path:
    """Save a trained patched model into ``output``: all weights (``save_patched``); with LoRA
    ``save: merged`` the adapter merged into the weights first (``merge_and_unload``: ``model``
    itself is changed), with ``save: adapter`` an adapter folder (``save_adapter``). Both reload
    with their patch through ``ropescale.load_model(output)``."""
    if lora is None:
        return save_patched(model, tokenizer, output, state_dict=state_dict)
    if lora.save == "adapter":
        return save_adapter(model, tokenizer, output)
    return save_patched(model.merge_and_unload(), tokenizer, output)

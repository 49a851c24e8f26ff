"""LoRA fine-tuning through PEFT: which modules to wrap, LongLoRA's "LoRA+" (embeddings and norms
trained fully), and saving the result merged or as an adapter that reloads with its patch.

Sources: LoRA, Hu et al. 2021, arXiv:2106.09685 (PEFT, huggingface/peft); LongLoRA, Chen et al.
2023, arXiv:2309.12307 (dvlab-research/LongLoRA).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from ropescale.compat import peft_wrapping
from ropescale.models import save_adapter, save_patched
from ropescale.patching import current_patch
from ropescale.runs.config import ConfigError, ConfigModel

__all__ = ["DEFAULT_LORA_TARGETS", "LoraSettings", "apply_lora", "check_lora", "embedding_and_norm_modules",
           "lora_targets", "save_trained"]


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraSettings(ConfigModel):
    """LoRA (Hu et al. 2021, arXiv:2106.09685) through PEFT: the base weights stay frozen and
    each targeted linear layer W gains W + (alpha / r) · B A with A ``[r, in]``, B ``[out, r]``
    (B starts at zero, so training starts from the base model's outputs).

    ``trainable_embeddings_norms``: LongLoRA's "LoRA+" (Chen et al. 2023, arXiv:2309.12307 §3.3;
    dvlab-research/LongLoRA ``trainable_params="embed,norm"``): the embedding and normalisation
    layers are also trained fully; they go through PEFT's ``modules_to_save`` so they are saved
    with the adapter. ``save``: ``merged`` (LoRA merged into the weights, a plain patched model)
    or ``adapter`` (PEFT adapter folder + patch record + tokenizer; ``ropescale.load_model``
    loads the base model named in it, applies the adapter and re-applies the patch)."""

    # a recipe's options as RecipeOptions declares them (training.recipes imports this module, not the reverse)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    r: int = Field(8, ge=1, description="rank of the update B A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch's input")
    target_modules: list[str] | None = Field(
        None, description="linear layers given LoRA (default: q_proj, k_proj, v_proj, o_proj when the model has "
                          "them, else PEFT's default for the architecture)")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained fully and saved")
    trainable_embeddings_norms: bool = Field(False, description="LongLoRA's LoRA+: embeddings and norms trained")
    save: Literal["merged", "adapter"] = "merged"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, raw: Any) -> Any:
        return {} if raw is True else raw  # `lora: true`: the defaults

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, str):  # `q_proj,v_proj`
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("empty: name at least one linear layer (or leave the key out for the default)")
        return v


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


def _names(names: list[str]) -> str:
    return ", ".join(map(repr, names)) + (" matches" if len(names) == 1 else " match")


def lora_targets(model, targets: list[str] | None) -> dict[str, torch.nn.Module]:
    """``{name: module}`` of the layers PEFT gives LoRA for ``targets`` (its own matching,
    ``check_target_module_exists``: a module whose name is a target or ends with ``.target``;
    None: PEFT's default targets for the architecture, ``{}`` when it has none)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    if targets is None:
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(getattr(model.config, "model_type", None))
        if targets is None:
            return {}
    config = LoraConfig(target_modules=targets)
    return {n: m for n, m in model.named_modules() if n and check_target_module_exists(config, n)}


def check_lora(model, lora: LoraSettings, targets: list[str] | None, key: str = "lora",
               source: str = "config") -> None:
    """What PEFT would take without a word or hand to the allocator, refused in one line
    (``ConfigError`` naming ``key``): a target that matches no module (PEFT refuses only when none
    matches, and drops the others without a word), a rank ``r`` above the smallest dimension of a
    target layer's weight (``B A`` of rank r cannot exceed min(out, in) there; ``r: 10^9``
    allocated ``[r, in]`` matrices), ``modules_to_save`` names that match no module (PEFT matches a
    name by the end of the module's: ``norm`` matches ``model.norm``)."""
    if targets is not None:
        missing = [t for t in targets if not lora_targets(model, [t])]
        if missing:
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"{source}: {key}.target_modules: {_names(missing)} no layer of "
                              f"the model (a name matches the end of a module's: q_proj matches "
                              f"model.layers.0.self_attn.q_proj); its linear layers: {', '.join(linears)}")
    layers = {n: m.weight.shape for n, m in lora_targets(model, targets).items()
              if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2}
    if layers:
        name, shape = min(layers.items(), key=lambda x: min(x[1]))
        bound = min(shape)
        if lora.r > bound:
            raise ConfigError(f"{source}: {key}.r: rank {lora.r} is above the smallest dimension of the target "
                              f"layers ({name}: weight {list(shape)}); a LoRA update B A there has rank at most "
                              f"{bound}; use r <= {bound}")
    modules = [n for n, _ in model.named_modules() if n]
    missing = [m for m in lora.modules_to_save if not any(n.endswith(m) for n in modules)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in modules if not n.rsplit(".", 1)[-1].isdigit()})
        raise ConfigError(f"{source}: {key}.modules_to_save: {_names(missing)} no module of the "
                          f"model (a name matches the end of a module's; its module names end in: "
                          f"{', '.join(leaves)})")


def apply_lora(model, lora: LoraSettings, source: str = "config", key: str = "lora", *, autocast: bool = False):
    """Wrap a (patched) causal LM in PEFT's LoRA: the base weights frozen, LoRA matrices on
    ``lora.target_modules`` (default ``q_proj, k_proj, v_proj, o_proj`` when the model has them,
    else PEFT's default for the architecture), ``modules_to_save`` (plus, with
    ``trainable_embeddings_norms``, ``embedding_and_norm_modules``) trained fully and saved with
    the adapter. The ropescale patch (rotary module swapped, attention function set) is left as it
    is and stays active inside the wrapper; ``current_patch`` reaches it through PEFT.

    Trainable parameters are float32 whatever the base's dtype (PEFT's adapters are; a
    ``modules_to_save`` copy of a bfloat16 module is cast), the master weights of mixed precision.
    ``autocast``: the run computes under ``torch.autocast`` (``mixed_precision``): PEFT's cast of each
    adapter's input to the adapter's float32 is switched off (``cast_input_dtype_enabled``, what
    ``peft.helpers.disable_input_dtype_casting`` sets), since autocast casts it straight back to
    bfloat16 for the matmul — the same numbers, without a float32 copy of the activations per adapted
    layer (2 GiB each for Llama 3 8B at 128k, 7 GiB of the recomputed layer's peak; bench/memory_estimate.py).

    Returns the ``PeftModel``. Raises ``ConfigError`` (one line naming ``key``) for target
    modules the model does not have, a rank above the target layers' smallest dimension and
    ``modules_to_save`` matching no module (``check_lora``), before anything is allocated."""
    from peft import LoraConfig, get_peft_model

    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = list(lora.target_modules) if lora.target_modules else (
        list(DEFAULT_LORA_TARGETS) if set(DEFAULT_LORA_TARGETS) <= leaves else None)
    check_lora(model, lora, targets, key, source)
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
        raise ConfigError(f"{source}: {key}: {first}") from None
    if current_patch(wrapped) is not handle:  # the patch must survive the wrapping
        raise RuntimeError("the ropescale patch is not reachable through the PEFT model")
    for p in wrapped.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    if autocast:
        for module in wrapped.modules():
            if hasattr(module, "cast_input_dtype_enabled"):  # PEFT's BaseTunerLayer
                module.cast_input_dtype_enabled = False
    return wrapped


def save_trained(model, tokenizer, output: str | Path, lora: LoraSettings | None = None, *,
                 state_dict: dict | None = None) -> Path:
    """Save a trained patched model into ``output``: all weights (``save_patched``); with LoRA
    ``save: merged`` the adapter merged into the weights first, in float32 (``_merge_in_float32``:
    ``model`` itself is changed), with ``save: adapter`` an adapter folder (``save_adapter``). Both
    reload with their patch through ``ropescale.load_model(output)``.

    A merged bfloat16 (float16) base keeps its update: the merged layers are saved in float32, the
    others in the base's dtype (which float32 holds exactly), and ``config.json`` says ``float32``, so
    ``ropescale.load_model(output)`` (and ``from_pretrained(dtype="auto")``) gives base + B A · alpha / r
    within float32 rounding — merged in the base's dtype the update was mostly rounded away."""
    if lora is None:
        return save_patched(model, tokenizer, output, state_dict=state_dict)
    if lora.save == "adapter":
        return save_adapter(model, tokenizer, output)
    merged, upcast = _merge_in_float32(model)
    out = save_patched(merged, tokenizer, output)
    if upcast:  # transformers wrote the dtype of the first weight (the embeddings: the base's)
        _declare_dtype(out / "config.json", "float32")
    return out


def _merge_in_float32(model) -> tuple[Any, bool]:
    """``model`` (a PEFT LoRA model) with its adapters merged into the base weights
    (``merge_and_unload``) in float32: the base weight (and bias) of each adapted layer that is
    bfloat16 or float16 is made float32 first — one layer's copy at a time, never the whole model's —
    so W + B A · alpha / r keeps the update (in bfloat16 an update below W's rounding step vanishes).
    Quantized base layers (QLoRA's) are left to PEFT. Returns ``(the merged model, whether a layer was
    made float32)``; ``model`` itself is changed."""
    from peft.tuners.lora import LoraLayer

    upcast = False
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        for name in ("weight", "bias"):
            param = getattr(base, name, None)
            if isinstance(param, torch.Tensor) and param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()
                upcast = True
    return model.merge_and_unload(), upcast


def _declare_dtype(path: Path, dtype: str) -> None:
    """Set ``dtype`` in a saved ``config.json`` (and in its sub-configs that carry one)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["dtype"] = dtype
    for sub in config.values():
        if isinstance(sub, dict) and "dtype" in sub:
            sub["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

"""Fine-tuning configuration: YAML / ``--set`` / flags → validated ``FinetuneConfig``.

One run = one model, one strategy (frequency rule or relative-position rule, with ``logn``), trained for
``steps`` optimiser steps on windows of ``length`` tokens from a data source the harness reads
(``ropescale.runs.data``), then saved with ``ropescale.save_patched``. Parameters the harness fills from
the target length (``factor`` = L / T, ``n_max`` = L, truncation ``window`` = T / 2) are filled the
same way here, with L = ``length``. Errors name the key, one line each:
``configs/x.yaml: stpes: unknown key; allowed: ... (did you mean 'steps'?)``.

Checks that need the model's configuration (the original window T: PoSE needs L > T) run in
``resolve``, before any training.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ropescale.runs.config import (
    ConfigError,
    ConfigModel,
    DataConfig,
    RunConfig,
    StrategySpec,
    explain,
    load_raw,
    parse_strategy,
    read_yaml,
)
from ropescale.runs.trackers import tracker_names
from ropescale.training.lora import DEFAULT_LORA_TARGETS, LoraSettings

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "EvalDuringTraining",
    "FinetuneConfig",
    "LoraSettings",
    "Parallelism",
    "PoseConfig",
    "RecipeSpec",
    "ResolvedRun",
    "build_finetune_config",
    "fsdp_plugin_kwargs",
    "load_finetune_config",
    "resolve",
]

MAX_STEPS = 10 ** 9  # more optimiser steps than any run takes; beyond it counts overflow (int64 indices)
MAX_WINDOWS = 10 ** 15  # training windows per process: steps × grad_accum × batch_size

# every section refuses inf and NaN (`lr: .inf` trained to NaN and saved the model)
_FINITE = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PoseConfig(ConfigModel):
    """PoSE (Zhu et al. 2024, arXiv:2309.10400): train on windows of the original length T whose
    position ids are split into ``chunks`` with random skips reaching the target ``length``. ``window``
    trains on shorter windows W < T instead (every "T" below reads W), whose positions still reach L.

    ``sampling`` (see ``ropescale.training.pose``): ``authors`` (default) — the authors' code,
    GitHub dwzhu-pku/PoSE ``src/train_pose.py`` ``train_preprocess_function_pose``: 2 chunks, the
    first l_0 ~ U{1 … ⌈T/2⌉} tokens, skip u_1 ~ U{0 … L − T}, text from the first 5T tokens of a
    document (v_1 ~ U{0 … 4T}); ``paper`` — the paper's §3.2 / App. B as ropescale drew it before:
    any number of chunks, lengths uniform over the compositions of T, cumulative skips
    u_i ~ U{u_{i−1} … L − T}, text from a span of L tokens."""

    model_config = _FINITE
    enabled: bool = False
    chunks: int = Field(2, ge=1, description="chunks N per window (paper: 2; sampling authors: exactly 2)")
    content: Literal["random", "aligned", "contiguous"] = Field(
        "random", description="text of each chunk: random offsets v_i (paper), v_i = u_i, or contiguous")
    sampling: Literal["authors", "paper"] = Field(
        "authors", description="authors: dwzhu-pku/PoSE train_pose.py (2 chunks, first ≤ T/2); paper: App. B")
    window: int | None = Field(None, ge=2, description=(
        "tokens per training window (default: the model's window T, as the paper trains); shorter windows whose "
        "positions still reach the target length make each step cheaper (a CPU, a long T)"))

    @model_validator(mode="after")
    def _two_chunks(self) -> PoseConfig:
        if self.enabled and self.sampling == "authors" and self.chunks != 2:
            raise ValueError(f"chunks: {self.chunks} with sampling: authors, which draws exactly 2 chunks "
                             "(dwzhu-pku/PoSE train_pose.py); set pose.sampling: paper for other chunk counts")
        if not self.enabled and self.window is not None:  # would train full windows of L, unseen
            raise ValueError(f"window: {self.window} with enabled: false, which trains on windows of the target length "
                             "and ignores it; set pose.enabled: true or drop pose.window")
        return self

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, raw: Any) -> Any:
        if isinstance(raw, bool):  # `pose: true`
            return {"enabled": raw}
        if isinstance(raw, dict) and raw and "enabled" not in raw:  # `pose: {chunks: 3}` means on
            return {**raw, "enabled": True}
        return raw


def fsdp_plugin_kwargs(spec: str, source: str = "config") -> dict[str, Any]:
    """Keyword arguments of accelerate's ``FullyShardedDataParallelPlugin`` for ``sharding``
    (see ``_fsdp_kwargs``); raises ``ConfigError`` in one line naming the key."""
    try:
        return _fsdp_kwargs(spec)
    except ValueError as e:
        raise ConfigError(f"{source}: sharding: {e}") from None


def _fsdp_kwargs(spec: str) -> dict[str, Any]:
    """Keyword arguments of accelerate's ``FullyShardedDataParallelPlugin`` for ``sharding``:
    ``fsdp`` → FSDP2, parameters, gradients and optimiser state sharded over the processes
    (FULL_SHARD: ``reshard_after_forward``), one unit per decoder layer (the model's
    ``_no_split_modules``), sharded checkpoints; a path → a YAML mapping of the plugin's
    arguments (or an ``accelerate config`` file: its ``fsdp_config`` section, ``fsdp_`` prefixes
    dropped). Raises ``ValueError`` for an unreadable file or an unknown argument."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    base = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "transformer_based_wrap",
            "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": False}
    if spec == "fsdp":
        return base
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither 'fsdp' nor a readable accelerate FSDP config file")
    try:
        raw = read_yaml(path)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    raw = raw.get("fsdp_config", raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{spec}: expected a mapping of FSDP plugin arguments")
    known = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    out = dict(base)
    aliases = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}
    for key, value in raw.items():
        name = key if key in known else aliases.get(key.removeprefix("fsdp_"), key.removeprefix("fsdp_"))
        if name == "sharding_strategy" and "reshard_after_forward" not in raw:
            out.pop("reshard_after_forward", None)
        if name not in known:
            hint = difflib.get_close_matches(name, sorted(known), n=1)
            raise ValueError(f"{spec}: {key}: not an FSDP plugin argument"
                              + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        if name == "transformer_cls_names_to_wrap" and isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        out[name] = value.lower() if name == "auto_wrap_policy" and isinstance(value, str) else value
    return out


class Parallelism(ConfigModel):
    """How the processes of a launched run share the work beyond data parallelism.

    ``sequence``: P, processes per sequence-parallel group (DeepSpeed's Ulysses, ALST,
    arXiv:2506.13996; ``ropescale.training.sequence_parallel``): each holds 1/P of every window's
    tokens and, inside attention, the whole window for 1/P of the heads — for every rule. The
    processes form D = processes / P data-parallel groups; the global batch stays
    ``batch_size × grad_accum × processes`` windows. 1: off."""

    model_config = _FINITE
    sequence: int = Field(1, ge=1, description="processes per sequence-parallel group (Ulysses); 1: off")


class EvalDuringTraining(ConfigModel):
    """Held-out perplexity every ``every`` steps (and at step 0) at ``lengths``, logged to the
    training log; ``after``: harness experiments (``eval.config`` mappings without model,
    strategies and output) run on the saved model when training ends."""

    model_config = _FINITE
    every: int = Field(100, ge=1, description="steps between held-out evaluations")
    data: DataConfig = Field(default_factory=DataConfig)
    lengths: list[int] = Field(default_factory=list, description="default: T, 2T, ..., up to length")
    max_windows: int | None = Field(32, ge=1, description="windows per length, evenly spaced (None: all)")
    batch_size: int = Field(1, ge=1)
    after: list[dict[str, Any]] = Field(default_factory=list, description="harness experiments on the saved model")

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(x < 2 for x in v):
            raise ValueError("every length must be at least 2 tokens")
        return sorted(set(v))

    @field_validator("after")
    @classmethod
    def _after(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, entry in enumerate(v):
            clash = sorted({"model", "strategies", "output"} & set(entry))
            if clash:
                raise ValueError(f"entry {i}: {', '.join(clash)} are set by the fine-tuning run (the saved model "
                                 "and its strategy); leave them out")
        return v


class RecipeSpec(ConfigModel):
    """Which training recipe (``ropescale.training.recipes``) and its options, validated by the
    recipe's ``Options``. YAML: ``recipe: longlora`` or ``recipe: {name: lora, r: 16}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "full"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, raw: Any) -> Any:
        from ropescale.training.recipes import build_recipe

        if isinstance(raw, str):
            raw = {"name": raw}
        if not isinstance(raw, dict):
            raise ValueError("a recipe name (full, lora, longlora, ...) or a mapping {name: ..., option: value}")
        if "options" in raw and set(raw) <= {"name", "options"}:
            name, options = raw.get("name", "full"), dict(raw["options"] or {})
        else:
            name, options = raw.get("name", "full"), {k: v for k, v in raw.items() if k != "name"}
        recipe = build_recipe(name, options)  # ValueError in one line naming the option
        return {"name": name, "options": recipe.options.model_dump(mode="json", exclude_unset=True)}

    def build(self):
        """The ``Recipe`` instance."""
        from ropescale.training.recipes import build_recipe

        return build_recipe(self.name, self.options)


class FinetuneConfig(RunConfig):
    """One fine-tuning run. ``batch_size`` is per process and per micro-step: the global batch
    is batch_size × grad_accum × processes windows."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    strategy: StrategySpec
    data: DataConfig = Field(default_factory=lambda: DataConfig(source="kjv-train"),
                             description="the training documents (default: the bundled model's training books)")
    length: int = Field(ge=2, description="target length L [tokens]: the training windows (PoSE: the reach)")
    attention_path: str | None = Field(None, description="relative-position rules: ropescale.patch's attention_path")
    steps: int = Field(description="optimiser steps", le=MAX_STEPS)
    batch_size: int = Field(4, ge=1, description="windows per process per micro-step")
    grad_accum: int = Field(1, ge=1, description="micro-steps per optimiser step")
    lr: float = Field(2e-5, gt=0, description="peak learning rate")
    warmup: int = Field(20, ge=0, description="linear warm-up steps")
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm (None: no clipping)")
    seed: int = Field(0, ge=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    dtype: Literal["float32", "bfloat16", "nf4"] = Field(
        "float32", description="the weights as loaded: bfloat16 halves a frozen base (LoRA, LongLoRA; with "
                               "mixed_precision: bf16), nf4 is QLoRA's 4-bit base (bitsandbytes, CUDA, pip install "
                               "'ropescale[qlora]') — what trains stays float32")
    checkpoint_every: int = Field(100, ge=1, description="steps between save_state checkpoints")
    keep_checkpoints: int = Field(1, ge=1)
    eval: EvalDuringTraining | None = None
    pose: PoseConfig = Field(default_factory=PoseConfig)
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward (transformers' non-reentrant "
                           "checkpointing): activation memory of one layer instead of all; same loss and gradients")
    activation_offload: bool = Field(
        False, description="with gradient_checkpointing: what each checkpointed layer keeps — its input — held in "
                           "host memory (torch.autograd.graph.save_on_cpu around the layer's checkpoint call, pinned "
                           "where there is a GPU) and copied back for its recomputation; same loss and gradients, "
                           "n × hidden × layers values off the device")
    tiled_mlp: bool | int = Field(
        False, description="each decoder layer's MLP over slices of the sequence (DeepSpeed's TiledMLP, "
                           "pip install 'ropescale[scale]'): true → ⌈n / hidden⌉ slices, or a count; one slice's "
                           "MLP activations at a time; same loss and gradients to float rounding")
    tiled_norms: bool | int = Field(
        False, description="each norm over the residual stream (decoder layers' and the final one) over slices of "
                           "the sequence the same way (DeepSpeed's TiledMLP): only its input kept, one slice's "
                           "float32 intermediates at a time; the same output, gradients to float rounding")
    loss_chunk_size: int | None = Field(
        None, ge=0, description="positions per chunk of the LM head in the loss (ropescale.lm_head: [chunk, V] "
                                "logits at a time, recomputed in backward); None: chosen from a memory budget; "
                                "0 or false: the model's own labels= loss over [b, s, V] logits")
    recipe: RecipeSpec = Field(default_factory=RecipeSpec, description="what trains and how it is saved: "
                               "full (default), lora, longlora, ... (ropescale.training.recipes)")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters (PEFT) instead of all the weights: "
                                                        "the lora recipe with these options")
    sharding: str | None = Field(None, description="'fsdp' (FSDP2, FULL_SHARD per decoder layer: accelerate's on "
                                                   "GPUs, torch's fully_shard on CPU processes) or an accelerate FSDP "
                                                   "plugin config file (GPUs)")
    parallelism: Parallelism = Field(default_factory=Parallelism,
                                     description="sequence: processes per sequence-parallel group (Ulysses)")
    report_to: list[str] = Field(default_factory=list,
                                 description="accelerate trackers to report loss, learning rate and held-out PPL to "
                                             "(tensorboard, wandb, mlflow, ...; log.jsonl is always written)")
    _report_to = field_validator("report_to", mode="before")(tracker_names)

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, v: Any) -> Any:
        try:
            spec = parse_strategy(v)
        except (KeyError, ValueError) as e:
            raise ValueError(str(e).strip("'\"")) from None
        if spec.profiles:
            raise ValueError(f"{spec.display}: profiles pick a factor per served request; fine-tune with one factor "
                             "(each profile's, or the largest) and export profiles from it")
        return spec

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
            raise ValueError(f"must be at least 1 optimiser step; got {v}")
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_STEPS:
            raise ValueError(f"{v} optimiser steps is more than any run takes; at most {MAX_STEPS}")
        return v

    @field_validator("loss_chunk_size", mode="before")
    @classmethod
    def _chunk(cls, v: Any) -> Any:
        if v is False:  # `loss_chunk_size: false`: the plain loss
            return 0
        if v is True:
            raise ValueError("true is not a chunk size; give a number of positions, null (chosen from a memory "
                             "budget) or false (the model's own loss)")
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, v: Any) -> Any:
        if v is False:
            return None
        if v is not None:
            import importlib.util

            if importlib.util.find_spec("peft") is None:
                raise ValueError("needs PEFT, which is not installed: pip install 'ropescale[lora]' (peft>=0.13)")
        return v

    @field_validator("sharding")
    @classmethod
    def _sharding(cls, v: str | None) -> str | None:
        if v is not None:
            _fsdp_kwargs(v)  # a bad file fails now
        return v

    @model_validator(mode="after")
    def _consistent(self) -> FinetuneConfig:
        from ropescale.strategies import get_strategy

        if self.pose.enabled and get_strategy(self.strategy.name).kind == "attention":
            raise ValueError(f"pose: {self.strategy.name} is a relative-position rule: it places keys by their slot "
                             "in the window, not by position_ids, so PoSE's skipped positions never reach it; "
                             "use PoSE with a frequency strategy")
        if self.eval is not None and self.eval.data.spec().describe() == self.data.spec().describe():
            raise ValueError(f"eval.data: {self.data.source} is also the training data; held-out perplexity must "
                             "be measured on text the model is not trained on")
        windows = self.steps * self.grad_accum * self.batch_size
        if windows > MAX_WINDOWS:
            raise ValueError(f"steps × grad_accum × batch_size = {windows} training windows per process; at most "
                             f"{MAX_WINDOWS} (their indices overflow)")
        if self.mixed_precision == "fp16" and self.device == "cpu":
            raise ValueError("mixed_precision: fp16 needs a CUDA device; on CPU use bf16 or no")
        if self.sharding is not None and self.device == "cpu" and self.sharding != "fsdp":
            raise ValueError(SHARDING_ON_CPU)
        if self.parallelism.sequence > 1:
            from ropescale.training.sequence_parallel import deepspeed_available

            if not deepspeed_available():
                raise ValueError("parallelism.sequence: sequence parallelism runs on DeepSpeed's Ulysses, which is "
                                 "not installed: pip install 'ropescale[scale]'")
        if self.lora is not None and self.recipe.name != "full":
            raise ValueError(f"lora: the lora section is the lora recipe; recipe: {self.recipe.name} is also given — "
                             "keep one")
        recipe = self.training_recipe()
        self._check_memory_options(recipe)
        if self.sharding is not None and not recipe.shards:
            raise ValueError(f"sharding: not combined with {recipe.name} here (LoRA freezes the base weights, so "
                             "with gradient_checkpointing an 8B model trains on one GPU); use sharding for full "
                             "fine-tuning")
        return self

    def _check_memory_options(self, recipe) -> None:
        """``activation_offload``, the tilings and ``dtype``: what each needs (``ValueError``, one line)."""
        if self.activation_offload and not self.gradient_checkpointing:
            raise ValueError("activation_offload: needs gradient_checkpointing: true (without it every activation, and "
                             "every weight a layer keeps for backward, would be copied to the host each step)")
        for key in ("tiled_mlp", "tiled_norms"):
            value = getattr(self, key)
            if value is False:
                continue
            from ropescale.training.tiling import tiled_mlp_available

            if value is not True and value < 1:
                raise ValueError(f"{key}: true or a number of slices (at least 1); got {value}")
            if not tiled_mlp_available():
                raise ValueError(f"{key}: DeepSpeed's TiledMLP is not installed: pip install 'ropescale[scale]'")
        if self.dtype == "float32":
            return
        if self.mixed_precision != "bf16":
            raise ValueError(f"dtype: {self.dtype} computes under autocast: set mixed_precision: bf16 too (the "
                             f"trained weights stay float32 and meet the {self.dtype} base there)")
        if not recipe.frozen_base:
            raise ValueError(f"dtype: {self.dtype} is for a frozen base (lora, longlora); recipe {recipe.name} trains "
                             "every weight, whose master copy stays float32 (mixed_precision: bf16 computes in "
                             "bfloat16)")
        if self.dtype == "nf4":
            check_nf4(self.device)

    def training_recipe(self):
        """The ``ropescale.training.recipes.Recipe`` this run trains with (``lora:`` → ``lora``)."""
        from ropescale.training.recipes import build_recipe

        return build_recipe("lora", self.lora) if self.lora is not None else self.recipe.build()

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same run (a rerun with the same identity resumes): everything
        but where it runs and what is evaluated after training."""
        # gradient checkpointing and the loss's chunking change how the same numbers are computed, not
        # what is trained (float tolerance); leaving them out keeps earlier runs' manifests valid
        # sequence parallelism too: the same global batches, each window's loss and gradient split over a group
        out = self.model_dump(mode="json", exclude={"output", "device", "threads", "keep_checkpoints",
                                                    "gradient_checkpointing", "activation_offload", "tiled_mlp",
                                                    "tiled_norms", "loss_chunk_size", "parallelism", "report_to"})
        if out.get("eval"):
            out["eval"].pop("after", None)
        if not self.pose.enabled or self.pose.sampling == "paper":  # runs from before the key resume
            out["pose"].pop("sampling", None)
        if self.pose.window is None:  # the default (T): runs from before the key resume
            out["pose"].pop("window", None)
        if out.get("recipe") == {"name": "full", "options": {}}:  # the default: runs from before the key resume
            out.pop("recipe")
        if out.get("dtype") == "float32":  # the default: runs from before the key resume
            out.pop("dtype")
        return out


def check_nf4(device: str) -> None:
    """``dtype: nf4`` (QLoRA's 4-bit base) needs bitsandbytes and a CUDA device: ``ValueError`` in one
    line otherwise (``device``: the config's, or the device the run resolved to)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device.startswith("mps"):
        raise ValueError(f"dtype: nf4 quantizes the base with bitsandbytes on a CUDA device; this run is on {device} "
                         "(use dtype: bfloat16 there)")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("dtype: nf4 needs bitsandbytes: pip install 'ropescale[qlora]'")


SHARDING_ON_CPU = ("sharding: an FSDP plugin file is accelerate's, which shards only on GPUs (on CPU processes it "
                   "falls back to plain data parallelism without a word); on the CPU ropescale shards with torch's "
                   "fully_shard: use sharding: fsdp")

def build_finetune_config(raw: Any, source: str = "config") -> FinetuneConfig:
    """Validate a raw mapping. Raises ``ConfigError`` naming the key (unknown key with the known
    ones, steps ≤ 0, unknown strategy, PoSE with a relative-position rule, ...)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys (model, strategy, data, length, steps, ...)")
    try:
        return FinetuneConfig.model_validate(raw)
    except ValidationError as e:
        raise explain(e, source, FinetuneConfig) from None


def load_finetune_config(path: str | Path | None, overrides: list[str] = (),
                         flags: dict | None = None) -> FinetuneConfig:
    """A YAML file (or none), then ``flags`` (values that are not None), then ``--set key=value``
    overrides (dots for nesting: ``pose.chunks=3``). Raises ``ConfigError`` in one line."""
    raw, source = load_raw(path, overrides, flags)
    return build_finetune_config(raw, source)


class ResolvedRun(BaseModel):
    """A config with what the model's configuration decides: the original window T and the
    strategy's parameters filled for the target length."""

    model_config = ConfigDict(frozen=True)
    train_length: int  # T
    params: dict[str, Any]
    kind: str  # "frequency" | "attention"
    window: int  # tokens per training example: T with PoSE, else L
    eval_lengths: list[int]

    def strategy_spec(self, cfg: FinetuneConfig) -> StrategySpec:
        """The strategy with every parameter fixed (how the harness must evaluate the result)."""
        return StrategySpec(name=cfg.strategy.name, params=self.params, logn=cfg.strategy.logn,
                            temperature=cfg.strategy.temperature, label=cfg.strategy.label)


def _dry_compute(strat, params: dict[str, Any], context: dict[str, Any], train_length: int, length: int) -> None:
    """The strategy computed once for the model's rotary sizes (``context``: d, b and DCA's
    defaults from its config), T and L, as the patch will: a parameter only these refuse (dca's
    ``local_window`` ≥ ``chunk_size``) fails here, before any folder is claimed or weights loaded.
    Raises ``ValueError`` in one line."""
    from ropescale.strategies.registry import OPTIONAL_CONTEXT

    context = {**context, "original_max_position_embeddings": train_length, "seq_len": length}
    if all(context.get(k) is not None or k in OPTIONAL_CONTEXT for k in strat.needs):
        strat.compute(context, params)


def resolve(cfg: FinetuneConfig, source: str = "config") -> ResolvedRun:
    """Fill what depends on the model (T) and check it: PoSE needs ``length`` > T and at most T
    chunks; the strategy's parameters, filled for L, are computed once for the model's sizes.
    Raises ``ConfigError`` (one line) or ``ModelLoadError`` for a model that cannot be read."""
    from ropescale.runs.lifecycle import configured_context, configured_window
    from ropescale.strategies import get_strategy

    T = configured_window(cfg.model, cfg.original_max_position_embeddings)
    L = cfg.length
    if cfg.pose.enabled:
        if L <= T:
            raise ConfigError(f"{source}: pose: length {L} is not above the model's original window T = {T}; PoSE "
                              "trains on windows of T tokens to reach a longer target length")
        window = cfg.pose.window or T
        if window > T:
            raise ConfigError(f"{source}: pose.window: {window} tokens is above the model's original window T = {T}; "
                              "PoSE trains on windows inside T whose positions reach the target length")
        if cfg.pose.chunks > window:
            size = f"{window} tokens (pose.window)" if cfg.pose.window else f"T = {T} tokens"
            raise ConfigError(f"{source}: pose.chunks: {cfg.pose.chunks} chunks cannot split a window of {size}")
    strat = get_strategy(cfg.strategy.name)
    try:
        context = configured_context(cfg.model)
        params = strat.resolve(cfg.strategy.params, length=L, train_length=T, context=context)
        _dry_compute(strat, params, context, T, L)
    except ValueError as e:
        raise ConfigError(f"{source}: strategy: {e}") from None
    lengths = list(cfg.eval.lengths) if cfg.eval and cfg.eval.lengths else []
    if cfg.eval and not lengths:
        n = T
        while n < L:
            lengths.append(n)
            n *= 2
        lengths.append(L)
    run = ResolvedRun(train_length=T, params=params, kind=strat.kind,
                      window=(cfg.pose.window or T) if cfg.pose.enabled else L,
                      eval_lengths=lengths)
    if cfg.parallelism.sequence > 1:  # what the model's configuration decides; its attention is checked once loaded
        from ropescale.models import model_config
        from ropescale.rope_config import text_config
        from ropescale.training.sequence_parallel import check_sequence_parallel

        check_sequence_parallel(cfg.parallelism.sequence, config=text_config(model_config(cfg.model)), kind=run.kind,
                                window=run.window, pose=cfg.pose.enabled, source=source)
    return run

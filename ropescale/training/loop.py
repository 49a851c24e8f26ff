"""The fine-tuning run: load → patch → train with accelerate → save → evaluate.

Built on accelerate's ``Accelerator``: device placement, data parallelism when launched with
``accelerate launch`` (DDP; each process reads its share of every global batch, gradients are
averaged, the loss logged is the mean over all processes), gradient accumulation, mixed
precision, gradient clipping, and ``save_state``/``load_state`` checkpoints. AdamW from torch,
warm-up + linear / cosine / constant schedule from transformers (stepped once per optimiser step
whatever the number of processes, so the learning-rate curve does not depend on it).

What trains and how the result is saved is the run's recipe (``ropescale.training.recipes``:
``full`` — all parameters, the default; ``lora``; ``longlora``; one module each). The model is
trained in training mode — the model's own dropout
settings apply — with ``use_cache=False`` and an explicit all-ones attention mask (without one,
transformers reads position ids that jump, as PoSE's do, as packed sequences and masks the
chunks from each other). Dynamic strategies use the target length L while training
(``PatchHandle.train_at``).

What makes a long window fit (an 8B model at 32k tokens): ``gradient_checkpointing`` (transformers'
non-reentrant checkpointing: each decoder layer's activations are recomputed in backward, so one
layer's are held at a time; the patch lives in the rotary module, computed once outside the
layers, and in the attention function, recomputed with its layer — frequency, dynamic, log-n and
relative-position rules alike); the loss from ``ropescale.lm_head`` (the LM head over chunks of
``loss_chunk_size`` positions, recomputed in backward: never the ``[b, s, V]`` logits); the
``lora`` / ``longlora`` recipes (PEFT adapters on a frozen base model, applied by the recipe's
``prepare`` *after* the patch, which stays active inside the PEFT wrapper; LongLoRA's embeddings
and norms through ``modules_to_save``); ``sharding`` (FSDP2: accelerate's on CUDA devices, torch's
``fully_shard`` on CPU processes — ``ropescale.training.sharding``, the chunked loss inside the
sharded forward); ``parallelism.sequence`` (DeepSpeed's Ulysses around the patched attention:
``ropescale.training.sequence_parallel``).

The output folder holds one run (as a harness results folder holds one experiment):
``manifest.json`` (the run's identity: config, weights and data fingerprints, processes,
library versions; a rerun with another identity is refused, with the same identity it resumes
from the last checkpoint — same data order, bit-exact on CPU), a lock against two runs at once,
``log.jsonl`` and ``loss.png`` (``ropescale.training.report``), ``checkpoints/step-NNNNNN/``
(``save_state``; removed once the model is saved), ``model/`` (``ropescale.save_patched``, or with
``lora.save: adapter`` ``ropescale.models.save_adapter``, plus ``finetune.json``: the config,
resolved parameters and a summary) and ``eval/<task>/`` (harness
experiments on the saved model). Only the main process writes, except accelerate's per-process
RNG state files inside a checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ropescale.errors import OutputError, RopescaleError
from ropescale.lm_head import OutputHead
from ropescale.lm_head import causal_lm_loss as chunked_lm_loss
from ropescale.models import resolve_device
from ropescale.patching import patch, unpatch
from ropescale.rotary import NoRotaryEmbeddingError
from ropescale.runs.config import ConfigError
from ropescale.runs.lifecycle import claimed_folder, load_inputs, load_run_model, run_identity
from ropescale.runs.manifest import check_manifest, environment
from ropescale.runs.processes import on_main, process_state
from ropescale.runs.trackers import check_installed, flat_settings
from ropescale.training.checkpoints import CHECKPOINTS, CheckpointWriteError, save_checkpoint
from ropescale.training.checkpoints import complete_checkpoints as _checkpoints
from ropescale.training.config import (
    SHARDING_ON_CPU,
    FinetuneConfig,
    ResolvedRun,
    check_nf4,
    fsdp_plugin_kwargs,
    resolve,
)
from ropescale.training.data import TrainingWindows, token_stream
from ropescale.training.heldout import HeldOut
from ropescale.training.pose import PoseSampler
from ropescale.training.report import LOG, TrainingLog, plot_training, read_log
from ropescale.training.sharding import full_state_dict, load_sharded, save_sharded, shard_model
from ropescale.training.tiling import enable_tiled_mlp, enable_tiled_norms

__all__ = [
    "CHECKPOINTS",
    "MODEL_DIR",
    "SUMMARY",
    "CheckpointWriteError",
    "causal_lm_loss",
    "enable_checkpointing",
    "finetune",
]

MODEL_DIR = "model"
SUMMARY = "finetune.json"
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


class NonFiniteLossError(RopescaleError, ValueError):
    """The training loss became inf or NaN: the run stops (no model saved; checkpoints kept)."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "params":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def causal_lm_loss(model, batch: dict[str, torch.Tensor], *, chunk_size: int | None = None,
                   head: OutputHead | None = None) -> torch.Tensor:
    """Mean next-token NLL [nats] of ``batch["input_ids"]`` ``[b, s]`` at ``batch["position_ids"]``
    ``[b, s]`` (PoSE) or 0 … s−1. The attention mask is given explicitly (all ones): without one,
    transformers takes position ids that jump for packed sequences and keeps the chunks of a PoSE
    example from attending to each other.

    ``chunk_size``: positions per chunk of the LM head (``ropescale.lm_head.causal_lm_loss``:
    ``[b, chunk, V]`` logits at a time, recomputed in backward); None: chosen there from a memory
    budget; 0: the model's own ``labels=`` loss over the full ``[b, s, V]`` logits. ``head``: an
    ``OutputHead(model)`` kept across calls. Works on DDP- and PEFT-wrapped models."""
    ids = batch["input_ids"]
    mask, pos = torch.ones_like(ids), batch.get("position_ids")
    if chunk_size == 0:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=ids, use_cache=False).loss
    return chunked_lm_loss(model, ids, position_ids=pos, attention_mask=mask, chunk_size=chunk_size, head=head)


def enable_checkpointing(model, source: str = "config", *, offload: bool = False) -> None:
    """transformers' non-reentrant activation checkpointing on every decoder layer of ``model``
    (``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``): in training
    mode each layer keeps only its input and recomputes the rest in backward (same RNG state, so
    dropout draws the same masks). Raises ``ConfigError`` for a model that does not support it.

    ``offload`` (``activation_offload``): each checkpointed layer's input — what it keeps — goes to
    host memory as the layer runs and comes back for its recomputation, through
    ``torch.autograd.graph.save_on_cpu`` around the layer's checkpoint call (pinned where there is a
    GPU; a plain copy on a CPU-only machine), as transformers' own ``offload=True`` does (whose
    pinned buffers fail on a machine without an accelerator)."""
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as e:
        raise ConfigError(f"{source}: gradient_checkpointing: {e}") from None
    if offload:
        layers = [m for m in model.modules() if callable(getattr(m, "_gradient_checkpointing_func", None))]
        if not layers:
            raise ConfigError(f"{source}: activation_offload: {type(model).__name__} checkpoints no layer through "
                              "transformers' checkpointing function, so there is nothing to offload")
        for layer in layers:
            layer._gradient_checkpointing_func = _offloaded(layer._gradient_checkpointing_func)


def _offloaded(checkpoint_fn):
    """``checkpoint_fn`` with what it saves (the layer's inputs) kept in host memory."""
    def run(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):  # torch pins only where a GPU is
            return checkpoint_fn(*args, **kwargs)

    return run


def _patch_for_training(model, cfg: FinetuneConfig, run: ResolvedRun):
    unpatch(model)  # a patch saved with the model would stack under this one
    kwargs: dict[str, Any] = {"original_max_position_embeddings": run.train_length, "logn": cfg.strategy.logn,
                              "temperature": cfg.strategy.temperature}
    if cfg.attention_path:
        kwargs["attention_path"] = cfg.attention_path
    handle = patch(model, cfg.strategy.name, **kwargs, **run.params)
    handle.train_at(cfg.length)  # dynamic strategies train at the target length L
    model.config.use_cache = False
    return handle


class AfterTraining(Protocol):
    """What runs on the saved model after training (the harness's ``eval.after`` experiments:
    ``eval.finetune.HarnessEvaluations``). ``check`` runs before step 1 (``processes``: the
    launched processes, which run the evaluations too) and raises ``ConfigError`` in one line;
    ``run`` returns ``{name: records}``."""

    def check(self, cfg: FinetuneConfig, run: ResolvedRun, source: str, *, processes: int = 1) -> None: ...

    def run(self, cfg: FinetuneConfig, run: ResolvedRun, model_dir: Path, output: Path, *, progress: bool,
            say) -> dict[str, list[dict]]: ...


def finetune(cfg: FinetuneConfig, output: str | Path, *, progress: bool = True, stop_after: int | None = None,
             source: str = "config", after: AfterTraining | None = None) -> dict[str, Any]:
    """Run (or resume, or just evaluate when already trained) the fine-tuning run ``cfg`` into
    ``output``. Returns a summary: ``model`` (the saved folder), ``steps``, ``final_loss``,
    ``ppl`` (last held-out evaluation, ``{length: PPL}``), ``evaluations`` (``{name: harness
    records}``), ``resumed_from`` (step), ``train_seconds``.

    ``stop_after``: stop after this many steps as a killed run would (no model saved; the
    checkpoints stay) — for tests and time-boxed runs.

    Every refusal of the input comes before ``output`` is claimed (created, locked, its manifest
    written): the data is read and the model loaded, patched and wrapped by its recipe first, so a
    corrected rerun into the same folder is not refused as another experiment. Only the folder's
    own state (another run in it, or running) and what happens while training come after.

    Raises (one-line messages): ``ConfigError`` (PoSE length ≤ T, a bad strategy parameter — also
    one only the model's sizes refuse, such as dca's ``local_window`` ≥ ``chunk_size`` — or
    evaluation entry), ``OutputError`` (output not writable), ``ropescale.models.ModelLoadError``,
    ``ConfigError`` also for ``sharding`` other than ``fsdp`` without CUDA devices (accelerate 1.15
    does not shard on CPU; ``fsdp`` there is torch's ``fully_shard``) or in one CPU process,
    ``parallelism.sequence`` the launched processes, the model's heads or its attention cannot
    take, LoRA target modules the model does not have, a LoRA rank above the target layers'
    smallest dimension, LongLoRA ``trainable_params`` in no parameter name,
    ``ropescale.runs.data.DataError`` / ``ropescale.runs.windows.WindowError`` (data too short or unreadable),
    ``ValueError`` (device, patch); once the folder is claimed
    ``ropescale.runs.manifest.ExperimentMismatchError`` (the folder holds another run),
    ``ropescale.runs.manifest.FolderBusyError`` (another run holds it) — under a launch both raised
    on every process —, ``OutputError`` (a ``report_to`` tracker cannot write its folder, before step 1),
    ``CheckpointWriteError`` (an ``OutputError``: a checkpoint
    could not be written, a full disk; a rerun resumes from the last complete one),
    ``NonFiniteLossError`` (a ``ValueError``: the training loss became inf or NaN at a step; no
    model saved, the checkpoints kept).
    """
    from accelerate import Accelerator

    run = resolve(cfg, source)
    evaluated = bool(cfg.eval and cfg.eval.after)
    if evaluated and after is None:
        raise ConfigError(f"{source}: eval.after: harness experiments need the harness; run it with "
                          "`ropescale finetune` or eval.finetune.run_finetune (this call only trains)")
    device = resolve_device(cfg.device)  # a device that is not there fails first
    # under a launch: the process group, set up once per process and kept for every later run in it
    # (the after-training evaluations, another fine-tuning): ropescale.runs.processes
    processes = process_state(cpu=device.type == "cpu").num_processes
    if evaluated:
        after.check(cfg, run, source, processes=processes)  # a bad evaluation fails now, not after training
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    plugin = None
    if cfg.sharding is not None and device.type == "cpu" and cfg.sharding != "fsdp":
        raise ConfigError(f"{source}: {SHARDING_ON_CPU}")
    if cfg.sharding is not None and device.type != "cpu":  # CPU: torch's fully_shard (ropescale.training.sharding)
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(cfg.sharding, source))
    # accelerate keeps one AcceleratorState per process and refuses another mixed precision in it; a
    # process running several fine-tunings (tests, notebooks) starts each afresh, on the process group
    # the first one set up (``process_state``)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    # cpu=True also makes processes started by torchrun (`accelerate launch --multi_gpu` on a machine
    # without GPUs) one gloo group; without it each would train alone and write the same files
    trackers = check_installed(cfg.report_to, source)  # before anything is written
    acc = Accelerator(cpu=device.type == "cpu", mixed_precision=cfg.mixed_precision, fsdp_plugin=plugin,
                      gradient_accumulation_plugin=_accumulation(cfg), log_with=trackers or None,
                      project_dir=str(output) if trackers else None)
    try:
        summary = _claim_and_run(cfg, run, Path(output), acc, progress and acc.is_main_process, stop_after, after,
                                 source, plugin is not None)
    except BaseException:
        _leave(acc, together=False)
        raise
    _leave(acc)
    return summary


def _claim_and_run(cfg: FinetuneConfig, run: ResolvedRun, output: Path, acc, progress: bool, stop_after: int | None,
                   after: AfterTraining | None, source: str, sharding: bool) -> dict[str, Any]:
    sp_size = cfg.parallelism.sequence
    if sp_size > 1 and acc.num_processes % sp_size:
        raise ConfigError(f"{source}: parallelism.sequence: {sp_size} does not divide the {acc.num_processes} "
                          f"launched process(es); launch a multiple of {sp_size} "
                          f"(accelerate launch --multi_gpu --num_processes {sp_size} ...)")
    if cfg.mixed_precision == "fp16" and acc.device.type == "cpu":
        raise ConfigError(f"{source}: mixed_precision: fp16 needs a CUDA device; on CPU use bf16 or no")
    if cfg.sharding is not None and acc.device.type == "cpu" and acc.num_processes == 1:
        raise ConfigError(f"{source}: sharding: one process holds the whole model either way; launch several "
                          "(accelerate launch --multi_gpu --num_processes N ...) or leave sharding out")
    if sharding and acc.num_processes > 1 and acc.distributed_type.value != "FSDP":
        raise ConfigError(f"{source}: sharding: accelerate set up {acc.distributed_type.value}, not FSDP, for "
                          f"{acc.num_processes} processes; launch with `accelerate launch --multi_gpu`")
    with _loading_bars(progress):
        # everything that can refuse the run does so here, before the folder is claimed (created, locked, its
        # manifest written): a refused run leaves nothing behind, and the corrected rerun is not "another experiment"
        prepared = _prepare(cfg, run, acc, source, trained=(output / MODEL_DIR / SUMMARY).is_file())
        with claimed_folder(output, acc) as folder:
            return _run_locked(cfg, run, folder, acc, progress, stop_after, after, prepared, source)


def _accumulation(cfg: FinetuneConfig):
    """accelerate's accumulation settings: ``grad_accum`` micro-steps per optimiser step, × P under
    sequence parallelism (each batch read becomes P micro-batches, one per process of the group:
    ``SequenceParallel.shard``) — and then synchronised by count alone, since the loader's end is
    reached P − 1 micro-batches before the last one runs."""
    from accelerate.utils import GradientAccumulationPlugin

    sp = cfg.parallelism.sequence
    return GradientAccumulationPlugin(num_steps=cfg.grad_accum * sp, sync_with_dataloader=sp == 1)


def _check_sequence_parallel(model, cfg: FinetuneConfig, run: ResolvedRun, source: str) -> None:
    """The loaded model's side of ``check_sequence_parallel`` (its heads, layer types and attention
    implementation; ``ConfigError``), before the run's folder is claimed."""
    if cfg.parallelism.sequence == 1:
        return
    from ropescale.rope_config import text_config
    from ropescale.training.sequence_parallel import check_sequence_parallel

    check_sequence_parallel(cfg.parallelism.sequence, config=text_config(model.config), kind=run.kind,
                            window=run.window, pose=cfg.pose.enabled,
                            attn_implementation=model.config._attn_implementation, source=source)


def _sequence_parallel(model, cfg: FinetuneConfig):
    """``SequenceParallel`` around the patched model's attention (None when off; checked by
    ``_check_sequence_parallel`` in ``_prepare``)."""
    if cfg.parallelism.sequence == 1:
        return None
    from ropescale.training.sequence_parallel import SequenceParallel

    return SequenceParallel(model, cfg.parallelism.sequence, micro_batch_size=cfg.batch_size)


@contextmanager
def _loading_bars(show: bool):
    """transformers' weight-loading progress bars only where progress is shown."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@dataclass
class _Prepared:
    """What a run needs, built (and so checked) before its folder is claimed: the tokenizer, the
    training stream and — unless the folder already holds the trained model — the held-out windows,
    the training windows and the patched model wrapped by its recipe."""

    tokenizer: Any
    stream: torch.Tensor
    heldout: HeldOut | None = None
    dataset: TrainingWindows | None = None
    model: Any = None
    recipe: Any = None


def _prepare(cfg: FinetuneConfig, run: ResolvedRun, acc, source: str, *, trained: bool) -> _Prepared:
    """Read the data and build the model to train: the data source and its windows (``DataError``,
    ``WindowError``), the model (``ModelLoadError``), the strategy patched onto it at the target
    length (``ConfigError``: a parameter the model's sizes refuse), activation checkpointing and
    the recipe's wrapping (``ConfigError``: LoRA targets the model lacks, a rank above the target
    layers' sizes, LongLoRA's ``trainable_params`` matching nothing). ``trained``: the folder holds
    the saved model already — only the tokenizer and the stream (the run's identity) are read."""
    from accelerate.utils import set_seed

    # the run's lifecycle (ropescale.runs.lifecycle): tokenizer and data once, the model with that tokenizer
    inputs = load_inputs(cfg.model, cfg.data.spec())
    tokenizer = inputs.tokenizer
    stream = token_stream(inputs.docs, tokenizer.eos_token_id)
    if trained:
        return _Prepared(tokenizer, stream)
    heldout = (HeldOut(tokenizer, cfg.eval.data, run.eval_lengths, max_windows=cfg.eval.max_windows,
                       batch_size=cfg.eval.batch_size) if cfg.eval else None)
    pose = (PoseSampler(run.window, cfg.length, cfg.pose.chunks, cfg.pose.content, cfg.pose.sampling)
            if cfg.pose.enabled else None)
    examples = cfg.steps * cfg.grad_accum * cfg.batch_size * acc.num_processes
    dataset = TrainingWindows(stream, pose.span if pose else cfg.length, examples, cfg.seed, pose)
    set_seed(cfg.seed)  # before the model: a recipe's initialisation (LoRA's A) draws from it
    # unpatched once an adapter base is merged (_patch_for_training)
    device, dtype, quantization = "cpu", cfg.dtype, None
    if cfg.dtype == "nf4":  # QLoRA: bitsandbytes quantizes the base on the run's GPU as it loads
        try:
            check_nf4(str(acc.device))
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        device, dtype, quantization = str(acc.device), "bfloat16", "nf4"
    model = load_run_model(cfg.model, inputs, device=device, unpatched=False, dtype=dtype, quantization=quantization)
    if hasattr(model, "merge_and_unload") and hasattr(model, "peft_config"):  # a saved adapter as the base
        model = model.merge_and_unload()
    try:
        _patch_for_training(model, cfg, run)
    except NoRotaryEmbeddingError:
        raise
    except ValueError as e:  # InvalidInput too: a parameter this model's sizes refuse
        raise ConfigError(f"{source}: strategy: {' '.join(str(e).split())}") from None
    if cfg.gradient_checkpointing:  # before PEFT: the decoder layers are the base model's
        enable_checkpointing(model, source, offload=cfg.activation_offload)
    if cfg.tiled_mlp is not False:  # before PEFT too: the MLPs are the base model's
        enable_tiled_mlp(model, None if cfg.tiled_mlp is True else cfg.tiled_mlp, source)
    if cfg.tiled_norms is not False:
        enable_tiled_norms(model, None if cfg.tiled_norms is True else cfg.tiled_norms, source)
    recipe = cfg.training_recipe()
    model = recipe.prepare(model, cfg, source)  # what trains: all weights, LoRA, ... (ropescale.training.recipes)
    _check_sequence_parallel(model, cfg, run, source)
    return _Prepared(tokenizer, stream, heldout, dataset, model, recipe)


def _start_trackers(acc, cfg: FinetuneConfig, output: Path) -> None:
    """The trackers' run, named after the output folder, with the run's identity as its settings,
    started by the main process (accelerate's trackers write from there only); every process
    raises its refusal (``on_main``). Raises ``OutputError`` in one line when a tracker cannot
    write its folder (a file in its place, a read-only file system); the trackers that started
    are closed."""
    settings = flat_settings(cfg.identity())

    def start() -> None:
        try:
            acc.init_trackers(output.name, config=settings)
        except OSError as e:
            for tracker in acc.trackers:
                with suppress(Exception):  # one that did not start has nothing to close
                    tracker.finish()
            acc.trackers = []
            folder = output / output.name
            why = "a file is in its place" if folder.exists() and not folder.is_dir() else e.strerror or str(e)
            raise OutputError(f"report_to: {', '.join(cfg.report_to)} cannot write its logs in {folder} ({why}); "
                              "make that a writable folder or leave report_to out") from None

    on_main(acc, start)


def _leave(acc, *, together: bool = True) -> None:
    """The trackers (``report_to``) flushed and closed; a launched run's processes leave together
    (``together``; a run stopped by an error leaves at once). The process group stays open for a
    later run in the process and is closed when the interpreter exits
    (``ropescale.runs.processes``)."""
    for tracker in getattr(acc, "trackers", None) or []:
        tracker.finish()
    acc.trackers = []
    if together and acc.num_processes > 1:
        acc.wait_for_everyone()


def _run_locked(cfg: FinetuneConfig, run: ResolvedRun, output: Path, acc, progress: bool,
                stop_after: int | None, after: AfterTraining | None, prepared: _Prepared,
                source: str) -> dict[str, Any]:
    stream = prepared.stream
    env = environment()
    ident = run_identity({**_flat(cfg.identity()), "processes": acc.num_processes}, model=cfg.model, docs=[stream],
                         env=env)
    check_manifest(output, ident, cfg.model_dump(mode="json"), acc)
    say = print if progress else (lambda *a, **k: None)
    summary_path = output / MODEL_DIR / SUMMARY
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        say(f"{output}: already trained ({summary['steps']} steps); model in {output / MODEL_DIR}")
    else:
        if prepared.model is None:  # the saved model was there when checked, and is not now
            prepared = _prepare(cfg, run, acc, source, trained=False)
        with ExitStack() as cleanup:  # sequence parallelism's attention wrapper is removed when training ends
            summary = _train(cfg, run, output, acc, prepared, env, progress, stop_after, say, cleanup)
        if summary is None:
            return {"stopped_at": stop_after, "model": None}
    evaluations = (after.run(cfg, run, output / MODEL_DIR, output, progress=progress, say=say)
                   if after is not None and cfg.eval and cfg.eval.after else {})
    return {**summary, "model": str(output / MODEL_DIR), "evaluations": evaluations,
            "main_process": acc.is_main_process}


@dataclass
class _Loop:
    """What the training loop runs with (``_setup_loop``): the prepared model, optimiser, schedule
    and batches (resumed), how the loss is computed (sharded or not, chunked head, sequence
    parallelism), the training log, the step resumed from, the run's label and tokens per step."""

    model: Any
    optimizer: Any
    scheduler: Any
    batches: Any
    inner: Any  # the unwrapped model (evaluated, saved)
    own_fsdp: bool  # torch's fully_shard (CPU processes) rather than accelerate's
    sharded: bool
    chunk_size: int | None
    head: OutputHead | None
    in_forward: Any  # in_forward(fn, *a, **k): fn(model, *a, **k), inside the sharded root's forward where there is one
    sp: Any
    log: TrainingLog
    start: int
    label: str
    tokens_per_step: int
    counts: dict[str, int]
    recipe: Any  # the run's ropescale.training.recipes.Recipe: saves the trained model


def _train(cfg: FinetuneConfig, run: ResolvedRun, output: Path, acc, prepared: _Prepared, env, progress: bool,
           stop_after: int | None, say, cleanup: ExitStack) -> dict[str, Any] | None:
    """Train (or go on training) and save; the summary, or None when stopped at ``stop_after``."""
    loop = _setup_loop(cfg, run, output, acc, prepared, say, cleanup)
    heldout = prepared.heldout

    def evaluate(step: int) -> dict[str, float]:
        if loop.sharded:  # every process runs every window through the sharded model, so its collectives line up
            ppl = loop.in_forward(lambda m: heldout.perplexity(m, device=acc.device))
        else:
            ppl = heldout.perplexity(loop.inner, device=acc.device, process_index=acc.process_index,
                                     num_processes=acc.num_processes)
        record = {"step": step, "ppl": {str(k): round(v, 4) for k, v in ppl.items()}}
        loop.log.write(record)
        return record["ppl"]

    last_ppl = None
    if heldout is not None and loop.start == 0:
        last_ppl = evaluate(0)
        say("step 0: held-out PPL " + ", ".join(f"{k}: {v:.2f}" for k, v in last_ppl.items()))
    ran = _run_steps(cfg, output, acc, loop, evaluate if heldout is not None else None, progress, stop_after,
                     last_ppl)
    if ran is None:
        return None
    return _save_trained(cfg, run, output, acc, loop, prepared.tokenizer, env, say, *ran)


def _setup_loop(cfg: FinetuneConfig, run: ResolvedRun, output: Path, acc, prepared: _Prepared, say,
                cleanup: ExitStack) -> _Loop:
    """The model put in training mode and wrapped (sequence parallelism, sharding, accelerate), the
    optimiser, schedule and loader, the trackers and the log, and the last checkpoint restored."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    model, recipe = prepared.model, prepared.recipe
    model.train()
    sp = _sequence_parallel(model, cfg)
    if sp is not None:
        cleanup.callback(sp.close)
    # FSDP2 by torch's fully_shard where accelerate does not shard (CPU processes); model: the root unit
    own_fsdp = cfg.sharding is not None and acc.device.type == "cpu"
    if own_fsdp:
        model = shard_model(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = {"trainable_parameters": sum(p.numel() for p in trainable),
              "parameters": sum(p.numel() for p in model.parameters())}
    # fused: one kernel over all parameters, no temporaries (foreach allocates a copy of every
    # parameter's size in the step — tens of GB at 8B; the CPU loop one of the largest parameter's)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay,
                                  fused=not own_fsdp)  # fused takes no DTensor shards
    scheduler = get_scheduler(_SCHEDULES[cfg.schedule], optimizer, num_warmup_steps=cfg.warmup,
                              num_training_steps=cfg.steps)
    # its own generator: each iterator draws a base seed from the loader's generator, which would otherwise be the
    # global RNG — the uninterrupted run draws it before step 1, a resumed one after restoring the checkpoint's RNG
    # state, so dropout (LoRA's) drew other masks from there on than the uninterrupted run
    loader = DataLoader(prepared.dataset, batch_size=cfg.batch_size, shuffle=False,
                        generator=torch.Generator().manual_seed(cfg.seed))
    if own_fsdp:  # model and optimiser states sharded: saved by save_sharded, not by accelerate's main process
        loader = acc.prepare(loader)
    else:
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.register_for_checkpointing(scheduler)  # stepped by hand: once per optimiser step

    if cfg.report_to:
        _start_trackers(acc, cfg, output)
    log = TrainingLog(output / LOG, enabled=acc.is_main_process, tracker=acc if cfg.report_to else None)
    start = _resume(cfg, output, acc, model, optimizer, own_fsdp, log, say)
    batches = acc.skip_first_batches(loader, start * cfg.grad_accum) if start else loader
    if sp is not None:  # each batch read → P micro-batches of the group's shards
        batches = sp.shard(batches, acc.device)
    inner = model.model if own_fsdp else acc.unwrap_model(model)
    sharded = own_fsdp or acc.distributed_type.value == "FSDP"
    # accelerate's FSDP: the chunked head would run lm_head outside the model's forward, where its parameters are
    # sharded; ropescale's runs the loss inside the root unit's forward (ShardedModel)
    chunk_size = 0 if sharded and not own_fsdp else cfg.loss_chunk_size
    head = OutputHead(inner if own_fsdp else model) if chunk_size != 0 else None  # checked on the first step only
    in_forward = model if own_fsdp else (lambda fn, *a, **k: fn(model, *a, **k))  # ShardedModel(fn) runs fn inside
    label = cfg.strategy.display + (" + PoSE" if cfg.pose.enabled else "") + recipe.label
    tokens_per_step = cfg.batch_size * cfg.grad_accum * acc.num_processes * run.window
    return _Loop(model, optimizer, scheduler, batches, inner, own_fsdp, sharded, chunk_size, head, in_forward, sp,
                 log, start, label, tokens_per_step, counts, recipe)


def _resume(cfg: FinetuneConfig, output: Path, acc, model, optimizer, own_fsdp: bool, log: TrainingLog, say) -> int:
    """Restore the last complete checkpoint (accelerate's state; the sharded model's and optimiser's
    own) and cut the log after it; the step it was written at (0: none)."""
    done = _checkpoints(output)
    start = done[-1][0] if done else 0
    if done:
        acc.load_state(str(done[-1][1]))
        if own_fsdp:
            load_sharded(model, optimizer, done[-1][1])
        say(f"resuming from {done[-1][1]} (step {start} of {cfg.steps})")
    log.keep_through(start if done else -1)
    acc.wait_for_everyone()
    return start


def _micro_step(cfg: FinetuneConfig, acc, loop: _Loop, batch, losses: list) -> Any:
    """One micro-step under accelerate's accumulation: the loss (appended to ``losses``) and its
    backward; at an optimiser step the global gradient norm clipped (returned; None otherwise),
    the optimiser and the schedule stepped."""
    with acc.accumulate(loop.model):
        with acc.autocast():  # the chunked head runs outside the model's forward, under the same precision
            if loop.sp is None:
                loss = loop.in_forward(causal_lm_loss, batch, chunk_size=loop.chunk_size, head=loop.head)
            else:  # this process's share of the window's loss, × P: the group's gradients add up
                loss = (loop.in_forward(loop.sp.loss, batch, chunk_size=loop.chunk_size, head=loop.head)
                        * loop.sp.backward_scale)
        acc.backward(loss)
        losses.append(loss.detach().float())
        grad_norm = None
        if acc.sync_gradients and cfg.max_grad_norm:
            grad_norm = acc.clip_grad_norm_(loop.model.parameters(), cfg.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
        if acc.sync_gradients:  # accelerate's prepared optimiser skips the others itself; a sharded one is not
            loop.optimizer.step()
            loop.scheduler.step()
            loop.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _run_steps(cfg: FinetuneConfig, output: Path, acc, loop: _Loop, evaluate, progress: bool,
               stop_after: int | None, last_ppl) -> tuple[int, float, float, Any] | None:
    """The optimiser steps from ``loop.start`` to ``cfg.steps``: each logged, evaluated every
    ``eval.every`` (``evaluate``: None without held-out data) and checkpointed every
    ``checkpoint_every``. ``(steps, last loss, training seconds, last held-out PPL)``, or None when
    stopped at ``stop_after``. Raises ``NonFiniteLossError``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=loop.start, desc=loop.label, unit="step",
               disable=True if not progress else None)
    step, losses, train_s, loss_value = loop.start, [], 0.0, float("nan")
    t0 = time.perf_counter()
    for batch in loop.batches:
        grad_norm = _micro_step(cfg, acc, loop, batch, losses)
        if not acc.sync_gradients:
            continue
        step += 1
        loss_value = acc.gather(torch.stack(losses).mean()[None]).mean().item()
        losses = []
        if not math.isfinite(loss_value):  # read on the host here anyway: no extra sync; every process sees it
            bar.close()
            _non_finite(output, step, loss_value)
        train_s += time.perf_counter() - t0
        record = {"step": step, "loss": loss_value, "lr": loop.scheduler.get_last_lr()[0],
                  "tokens": step * loop.tokens_per_step,
                  "tokens_per_s": round((step - loop.start) * loop.tokens_per_step / train_s, 1)}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        loop.log.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        ppl = _after_step(cfg, output, acc, loop, evaluate, step, record, bar if progress else None)
        last_ppl = last_ppl if ppl is None else ppl
        if stop_after is not None and step >= stop_after:
            bar.close()
            return None
        t0 = time.perf_counter()
        if step >= cfg.steps:
            break
    bar.close()
    return step, loss_value, train_s, last_ppl


def _non_finite(output: Path, step: int, loss_value: float) -> None:
    """Raise ``NonFiniteLossError`` for the loss of ``step``, naming the checkpoint a rerun resumes from."""
    kept = _checkpoints(output)
    raise NonFiniteLossError(
        f"step {step}: the training loss is {loss_value} (not finite); stopped, no model saved"
        + (f"; checkpoints kept (last: step {kept[-1][0]}, a rerun resumes there)" if kept else "")
        + "; lower lr or warm up longer, check max_grad_norm and mixed_precision")


def _after_step(cfg: FinetuneConfig, output: Path, acc, loop: _Loop, evaluate, step: int, record: dict,
                bar) -> dict[str, float] | None:
    """The held-out evaluation (every ``eval.every`` steps and at the last; its PPL, else None) and
    the checkpoint (every ``checkpoint_every`` steps before the last) after optimiser step ``step``;
    ``bar``: the progress bar to report on (None: quiet)."""
    ppl = None
    if evaluate is not None and (step % cfg.eval.every == 0 or step == cfg.steps):
        ppl = evaluate(step)
        if bar is not None:
            bar.write(f"step {step}/{cfg.steps}: loss {record['loss']:.3f}, {record['tokens_per_s']:.0f} tok/s, "
                      "held-out PPL " + ", ".join(f"{k}: {v:.2f}" for k, v in ppl.items()))
    if step % cfg.checkpoint_every == 0 and step < cfg.steps:
        model, optimizer = loop.model, loop.optimizer
        save_checkpoint(acc, output, step, cfg.keep_checkpoints,
                        extra=(lambda folder: save_sharded(model, optimizer, folder)) if loop.own_fsdp else None)
        if acc.is_main_process:
            plot_training(read_log(output / LOG), output / "loss.png", f"{loop.label}, L = {cfg.length}")
    return ppl


def _save_trained(cfg: FinetuneConfig, run: ResolvedRun, output: Path, acc, loop: _Loop, tokenizer, env, say,
                  step: int, loss_value: float, train_s: float, last_ppl) -> dict[str, Any]:
    """The summary, and the trained model saved by its recipe (the gathered weights of a sharded
    one), ``finetune.json`` last, the loss plot; the checkpoints removed."""
    acc.wait_for_everyone()
    summary = {"label": loop.label, "strategy": cfg.strategy.name, "params": run.params, "logn": cfg.strategy.logn,
               "pose": cfg.pose.model_dump() if cfg.pose.enabled else None, "length": cfg.length,
               "original_max_position_embeddings": run.train_length, "window": run.window, "steps": step,
               "tokens": step * loop.tokens_per_step, "final_loss": loss_value, "ppl": last_ppl,
               "resumed_from": loop.start, "train_seconds": round(train_s, 1), "processes": acc.num_processes,
               "parallelism": {"data": acc.num_processes // cfg.parallelism.sequence,
                               "sequence": cfg.parallelism.sequence, "sharded": loop.sharded},
               **loop.counts, "config": cfg.model_dump(mode="json"), "env": env}
    # gathered: every process takes part
    model = loop.model
    state_dict = full_state_dict(model) if loop.own_fsdp else acc.get_state_dict(model) if loop.sharded else None
    if acc.is_main_process:
        loop.inner.eval()
        loop.recipe.save(loop.inner, tokenizer, output / MODEL_DIR, state_dict=state_dict)
        # last: marks the run done
        (output / MODEL_DIR / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        plot_training(read_log(output / LOG), output / "loss.png", f"{loop.label}, L = {cfg.length}")
        shutil.rmtree(output / CHECKPOINTS, ignore_errors=True)
        say(f"saved the fine-tuned model to {output / MODEL_DIR} ({step} steps, {train_s:.0f} s of training)")
    acc.wait_for_everyone()
    return summary

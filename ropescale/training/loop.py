"""The training loop of a fine-tuning run (``ropescale.training.run``): train with accelerate → save.

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
import os
import shutil
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import OutputError, RopescaleError
from ropescale.lm_head import OutputHead
from ropescale.lm_head import causal_lm_loss as chunked_lm_loss
from ropescale.patching import patch, unpatch
from ropescale.runs.config import ConfigError
from ropescale.runs.processes import on_main
from ropescale.runs.trackers import flat_settings
from ropescale.training.checkpoints import CHECKPOINTS, CheckpointWriteError, save_checkpoint
from ropescale.training.checkpoints import complete_checkpoints as _checkpoints
from ropescale.training.config import FinetuneConfig, ResolvedRun
from ropescale.training.report import LOG, TrainingLog, plot_training, read_log
from ropescale.training.sharding import full_state_dict, load_sharded, save_sharded, shard_model

__all__ = [
    "CHECKPOINTS",
    "MODEL_DIR",
    "SUMMARY",
    "CheckpointWriteError",
    "NonFiniteLossError",
    "causal_lm_loss",
    "check_tracker_folder",
    "enable_checkpointing",
    "patch_for_training",
    "train",
]

MODEL_DIR = "model"
SUMMARY = "finetune.json"
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


class NonFiniteLossError(RopescaleError, ValueError):
    """The training loss became inf or NaN: the run stops (no model saved; checkpoints kept)."""


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


def patch_for_training(model, cfg: FinetuneConfig, run: ResolvedRun):
    """``cfg``'s strategy patched onto ``model`` for training (``PatchHandle``): any patch saved
    with the model removed first, dynamic strategies held at the target length L, no KV cache."""
    unpatch(model)  # a patch saved with the model would stack under this one
    kwargs: dict[str, Any] = {"original_max_position_embeddings": run.train_length, "logn": cfg.strategy.logn,
                              "temperature": cfg.strategy.temperature}
    if cfg.attention_path:
        kwargs["attention_path"] = cfg.attention_path
    handle = patch(model, cfg.strategy.name, **kwargs, **run.params)
    handle.train_at(cfg.length)  # dynamic strategies train at the target length L
    model.config.use_cache = False
    return handle


def check_tracker_folder(acc, cfg: FinetuneConfig, output: Path) -> None:
    """Refuse, in one line, a ``report_to: tensorboard`` log folder that cannot be written, before
    any writer starts: TensorBoard's is ``<output>/<output name>`` (accelerate's logging folder and
    run name), and its writer opens the event file in a thread of its own, so a read-only file system
    there ended in that thread's ``OSError`` traceback. The main process makes the folder (where it is
    not there) and creates and removes a file in it; what it made is removed again when it refuses.
    Raises ``OutputError`` (naming ``report_to`` and the folder) on every process (``on_main``)."""
    if "tensorboard" in cfg.report_to:
        on_main(acc, lambda: _probe_folder(output / output.name, cfg.report_to))


def _probe_folder(folder: Path, names: list[str]) -> None:
    """``folder`` made where it is not there and a file created and removed in it; ``OutputError``
    (``_tracker_error``) when it cannot be, with what was made removed again."""
    made = not folder.exists()
    probe = folder / f".ropescale-probe-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
        with probe.open("xb"):
            pass
        probe.unlink()
    except OSError as e:
        if made:
            with suppress(OSError):
                folder.rmdir()
        raise _tracker_error(names, folder, e) from None


def _tracker_error(names: list[str], folder: Path, e: OSError) -> OutputError:
    """The one line for a tracker that cannot write its logs in ``folder``."""
    why = "a file is in its place" if folder.exists() and not folder.is_dir() else e.strerror or str(e)
    return OutputError(f"report_to: {', '.join(names)} cannot write its logs in {folder} ({why}); "
                       "make that a writable folder or leave report_to out")


def _start_trackers(job) -> None:
    """The trackers' run, named after the output folder, with the run's identity as its settings,
    started by the main process (accelerate's trackers write from there only); every process
    raises its refusal (``on_main``). Raises ``OutputError`` in one line when a tracker cannot
    write its folder (a file in its place, a read-only file system: TensorBoard's folder is probed
    first, ``check_tracker_folder``); the trackers that started are closed."""
    acc, cfg, output = job.acc, job.cfg, job.output
    settings = flat_settings(cfg.identity())

    def start() -> None:
        if "tensorboard" in cfg.report_to:
            _probe_folder(output / output.name, cfg.report_to)
        try:
            acc.init_trackers(output.name, config=settings)
        except OSError as e:
            for tracker in acc.trackers:
                with suppress(Exception):  # one that did not start has nothing to close
                    tracker.finish()
            acc.trackers = []
            raise _tracker_error(cfg.report_to, output / output.name, e) from None

    on_main(acc, start)


@dataclass
class _Loop:
    """What the training loop runs with (``_setup_loop``): the run (``job``: a
    ``ropescale.training.run.FinetuneRun`` — config, accelerator, plan, folder), the prepared model,
    optimiser, schedule and batches (resumed), how the loss is computed (chunked head, sequence
    parallelism), the training log, the step resumed from, the run's label and tokens per step."""

    job: Any
    model: Any
    optimizer: Any
    scheduler: Any
    batches: Any
    inner: Any  # the unwrapped model (evaluated, saved)
    chunk_size: int | None
    head: OutputHead | None
    in_forward: Any  # in_forward(fn, *a, **k): fn(model, *a, **k), inside the sharded root's forward where there is one
    sp: Any
    log: TrainingLog
    start: int
    label: str
    tokens_per_step: int
    counts: dict[str, int]


def train(job, cleanup: ExitStack) -> dict[str, Any] | None:
    """Train (or go on training) ``job`` (a ``ropescale.training.run.FinetuneRun``, prepared and
    claimed) and save; the summary, or None when stopped at ``job.stop_after``. ``cleanup``: what
    training sets up and must undo (sequence parallelism's attention wrapper)."""
    loop = _setup_loop(job, cleanup)
    heldout, acc = job.heldout, job.acc

    def evaluate(step: int) -> dict[str, float]:
        if job.plan.sharded:  # every process runs every window through the sharded model, so its collectives line up
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
        job.say("step 0: held-out PPL " + ", ".join(f"{k}: {v:.2f}" for k, v in last_ppl.items()))
    ran = _run_steps(loop, evaluate if heldout is not None else None, last_ppl)
    if ran is None:
        return None
    return _save_trained(loop, *ran)


def _setup_loop(job, cleanup: ExitStack) -> _Loop:
    """The model put in training mode and wrapped (sequence parallelism, sharding, accelerate), the
    optimiser, schedule and loader, the trackers and the log, and the last checkpoint restored."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    cfg, acc, plan = job.cfg, job.acc, job.plan
    model = job.model
    model.train()
    sp = plan.sequence_parallel(model)
    if sp is not None:
        cleanup.callback(sp.close)
    if plan.own_fsdp:  # FSDP2 by torch's fully_shard where accelerate does not shard (CPU processes); the root unit
        model = shard_model(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = {"trainable_parameters": sum(p.numel() for p in trainable),
              "parameters": sum(p.numel() for p in model.parameters())}
    # fused: one kernel over all parameters, no temporaries (foreach allocates a copy of every
    # parameter's size in the step — tens of GB at 8B; the CPU loop one of the largest parameter's)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay,
                                  fused=not plan.own_fsdp)  # fused takes no DTensor shards
    scheduler = get_scheduler(_SCHEDULES[cfg.schedule], optimizer, num_warmup_steps=cfg.warmup,
                              num_training_steps=cfg.steps)
    # its own generator: each iterator draws a base seed from the loader's generator, which would otherwise be the
    # global RNG — the uninterrupted run draws it before step 1, a resumed one after restoring the checkpoint's RNG
    # state, so dropout (LoRA's) drew other masks from there on than the uninterrupted run
    loader = DataLoader(job.dataset, batch_size=cfg.batch_size, shuffle=False,
                        generator=torch.Generator().manual_seed(cfg.seed))
    if plan.own_fsdp:  # model and optimiser states sharded: saved by save_sharded, not by accelerate's main process
        loader = acc.prepare(loader)
    else:
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.register_for_checkpointing(scheduler)  # stepped by hand: once per optimiser step

    if cfg.report_to:
        _start_trackers(job)
    log = TrainingLog(job.output / LOG, enabled=acc.is_main_process, tracker=acc if cfg.report_to else None)
    start = _resume(job, model, optimizer, log)
    batches = acc.skip_first_batches(loader, start * cfg.grad_accum) if start else loader
    if sp is not None:  # each batch read → P micro-batches of the group's shards
        batches = sp.shard(batches, acc.device)
    inner = model.model if plan.own_fsdp else acc.unwrap_model(model)
    chunk_size = plan.loss_chunk_size(cfg.loss_chunk_size)
    head = OutputHead(inner if plan.own_fsdp else model) if chunk_size != 0 else None  # checked on the first step only
    in_forward = model if plan.own_fsdp else (lambda fn, *a, **k: fn(model, *a, **k))  # ShardedModel(fn) runs fn inside
    label = cfg.strategy.display + (" + PoSE" if cfg.pose.enabled else "") + job.recipe.label
    tokens_per_step = cfg.batch_size * cfg.grad_accum * acc.num_processes * job.resolved.window
    return _Loop(job, model, optimizer, scheduler, batches, inner, chunk_size, head, in_forward, sp, log, start,
                 label, tokens_per_step, counts)


def _resume(job, model, optimizer, log: TrainingLog) -> int:
    """Restore the last complete checkpoint (accelerate's state; the sharded model's and optimiser's
    own) and cut the log after it; the step it was written at (0: none)."""
    done = _checkpoints(job.output)
    start = done[-1][0] if done else 0
    if done:
        job.acc.load_state(str(done[-1][1]))
        if job.plan.own_fsdp:
            load_sharded(model, optimizer, done[-1][1])
        job.say(f"resuming from {done[-1][1]} (step {start} of {job.cfg.steps})")
    log.keep_through(start if done else -1)
    job.acc.wait_for_everyone()
    return start


def _micro_step(loop: _Loop, batch, losses: list) -> Any:
    """One micro-step under accelerate's accumulation: the loss (appended to ``losses``) and its
    backward; at an optimiser step the global gradient norm clipped (returned; None otherwise),
    the optimiser and the schedule stepped."""
    acc, max_grad_norm = loop.job.acc, loop.job.cfg.max_grad_norm
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
        if acc.sync_gradients and max_grad_norm:
            grad_norm = acc.clip_grad_norm_(loop.model.parameters(), max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
        if acc.sync_gradients:  # accelerate's prepared optimiser skips the others itself; a sharded one is not
            loop.optimizer.step()
            loop.scheduler.step()
            loop.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _run_steps(loop: _Loop, evaluate, last_ppl) -> tuple[int, float, float, Any] | None:
    """The optimiser steps from ``loop.start`` to ``cfg.steps``: each logged, evaluated every
    ``eval.every`` (``evaluate``: None without held-out data) and checkpointed every
    ``checkpoint_every``. ``(steps, last loss, training seconds, last held-out PPL)``, or None when
    stopped at ``job.stop_after``. Raises ``NonFiniteLossError``."""
    from tqdm.auto import tqdm

    job = loop.job
    cfg, acc, stop_after = job.cfg, job.acc, job.stop_after
    bar = tqdm(total=cfg.steps, initial=loop.start, desc=loop.label, unit="step",
               disable=True if not job.progress else None)
    step, losses, train_s, loss_value = loop.start, [], 0.0, float("nan")
    t0 = time.perf_counter()
    for batch in loop.batches:
        grad_norm = _micro_step(loop, batch, losses)
        if not acc.sync_gradients:
            continue
        step += 1
        loss_value = acc.gather(torch.stack(losses).mean()[None]).mean().item()
        losses = []
        if not math.isfinite(loss_value):  # read on the host here anyway: no extra sync; every process sees it
            bar.close()
            _non_finite(job.output, step, loss_value)
        train_s += time.perf_counter() - t0
        record = {"step": step, "loss": loss_value, "lr": loop.scheduler.get_last_lr()[0],
                  "tokens": step * loop.tokens_per_step,
                  "tokens_per_s": round((step - loop.start) * loop.tokens_per_step / train_s, 1)}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        loop.log.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        ppl = _after_step(loop, evaluate, step, record, bar if job.progress else None)
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


def _after_step(loop: _Loop, evaluate, step: int, record: dict, bar) -> dict[str, float] | None:
    """The held-out evaluation (every ``eval.every`` steps and at the last; its PPL, else None) and
    the checkpoint (every ``checkpoint_every`` steps before the last) after optimiser step ``step``;
    ``bar``: the progress bar to report on (None: quiet)."""
    job = loop.job
    cfg, output = job.cfg, job.output
    ppl = None
    if evaluate is not None and (step % cfg.eval.every == 0 or step == cfg.steps):
        ppl = evaluate(step)
        if bar is not None:
            bar.write(f"step {step}/{cfg.steps}: loss {record['loss']:.3f}, {record['tokens_per_s']:.0f} tok/s, "
                      "held-out PPL " + ", ".join(f"{k}: {v:.2f}" for k, v in ppl.items()))
    if step % cfg.checkpoint_every == 0 and step < cfg.steps:
        model, optimizer = loop.model, loop.optimizer
        save_checkpoint(job.acc, output, step, cfg.keep_checkpoints,
                        extra=(lambda folder: save_sharded(model, optimizer, folder)) if job.plan.own_fsdp else None)
        if job.acc.is_main_process:
            plot_training(read_log(output / LOG), output / "loss.png", f"{loop.label}, L = {cfg.length}")
    return ppl


def _save_trained(loop: _Loop, step: int, loss_value: float, train_s: float, last_ppl) -> dict[str, Any]:
    """The summary, and the trained model saved by its recipe (the gathered weights of a sharded
    one), ``finetune.json`` last, the loss plot; the checkpoints removed."""
    job = loop.job
    cfg, run, acc, output = job.cfg, job.resolved, job.acc, job.output
    acc.wait_for_everyone()
    summary = {"label": loop.label, "strategy": cfg.strategy.name, "params": run.params, "logn": cfg.strategy.logn,
               "pose": cfg.pose.model_dump() if cfg.pose.enabled else None, "length": cfg.length,
               "original_max_position_embeddings": run.train_length, "window": run.window, "steps": step,
               "tokens": step * loop.tokens_per_step, "final_loss": loss_value, "ppl": last_ppl,
               "resumed_from": loop.start, "train_seconds": round(train_s, 1), "processes": acc.num_processes,
               "parallelism": job.plan.describe(), **loop.counts, "config": cfg.model_dump(mode="json"),
               "env": job.env}
    # gathered: every process takes part
    model = loop.model
    state_dict = (full_state_dict(model) if job.plan.own_fsdp else acc.get_state_dict(model) if job.plan.sharded
                  else None)
    if acc.is_main_process:
        loop.inner.eval()
        job.recipe.save(loop.inner, job.tokenizer, output / MODEL_DIR, state_dict=state_dict)
        # last: marks the run done
        (output / MODEL_DIR / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        plot_training(read_log(output / LOG), output / "loss.png", f"{loop.label}, L = {cfg.length}")
        shutil.rmtree(output / CHECKPOINTS, ignore_errors=True)
        job.say(f"saved the fine-tuned model to {output / MODEL_DIR} ({step} steps, {train_s:.0f} s of training)")
    acc.wait_for_everyone()
    return summary

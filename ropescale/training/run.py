"""The fine-tuning run as a run kind (``ropescale.runs.protocol``): ``finetune`` and ``FinetuneRun``.

``finetune`` sets up accelerate (``Accelerator``: the launched processes, mixed precision, the
plugins of the run's ``ParallelPlan``) and runs a ``FinetuneRun`` through the one run protocol:

- ``check``: the plan's refusals (``ParallelPlan.check``) — before anything is read or written;
- ``identity``: the config's (``FinetuneConfig.identity``, flattened), the processes, and the
  token stream the run trains on;
- ``prepare``: the held-out windows, the training windows, the model loaded, patched at the
  target length, wrapped for memory (checkpointing, tiling) and by its recipe — every refusal of
  the input — unless the folder already holds the trained model;
- ``execute``: training (``ropescale.training.loop.train``), then the after-training evaluations.

The object carries the run's state (config, resolved values, accelerator, plan, what ``prepare``
built, the folder), so the loop's steps take it instead of a dozen arguments.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from ropescale.models import resolve_device
from ropescale.rotary import NoRotaryEmbeddingError
from ropescale.runs.config import ConfigError
from ropescale.runs.lifecycle import RunInputs, load_run_model
from ropescale.runs.processes import process_state
from ropescale.runs.protocol import RunFolder, RunKind, execute_run
from ropescale.runs.trackers import check_installed
from ropescale.training.config import FinetuneConfig, ResolvedRun, check_nf4, resolve
from ropescale.training.data import TrainingWindows, token_stream
from ropescale.training.heldout import HeldOut
from ropescale.training.loop import (
    MODEL_DIR,
    SUMMARY,
    check_tracker_folder,
    enable_checkpointing,
    patch_for_training,
    train,
)
from ropescale.training.parallel import ParallelPlan, accelerator_plugins
from ropescale.training.pose import PoseSampler
from ropescale.training.tiling import enable_tiled_mlp, enable_tiled_norms

__all__ = ["AfterTraining", "FinetuneRun", "finetune"]


class AfterTraining(Protocol):
    """What runs on the saved model after training (the harness's ``eval.after`` experiments:
    ``eval.finetune.HarnessEvaluations``). ``check`` runs before step 1 (``processes``: the
    launched processes, which run the evaluations too) and raises ``ConfigError`` in one line;
    ``run`` returns ``{name: records}``."""

    def check(self, cfg: FinetuneConfig, run: ResolvedRun, source: str, *, processes: int = 1) -> None:
        """Refuse, before step 1, what the evaluations could not run.

        Args:
            cfg: the fine-tuning run.
            run: its resolved values (T, parameters).
            source: how messages name the config.
            processes: the launched processes, which run the evaluations too.

        Raises:
            ropescale.runs.config.ConfigError: an evaluation that cannot run (one line).
        """

    def run(self, cfg: FinetuneConfig, run: ResolvedRun, model_dir: Path, output: Path, *, progress: bool,
            say) -> dict[str, list[dict]]:
        """Run the evaluations on the saved model.

        Args:
            cfg: the fine-tuning run.
            run: its resolved values (T, parameters).
            model_dir: the saved model's folder.
            output: the run's folder (evaluations go under ``eval/``).
            progress: print progress.
            say: how to print a line.

        Returns:
            ``{name: records}`` per evaluation.
        """


def finetune(cfg: FinetuneConfig, output: str | Path, *, progress: bool = True, stop_after: int | None = None,
             source: str = "config", after: AfterTraining | None = None) -> dict[str, Any]:
    """Run (or resume, or just evaluate when already trained) a fine-tuning run into its folder.

    Every refusal of the input comes before the manifest is written (``ropescale.runs.protocol``):
    the data is read and the model loaded, patched and wrapped by its recipe first, so a corrected
    rerun into the same folder is not refused as another experiment, and a refused run leaves no
    folder behind. Only the folder's own state and what happens while training come after.

    Args:
        cfg: the run (``FinetuneConfig``).
        output: its folder (one run per folder; a rerun resumes from the last checkpoint).
        progress: print progress (the main process of a launch only).
        stop_after: stop after this many steps as a killed run would (no model saved; the
            checkpoints stay) — for tests and time-boxed runs; None: train to ``cfg.steps``.
        source: how messages name the config (its file).
        after: what runs on the saved model (the harness's ``eval.after`` experiments:
            ``eval.finetune.HarnessEvaluations``); None: nothing, and ``eval.after`` is refused.

    Returns:
        The summary: ``model`` (the saved folder), ``steps``, ``final_loss``, ``ppl`` (the last
        held-out evaluation, ``{length: PPL}``), ``evaluations`` (``{name: harness records}``),
        ``resumed_from`` (step), ``train_seconds``.

    Raises:
        ropescale.runs.config.ConfigError: PoSE length ≤ T; a bad strategy parameter (also one only the
            model's sizes refuse, such as dca's ``local_window`` ≥ ``chunk_size``) or evaluation entry;
            ``sharding`` other than ``fsdp`` without CUDA devices or in one CPU process;
            ``parallelism.sequence`` the launched processes, the model's heads or its attention cannot
            take; LoRA targets the model does not have, a rank above their smallest dimension; LongLoRA
            ``trainable_params`` in no parameter name.
        ropescale.models.ModelLoadError: the model cannot be loaded.
        ropescale.runs.data.DataError: the data cannot be read (``WindowError``: too short).
        ropescale.runs.manifest.ExperimentMismatchError: the folder holds another run (under a launch,
            on every process; ``FolderBusyError``: another run holds it).
        ropescale.errors.OutputError: the folder, a ``report_to`` tracker's folder or a checkpoint
            cannot be written (``CheckpointWriteError``: a full disk; a rerun resumes).
        ropescale.training.loop.NonFiniteLossError: the training loss became inf or NaN (no model
            saved, the checkpoints kept).
    """
    resolved = resolve(cfg, source)
    evaluated = bool(cfg.eval and cfg.eval.after)
    if evaluated and after is None:
        raise ConfigError(f"{source}: eval.after: harness experiments need the harness; run it with "
                          "`ropescale finetune` or eval.finetune.run_finetune (this call only trains)")
    device = resolve_device(cfg.device)  # a device that is not there fails first
    # under a launch: the process group, set up once per process and kept for every later run in it
    # (the after-training evaluations, another fine-tuning): ropescale.runs.processes
    processes = process_state(cpu=device.type == "cpu").num_processes
    if evaluated:
        after.check(cfg, resolved, source, processes=processes)  # a bad evaluation fails now, not after training
    # cfg.threads: torch's thread count for this run only (ropescale.runs.protocol.execute_run)
    acc = _accelerator(cfg, device, output, source)
    job = FinetuneRun(cfg, resolved, acc, progress=progress and acc.is_main_process, stop_after=stop_after,
                      after=after, source=source)
    try:
        with _loading_bars(job.progress):
            summary = execute_run(job, output)
    except BaseException:
        _leave(acc, together=False)
        raise
    _leave(acc)
    return summary


def _accelerator(cfg: FinetuneConfig, device: torch.device, output: str | Path, source: str):
    """accelerate's ``Accelerator`` for the run, with the plan's plugins and the trackers
    (``report_to``, checked installed first)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    fsdp, accumulation = accelerator_plugins(cfg, device.type, source)
    # accelerate keeps one AcceleratorState per process and refuses another mixed precision in it; a
    # process running several fine-tunings (tests, notebooks) starts each afresh, on the process group
    # the first one set up (``process_state``)
    AcceleratorState._reset_state()
    trackers = check_installed(cfg.report_to, source)  # before anything is written
    # cpu=True also makes processes started by torchrun (`accelerate launch --multi_gpu` on a machine
    # without GPUs) one gloo group; without it each would train alone and write the same files
    return Accelerator(cpu=device.type == "cpu", mixed_precision=cfg.mixed_precision, fsdp_plugin=fsdp,
                       gradient_accumulation_plugin=accumulation, log_with=trackers or None,
                       project_dir=str(output) if trackers else None)


class FinetuneRun(RunKind):
    """One fine-tuning run's state, for the protocol's steps and the loop's: ``cfg``, ``resolved``
    (T, parameters, window: ``ResolvedRun``), ``state`` (accelerate's ``Accelerator``), ``plan``
    (``ParallelPlan``), what ``prepare`` builds (``tokenizer``, ``stream`` — the training tokens,
    ``[n]`` int64 —, ``heldout``, ``dataset``, ``model``, ``recipe``) and, once claimed, ``output``."""

    def __init__(self, cfg: FinetuneConfig, resolved: ResolvedRun, acc, *, progress: bool, stop_after: int | None,
                 after: AfterTraining | None, source: str):
        self.cfg, self.resolved, self.state, self.source = cfg, resolved, acc, source
        self.plan = ParallelPlan.of(cfg, acc)
        self.progress, self.stop_after, self.after = progress, stop_after, after
        self.say = print if progress else (lambda *a, **k: None)
        self.output: Path | None = None
        self.heldout = self.dataset = self.model = self.recipe = None

    @property
    def acc(self):
        """accelerate's ``Accelerator`` of the run (the protocol's ``state``)."""
        return self.state

    def check(self) -> None:
        self.plan.check(self.cfg, self.acc, self.source)

    def identity(self, inputs: RunInputs):
        self.tokenizer = inputs.tokenizer
        self.stream = token_stream(inputs.docs, inputs.tokenizer.eos_token_id)
        return {**_flat(self.cfg.identity()), "processes": self.plan.processes}, [self.stream]

    def prepare(self, inputs: RunInputs, folder: RunFolder | None) -> None:
        """Read the data and build the model to train: the held-out and training windows
        (``DataError``, ``WindowError``), the model (``ModelLoadError``), the strategy patched onto
        it at the target length (``ConfigError``: a parameter the model's sizes refuse), activation
        checkpointing, tiling and the recipe's wrapping (``ConfigError``: LoRA targets the model
        lacks, a rank above the target layers' sizes, LongLoRA's ``trainable_params`` matching
        nothing). Nothing when the folder holds the trained model already."""
        if folder is not None and (folder.path / MODEL_DIR / SUMMARY).is_file():
            return
        if folder is not None:  # a report_to log folder that cannot be written: refused before the manifest
            check_tracker_folder(self.acc, self.cfg, folder.path)
        from accelerate.utils import set_seed

        cfg, resolved, acc = self.cfg, self.resolved, self.acc
        self.heldout = (HeldOut(self.tokenizer, cfg.eval.data, resolved.eval_lengths, max_windows=cfg.eval.max_windows,
                                batch_size=cfg.eval.batch_size) if cfg.eval else None)
        pose = (PoseSampler(resolved.window, cfg.length, cfg.pose.chunks, cfg.pose.content, cfg.pose.sampling)
                if cfg.pose.enabled else None)
        examples = cfg.steps * cfg.grad_accum * cfg.batch_size * acc.num_processes
        self.dataset = TrainingWindows(self.stream, pose.span if pose else cfg.length, examples, cfg.seed, pose)
        set_seed(cfg.seed)  # before the model: a recipe's initialisation (LoRA's A) draws from it
        self.model = self._model(inputs)
        self.recipe = cfg.training_recipe()
        # what trains: all weights, LoRA, ... (ropescale.training.recipes)
        self.model = self.recipe.prepare(self.model, cfg, self.source)
        self.plan.check_model(self.model, resolved.kind, resolved.window, cfg.pose.enabled, self.source)

    def _model(self, inputs: RunInputs):
        """The model loaded (an adapter base merged), patched for training, and wrapped for memory."""
        cfg, source = self.cfg, self.source
        device, dtype, quantization = "cpu", cfg.dtype, None
        if cfg.dtype == "nf4":  # QLoRA: bitsandbytes quantizes the base on the run's GPU as it loads
            try:
                check_nf4(str(self.acc.device))
            except ValueError as e:
                raise ConfigError(f"{source}: {e}") from None
            device, dtype, quantization = str(self.acc.device), "bfloat16", "nf4"
        model = load_run_model(cfg.model, inputs, device=device, unpatched=False, dtype=dtype,
                               quantization=quantization)
        if hasattr(model, "merge_and_unload") and hasattr(model, "peft_config"):  # a saved adapter as the base
            model = model.merge_and_unload()  # unpatched once merged (patch_for_training)
        try:
            patch_for_training(model, cfg, self.resolved)
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
        return model

    def execute(self, folder: RunFolder) -> dict[str, Any]:
        self.output = output = folder.path
        summary_path = output / MODEL_DIR / SUMMARY
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
            self.say(f"{output}: already trained ({summary['steps']} steps); model in {output / MODEL_DIR}")
        else:
            with ExitStack() as cleanup:  # sequence parallelism's attention wrapper is removed when training ends
                summary = train(self, cleanup)
            if summary is None:
                return {"stopped_at": self.stop_after, "model": None}
        cfg = self.cfg
        evaluations = (self.after.run(cfg, self.resolved, output / MODEL_DIR, output, progress=self.progress,
                                      say=self.say)
                       if self.after is not None and cfg.eval and cfg.eval.after else {})
        return {**summary, "model": str(output / MODEL_DIR), "evaluations": evaluations,
                "main_process": self.acc.is_main_process}


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys (a strategy's ``params`` kept whole)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "params":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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

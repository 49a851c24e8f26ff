"""A fine-tuning run's parallel layout, decided once: ``ParallelPlan``.

The launched processes form D = processes / P data-parallel groups of P processes each, P the
sequence-parallel group (``parallelism.sequence``: DeepSpeed's Ulysses, ALST, arXiv:2506.13996;
``ropescale.training.sequence_parallel``); the weights are sharded or not (``sharding``: FSDP2 —
accelerate's on CUDA devices, torch's ``fully_shard`` on CPU processes, ``ropescale.training.sharding``).
The plan is built from the config and the ``Accelerator`` the run set up, checked in one place
(``check``: what the launched processes and the device cannot do, one line each), and read by
everything else: the accelerator's plugins before it (``accelerator_plugins``), the loop, the
summary. Beyond the config's own checks, nothing else reads ``parallelism.sequence`` or ``sharding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ropescale.runs.config import ConfigError
from ropescale.training.config import SHARDING_ON_CPU, FinetuneConfig, fsdp_plugin_kwargs

__all__ = ["ParallelPlan", "accelerator_plugins"]


def accelerator_plugins(cfg: FinetuneConfig, device_type: str, source: str = "config") -> tuple[Any, Any]:
    """accelerate's ``(FullyShardedDataParallelPlugin or None, GradientAccumulationPlugin)`` for
    ``cfg`` on a ``device_type`` device (``"cpu"``, ``"cuda"``, ...).

    The FSDP plugin only off the CPU (there torch's ``fully_shard`` shards; an accelerate plugin
    file is refused: ``ConfigError``). Accumulation: ``grad_accum`` micro-steps per optimiser step,
    × P under sequence parallelism (each batch read becomes P micro-batches, one per process of the
    group: ``SequenceParallel.shard``) — and then synchronised by count alone, since the loader's
    end is reached P − 1 micro-batches before the last one runs."""
    from accelerate.utils import FullyShardedDataParallelPlugin, GradientAccumulationPlugin

    fsdp = None
    if cfg.sharding is not None and device_type == "cpu" and cfg.sharding != "fsdp":
        raise ConfigError(f"{source}: {SHARDING_ON_CPU}")
    if cfg.sharding is not None and device_type != "cpu":
        fsdp = FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(cfg.sharding, source))
    sp = cfg.parallelism.sequence
    return fsdp, GradientAccumulationPlugin(num_steps=cfg.grad_accum * sp, sync_with_dataloader=sp == 1)


@dataclass(frozen=True)
class ParallelPlan:
    """How a run's processes split the work. ``processes``: launched; ``sequence``: P, processes
    per sequence-parallel group (1: off); ``own_fsdp``: the weights sharded by torch's
    ``fully_shard`` (CPU processes); ``accelerate_fsdp``: sharded by accelerate's FSDP (GPUs, set
    up for these processes); ``micro_batch_size``: windows per process per micro-step."""

    processes: int
    sequence: int
    own_fsdp: bool
    accelerate_fsdp: bool
    micro_batch_size: int

    @classmethod
    def of(cls, cfg: FinetuneConfig, acc) -> ParallelPlan:
        """The plan of ``cfg`` on accelerate's ``acc`` (its processes, device, distributed type)."""
        return cls(processes=acc.num_processes, sequence=cfg.parallelism.sequence,
                   own_fsdp=cfg.sharding is not None and acc.device.type == "cpu",
                   accelerate_fsdp=acc.distributed_type.value == "FSDP", micro_batch_size=cfg.batch_size)

    @property
    def data(self) -> int:
        """D: data-parallel groups (processes / P)."""
        return self.processes // self.sequence

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded over the processes (by torch or by accelerate)."""
        return self.own_fsdp or self.accelerate_fsdp

    def loss_chunk_size(self, configured: int | None) -> int | None:
        """The LM head's chunk size for the loss: accelerate's FSDP takes the model's own loss (0), as
        the chunked head would run ``lm_head`` outside the model's forward, where its parameters are
        sharded; torch's ``fully_shard`` runs the chunked loss inside the root unit's forward."""
        return 0 if self.accelerate_fsdp else configured

    def describe(self) -> dict[str, Any]:
        """The summary's ``parallelism``: data groups, sequence group size, sharded."""
        return {"data": self.data, "sequence": self.sequence, "sharded": self.sharded}

    def check(self, cfg: FinetuneConfig, acc, source: str = "config") -> None:
        """Refuse in one line (``ConfigError``) what the launched processes and the device cannot
        do: P not dividing the processes, fp16 on the CPU, sharding in one CPU process, an FSDP
        plugin (``sharding`` off the CPU: ``accelerator_plugins``) where accelerate did not set up FSDP."""
        if self.sequence > 1 and self.processes % self.sequence:
            raise ConfigError(f"{source}: parallelism.sequence: {self.sequence} does not divide the {self.processes} "
                              f"launched process(es); launch a multiple of {self.sequence} "
                              f"(accelerate launch --multi_gpu --num_processes {self.sequence} ...)")
        if cfg.mixed_precision == "fp16" and acc.device.type == "cpu":
            raise ConfigError(f"{source}: mixed_precision: fp16 needs a CUDA device; on CPU use bf16 or no")
        if cfg.sharding is not None and acc.device.type == "cpu" and self.processes == 1:
            raise ConfigError(f"{source}: sharding: one process holds the whole model either way; launch several "
                              "(accelerate launch --multi_gpu --num_processes N ...) or leave sharding out")
        plugin = cfg.sharding is not None and not self.own_fsdp  # given to accelerate (accelerator_plugins)
        if plugin and self.processes > 1 and not self.accelerate_fsdp:
            raise ConfigError(f"{source}: sharding: accelerate set up {acc.distributed_type.value}, not FSDP, for "
                              f"{self.processes} processes; launch with `accelerate launch --multi_gpu`")

    def check_model(self, model, kind: str, window: int, pose: bool, source: str = "config") -> None:
        """The loaded model's side of sequence parallelism (its heads, layer types and attention
        implementation; ``ConfigError``), before the run's folder is claimed. ``kind``: the
        strategy's (``"frequency"`` / ``"attention"``); ``window``: tokens per training example."""
        if self.sequence == 1:
            return
        from ropescale.rope_config import text_config
        from ropescale.training.sequence_parallel import check_sequence_parallel

        check_sequence_parallel(self.sequence, config=text_config(model.config), kind=kind, window=window, pose=pose,
                                attn_implementation=model.config._attn_implementation, source=source)

    def sequence_parallel(self, model):
        """``SequenceParallel`` around the patched model's attention (None when P = 1)."""
        if self.sequence == 1:
            return None
        from ropescale.training.sequence_parallel import SequenceParallel

        return SequenceParallel(model, self.sequence, micro_batch_size=self.micro_batch_size)

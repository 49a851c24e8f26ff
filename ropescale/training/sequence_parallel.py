"""Sequence parallelism for every rule: DeepSpeed's Ulysses (ALST; Jacobs et al. 2023,
arXiv:2309.14509; Bekman et al. 2025, arXiv:2506.13996) around ropescale's attention functions.

Shapes: b = windows per micro-batch, s = the window's tokens, P = sequence-parallel processes
(``sp``), s_l = s / P (each process's shard), n_h / n_kv = query / key-value heads, h_d = head
size.

Each process of a sequence-parallel group holds ``s_l`` consecutive tokens of the same windows
(``input_ids``, ``position_ids`` and the shifted labels ``[b, s_l]``, cut by DeepSpeed's
``UlyssesSPDataLoaderAdapter``). Before each attention call DeepSpeed's
``UlyssesSPAttentionHF`` exchanges q, k, v (all-to-all: ``[b, n_h, s_l, h_d]`` → ``[b, n_h / P,
s, h_d]``) and all-gathers ``position_ids`` to ``[b, s]``, so the attention function the model
was patched with runs unchanged on the *whole* window for its share of heads and on the
*global* positions: the relative-position rules' region kernels (ReRoPE, Leaky ReRoPE, SelfExtend, DCA,
STRING; ``ropescale_truncation``), log-n query scaling (``ropescale_logn_<base>``), layers without
RoPE (``ropescale_truncation_<base>`` hands them to the base), and the model's own function under a
frequency strategy. A second all-to-all gives each process its tokens back for all heads.
Rotary embeddings are applied per process at the global positions of its shard, so PoSE's
skipped positions travel with the shards.

Which engine entry point: accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``
needs the DeepSpeed engine (``accelerate launch --use_deepspeed``, its optimiser and ZeRO) and its
``DeepSpeedSequenceParallelConfig.sp_attn_implementation`` accepts only sdpa, flash_attention_2/3
and hub flash kernels — none of ropescale's names. So ropescale calls DeepSpeed's own
``UlyssesSPAttentionHF.register_with_transformers`` (which accepts any key of
``ALL_ATTENTION_FUNCTIONS`` but eager) with the name the patch set, keeps accelerate's DDP / FSDP
for the gradients, and registers nothing of its own.

The loss: process r adds the NLL of its shard's shifted labels and divides by the tokens scored
in the whole window (an all-reduce of the counts over the group), so the group's losses add up
to the window's mean NLL. The gradient a process holds after backward is that of its own
tokens' share of the parameters' use, for every process's loss (the all-to-all's backward sends
each process the gradients of the q, k, v it computed); the sum over the group is the gradient
of the window's mean NLL. Data parallelism averages gradients over all P·D processes, so the
loss each process back-propagates is multiplied by P (``backward_scale``).

Refused in one line before training (``ConfigError``): a size that does not divide the heads
(``num_attention_heads``; DeepSpeed replicates key-value heads when there are fewer than P), the
window, or the number of processes; an attention implementation that does not treat a missing
mask as causal (eager, flex_attention, and wrappers of them: Ulysses drops the model's masks,
rebuilt for the shard's length, and calls the function with none); sliding-window layers under
a frequency strategy (the window lives in the dropped mask — accelerate refuses them for the
same reason; the relative-position rules' kernels apply the window themselves); PoSE with a flash
kernel (which reads position ids that jump as packed sequences once the mask is gone).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ropescale.lm_head import IGNORE, OutputHead, chunk_size_for
from ropescale.runs.config import ConfigError

__all__ = ["SequenceParallel", "check_sequence_parallel", "deepspeed_available", "with_positions"]

# attention implementations that compute causal attention when called without a mask
_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")
_TRUNCATION = "ropescale_truncation"
_LOGN = "ropescale_logn_"


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (its Ulysses sequence parallelism; the ``deepspeed`` extra)."""
    return importlib.util.find_spec("deepspeed") is not None


def _base_of(name: str) -> str | None:
    """The implementation a ropescale attention function hands its calls to; None for the
    truncation kernel itself (causal by construction)."""
    if name == _TRUNCATION:
        return None
    if name.startswith(_TRUNCATION + "_"):
        return name[len(_TRUNCATION) + 1:]
    if name.startswith(_LOGN):
        return name[len(_LOGN):]
    return name


def _causal_without_mask(name: str) -> bool:
    return name in _CAUSAL_WITHOUT_MASK or ("/" in name and "flash" in name)  # hub flash kernels


def check_sequence_parallel(size: int, *, config, kind: str, window: int, pose: bool,
                            attn_implementation: str | None = None, source: str = "config") -> None:
    """Refuse what Ulysses cannot run exactly, one ``ConfigError`` line each (see the module's
    docstring). ``config``: the model's (text) configuration; ``kind``: the strategy's
    (``frequency`` or ``attention``); ``window``: tokens per training example (T with PoSE);
    ``attn_implementation``: the name the patched model's layers call (None before the model
    is loaded: that check is left for then)."""
    key = f"{source}: parallelism.sequence"
    if not deepspeed_available():
        raise ConfigError(f"{key}: sequence parallelism runs on DeepSpeed's Ulysses, which is not installed: "
                          "pip install 'ropescale[scale]'")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ConfigError(f"{key}: {size} does not divide the model's {heads} attention heads (Ulysses gives each "
                          "process the whole sequence for heads / size heads)")
    if kv % size and size % kv:
        raise ConfigError(f"{key}: {size} and the model's {kv} key-value heads do not divide one another")
    if window % size:
        raise ConfigError(f"{key}: {size} does not divide the {window}-token training window; each process "
                          "holds window / size tokens")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = sorted({t for t in layer_types if t != "full_attention"})
    if not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        sliding = ["sliding_attention"]
    if kind == "frequency" and sliding:
        raise ConfigError(f"{key}: the model has {', '.join(sliding)} layers, whose window lives in the attention "
                          "mask that Ulysses drops: a frequency strategy would train them full-causal; use a relative-"
                          "position rule (rerope, self_extend, dca, ...), whose kernel applies the window itself")
    if attn_implementation is None:
        return
    base = _base_of(attn_implementation)
    if base is not None and not _causal_without_mask(base):
        raise ConfigError(f"{key}: the model's layers call {attn_implementation!r}, which attends without a "
                          "causal mask when called without one — and Ulysses drops the model's masks; load the "
                          "model with sdpa or a flash kernel")
    if pose and base is not None and "flash" in base:
        raise ConfigError(f"{key}: PoSE with {base}: without the mask the flash kernel reads PoSE's jumping "
                          "position ids as packed sequences; load the model with sdpa")


def with_positions(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the Ulysses data loader adapter shards: ``input_ids``, ``labels`` (the ids; the adapter
    shifts them into ``shift_labels``) and ``position_ids`` ``[b, s]`` (PoSE's, else 0 … s−1)."""
    ids = batch["input_ids"]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return {"input_ids": ids, "labels": ids, "position_ids": pos}


class _Mapped:
    """A data loader whose batches go through ``with_positions`` (the adapter reads ``len`` and iterates)."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return (with_positions(b) for b in self.loader)


def _init_deepspeed_comm(device_type: str) -> None:
    """DeepSpeed's communication layer on the process group accelerate (or torchrun) already made.
    On the CPU DeepSpeed would first compile its shared-memory all-reduce (several minutes on a
    fresh machine), which only its inference all-reduce uses — Ulysses' all-to-all and all-gather
    go through the process group (gloo) — so it is marked unavailable there."""
    import deepspeed
    import deepspeed.comm as ds_dist

    if device_type == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


class SequenceParallel:
    """Ulysses sequence parallelism over groups of ``size`` consecutive processes, around the
    attention function ``model`` is patched with. ``close()`` puts the function back.

    Args:
        model: the patched transformers model (not yet wrapped by DDP / FSDP).
        size: P, processes per group (≥ 2; the world size must be a multiple).
        micro_batch_size: b, windows per micro-batch.

    Raises ``ConfigError`` (via ``check_sequence_parallel``, which the caller runs first) and
    DeepSpeed's ``ValueError`` / ``RuntimeError`` for what it checks itself.
    """

    def __init__(self, model, size: int, micro_batch_size: int):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        device = next(model.parameters()).device
        _init_deepspeed_comm(device.type)
        self.size = size
        self.name = model.config._attn_implementation
        self._original = ALL_ATTENTION_FUNCTIONS[self.name]
        # the wrapper is skipped in eval mode: held-out perplexity runs whole windows per process
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=self.name, sequence_parallel_size=size,
            micro_batch_size=micro_batch_size, seq_length_is_variable=True, disable_in_eval=True)
        self.group = self.mpu.get_sequence_parallel_group()
        self.rank = self.mpu.get_sequence_parallel_rank()

    @property
    def backward_scale(self) -> int:
        """What each process's loss is multiplied by before backward (data parallelism averages
        over all processes; the group's gradients must add up)."""
        return self.size

    def shard(self, loader, device):
        """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` around ``loader``: each process reads its own
        batch as under data parallelism; the group then runs the P batches one after another,
        each cut into P shards — P micro-batches per batch read (``input_ids``, ``position_ids``,
        ``shift_labels`` ``[b, s_l]``, on the CPU)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        return UlyssesSPDataLoaderAdapter(_Mapped(loader), sp_rank=self.rank, sp_group=self.group,
                                          sp_world_size=self.size, device=device)

    def loss(self, model, batch: dict[str, torch.Tensor], *, chunk_size: int | None = None,
             head: OutputHead | None = None) -> torch.Tensor:
        """This process's share of the micro-batch's mean next-token NLL [nats]: the NLL summed over
        its shard's ``shift_labels`` ``[b, s_l]`` divided by the labels scored in the whole window
        (``-100`` ignored). Summed over the group it is the window's mean NLL. The LM head runs
        ``chunk_size`` positions at a time, recomputed in backward (``ropescale.lm_head``); 0: the
        model's full ``[b, s_l, V]`` logits."""
        device = next(model.parameters()).device
        ids, pos = batch["input_ids"].to(device), batch["position_ids"].to(device)
        targets = batch["shift_labels"].to(device)
        inputs = {"input_ids": ids, "position_ids": pos, "attention_mask": torch.ones_like(ids), "use_cache": False}
        if chunk_size == 0 or (head is not None and head.mismatch is not None):
            total = _loss_sum_full(model(**inputs).logits, targets)
        else:
            head = head or OutputHead(model)
            hidden, own = head.run(**inputs)
            if head.verify(hidden, own):
                total = _loss_sum_chunked(head, hidden, targets, chunk_size)
            else:
                total = _loss_sum_full(model(**inputs).logits, targets)
        count = (targets != IGNORE).sum().to(torch.float32)
        torch.distributed.all_reduce(count, group=self.group)
        return total / count.clamp_min(1)

    def close(self) -> None:
        """Put the attention function back under its name and release DeepSpeed's groups (another
        run in this process may set them up again)."""
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[self.name] = self._original
        release = getattr(parallel_state_sp, "_release_sequence_parallel_groups", None)
        if release is not None:
            release()

    def __enter__(self) -> SequenceParallel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _loss_sum_full(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE)


def _chunk_sum(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _loss_sum_full(head.logits(hidden), targets)


def _loss_sum_chunked(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor,
                      chunk_size: int | None) -> torch.Tensor:
    """Σ NLL of ``targets`` ``[b, n]`` (already shifted) from ``hidden`` ``[b, n, d]``, the head over
    chunks of positions under activation checkpointing (as ``ropescale.lm_head.causal_lm_loss``)."""
    b, n = targets.shape
    chunk = chunk_size or chunk_size_for(head.vocab_size, b, training=True, dtype=hidden.dtype)
    total = hidden.new_zeros((), dtype=torch.float32)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.proj.parameters()))
    for s in range(0, n, chunk):
        part = (hidden[:, s : s + chunk], targets[:, s : s + chunk])
        total = total + (checkpoint(_chunk_sum, head, *part, use_reentrant=False) if grad else _chunk_sum(head, *part))
    return total

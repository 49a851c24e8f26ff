"""Will a run fit? Memory estimates made *before* allocating, and the memory there is to hold them.

A cell at L tokens holds, on the model's device, the activations of one forward over L tokens and,
for the retrieval tasks, the KV cache of the prompt; on the host, the prompts of every example.
The estimates here are lower bounds of what PyTorch will ask for (the big tensors only, no
allocator slack), so a run refused by them could not have finished: an 8B model at 128k tokens
(16 GiB of bf16 KV cache, about 16 GiB of activations) is accepted on an 80 GiB GPU, while 10
million tokens on the bundled model (20 GiB of KV cache alone) is refused on a laptop, in one line
naming the estimate, instead of an allocator traceback (or the kernel's OOM killer) an hour in.

Free memory: ``torch.cuda.mem_get_info`` (plus what PyTorch's caching allocator holds unused) on
CUDA; on the host ``MemAvailable`` of ``/proc/meminfo``, bounded by a cgroup (container) limit,
else ``os.sysconf`` free pages. On MPS (unified memory, no query) nothing is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ropescale.errors import InvalidInput

__all__ = [
    "GiB",
    "InsufficientMemoryError",
    "ModelDims",
    "Need",
    "check_fits",
    "device_available",
    "fmt_gib",
    "forward_bytes",
    "host_available",
    "kv_cache_bytes",
    "model_dims",
]

GiB = 1 << 30
PY_LIST_SLOT = 8  # bytes per element of a Python list of token ids (token ints are shared objects)


class InsufficientMemoryError(InvalidInput):
    """What was asked for cannot fit in this machine's memory (estimated before allocating)."""


def fmt_gib(n: float) -> str:
    """``n`` bytes as GiB for a table: one decimal below 100 GiB."""
    g = n / GiB
    return f"{g:.1f} GiB" if g < 100 else f"{g:,.0f} GiB"


@dataclass(frozen=True)
class ModelDims:
    """What memory depends on in a transformers config (its text config for multimodal ones)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    sliding_layers: int = 0  # layers whose KV cache keeps at most ``sliding_window`` tokens
    sliding_window: int | None = None
    eager: bool = False  # attention materialises [heads, n, n] scores
    dense_masks: bool = False  # sliding-window layers get a [n, n] mask (transformers' sdpa / eager)


def model_dims(model_or_config) -> ModelDims:
    """``ModelDims`` read from a model's config (or a config; its text config for multimodal ones)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0) or 1)
    kv = int(getattr(text, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if hidden else 0))
    inter = int(getattr(text, "intermediate_size", 0) or getattr(text, "n_inner", 0) or 4 * hidden)
    window = getattr(text, "sliding_window", None)
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or 1)
    types = getattr(text, "layer_types", None)
    if isinstance(window, int) and window > 0:
        if types:
            sliding = sum(1 for t in types if "sliding" in str(t))
        else:
            sliding = layers if getattr(text, "use_sliding_window", True) else 0
    else:
        window, sliding = None, 0
    impl = getattr(config, "_attn_implementation", None) or getattr(text, "_attn_implementation", None)
    return ModelDims(layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, hidden=hidden,
                     intermediate=inter, vocab=int(getattr(text, "vocab_size", 0) or 0), sliding_layers=sliding,
                     sliding_window=window, eager=impl == "eager",
                     dense_masks=sliding > 0 and (impl or "sdpa") in ("sdpa", "eager"))


def kv_cache_bytes(dims: ModelDims, tokens: int, itemsize: int, *, batch: int = 1) -> int:
    """Keys and values of every layer for ``tokens`` tokens (sliding-window layers keep their window)."""
    full = dims.layers - dims.sliding_layers
    kept = full * tokens + dims.sliding_layers * min(tokens, dims.sliding_window or tokens)
    return 2 * batch * kept * dims.kv_heads * dims.head_dim * itemsize


def forward_bytes(dims: ModelDims, tokens: int, itemsize: int, *, batch: int = 1, logits_positions: int = 1) -> int:
    """Peak activations of one inference forward over ``batch`` × ``tokens`` (no grad): the residual
    stream and a normed copy, q/k/v, the attention output, the MLP's gate/up/product, the rotary
    cos/sin (float32) and position ids, the logits kept (float32) — plus the [heads, n, n] scores
    and their softmax under eager attention, and the sliding-window layers' [n, n] bool mask with
    the float copy PyTorch's SDPA makes of it (``dense_masks``: transformers' sdpa and eager build one;
    ``ropescale.attention.local`` does not). Fused (SDPA / flash) attention is otherwise O(n)."""
    n = batch * tokens
    per_token = itemsize * (3 * dims.hidden + (dims.heads + 2 * dims.kv_heads) * dims.head_dim + 3 * dims.intermediate)
    per_token += 4 * 2 * dims.head_dim + 8  # cos/sin, position ids
    out = n * per_token + batch * logits_positions * dims.vocab * 4
    if dims.eager:
        out += 2 * batch * dims.heads * tokens * tokens * itemsize
    if dims.dense_masks:
        out += batch * tokens * tokens * (1 + itemsize)
    return out


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What a cgroup (v2 or v1) memory limit still allows, or None when there is none. Usage
    counts the page cache; its inactive part is reclaimable, so it is not counted as used (the
    "working set" container runtimes report)."""
    for limit_file, usage_file, stat_file, inactive_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        inactive = 0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
                    break
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - inactive))
    return None


def host_available() -> int | None:
    """Bytes of host memory a process can still take (None when this OS does not say)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def device_available(device: torch.device | str) -> int | None:
    """Free bytes on ``device`` (None: unknown, e.g. MPS)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)
        # what PyTorch's caching allocator holds but does not use is free to this process too
        return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if device.type == "cpu":
        return host_available()
    return None


@dataclass
class Need:
    """What one cell asks for: ``device`` bytes (by part) on the model's device, ``host`` bytes
    (by part) in host memory; ``what`` says for what (``passkey: 60 prompts × 10000000 tokens``)."""

    what: str
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)


def _parts(parts: dict[str, int]) -> str:
    return " + ".join(f"{k} {fmt_gib(v)}" for k, v in parts.items() if v >= GiB / 20)  # shown: 0.1 GiB and up


def check_fits(need: Need, device: torch.device | str | None, *, hint: str = "") -> None:
    """Raise ``InsufficientMemoryError`` (one line naming the estimate and the free memory) when
    ``need`` cannot fit on ``device`` and the host; on a CPU device both are the host's memory.
    ``device`` None: only the host's share is checked (a model spread over several devices)."""
    device = torch.device(device) if device is not None else None
    on_host = device is not None and device.type == "cpu"
    host_free = host_available()
    dev_need, host_need = sum(need.device.values()), sum(need.host.values())
    hint = f"; {hint}" if hint else ""
    if on_host:
        total = dev_need + host_need
        if host_free is not None and total > host_free:
            raise InsufficientMemoryError(
                f"{need.what} needs about {fmt_gib(total)} ({_parts({**need.device, **need.host})}); "
                f"this machine has {fmt_gib(host_free)} free{hint}")
        return
    dev_free = device_available(device) if device is not None and dev_need else None
    if dev_free is not None and dev_need > dev_free:
        raise InsufficientMemoryError(
            f"{need.what} needs about {fmt_gib(dev_need)} on {device} ({_parts(need.device)}); "
            f"this device has {fmt_gib(dev_free)} free{hint}")
    if host_free is not None and host_need > host_free:
        raise InsufficientMemoryError(
            f"{need.what} needs about {fmt_gib(host_need)} of host memory ({_parts(need.host)}); "
            f"this machine has {fmt_gib(host_free)} free{hint}")

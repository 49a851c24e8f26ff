"""Shared by the benchmarks: what machine this ran on, and one timed forward or backward."""

import os
import platform
import time

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}; {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; {gpu}; "
            f"torch {torch.__version__}, python {platform.python_version()}")


def sync(device: str) -> None:
    """Wait for the GPU's queued work (CUDA launches return before the kernels finish)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(model, ids: torch.Tensor, backward: bool) -> float:
    """Seconds of one forward of ``model``'s base model on ``ids`` ``[b, s]`` (no grad), or of one backward
    after a forward with autograd (the forward not counted; gradients freed after)."""
    device = ids.device.type
    if backward:
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state.sum()
        sync(device)
        t0 = time.perf_counter()
        out.backward()
        sync(device)
        seconds = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return seconds
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        model.model(input_ids=ids, use_cache=False)
        sync(device)
        return time.perf_counter() - t0

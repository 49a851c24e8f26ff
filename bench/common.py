"""Shared by the benchmarks: what machine this ran on."""

import os
import platform

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

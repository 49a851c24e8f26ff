"""Launch a script as two gloo processes on the CPU (``accelerate launch --multi_gpu``), as users launch
runs, and read the JSON objects both processes print."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on (launched tests on one machine must not share torchrun's 29500)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(script: Path, *args: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` with ``args`` in two launched processes; its result and every JSON object printed
    (the two processes share stdout, so their lines may interleave: "{…}{…}\\n\\n")."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(script), *args],
                         capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    return res, [json.loads(x) for x in re.findall(r"\{[^{}]*\}", res.stdout)]

"""Launch a script as two gloo processes on the CPU (``accelerate launch --multi_gpu``), as users launch
runs, and read the JSON objects both processes print."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# tests that run several processes at once (launched gloo groups, processes racing on one folder or study):
# one worker runs them all, one after another, while the other runs single-process tests — two such tests at
# once put five or six processes on two cores, where gloo and OpenMP spin while they wait
PROCESSES = pytest.mark.xdist_group("processes")


def free_port() -> int:
    """A port nothing listens on (launched tests on one machine must not share torchrun's 29500)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(script: Path, *args: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` with ``args`` in two launched processes; its result and every JSON object printed
    (the two processes share stdout, so their lines may interleave: "{…}{…}\\n\\n"). A launch still
    running after ``timeout`` seconds (a hang) fails the test, its workers stopped by the launcher
    (SIGTERM, which torchrun passes on; a launcher killed outright leaves them running, each in its
    own session, holding the cores)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(script), *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=ROOT) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"the launch did not finish in {timeout} s (stopped): {err[-2000:]}")
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return res, [json.loads(x) for x in re.findall(r"\{[^{}]*\}", res.stdout)]

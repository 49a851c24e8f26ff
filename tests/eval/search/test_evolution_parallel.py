"""LongRoPE's evolutionary search on several processes: two CPU processes (gloo) under
`accelerate launch` make and score exactly the candidates one process does, split between them."""

import json
import os
import subprocess
import sys
from pathlib import Path

from eval.search.evolution import run_evolution
from tests.launch import PROCESSES

ROOT = Path(__file__).resolve().parents[3]
TARGET = [1, 1.05, 1.2, 1.6, 2.2, 2.9, 3.5, 4]
KW = dict(dim=16, scale=4.0, population=8, elite=4, iterations=5, seed=3)

SCRIPT = """
import json, os, sys
from pathlib import Path
from accelerate import PartialState
from eval.search.evolution import run_evolution, split_over_processes

target = {target}
state = PartialState(cpu=True)
out = Path(sys.argv[1])
seen = []

def objective(f, s):
    seen.append([round(x, 6) for x in f])
    return sum((a - b) ** 2 for a, b in zip(f, target))

res = run_evolution(objective, evaluate_batch=split_over_processes(objective, state),
                    journal=out / "journal.jsonl", write_journal=state.is_main_process, **{kw})
(out / f"seen-{{state.process_index}}.json").write_text(json.dumps(seen))
if state.is_main_process:
    (out / "result.json").write_text(json.dumps({{"history": res.history, "factors": res.factors,
                                                  "value": res.value}}))
state.wait_for_everyone()
import torch.distributed as dist
dist.destroy_process_group()  # a gloo group left to interpreter shutdown can abort ("terminate called ...")
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:  # torchrun's default 29500 may be taken by another launch
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sq(f, s):
    return sum((a - b) ** 2 for a, b in zip(f, TARGET))


@PROCESSES
def test_two_processes_make_and_score_the_serial_candidates(tmp_path):
    serial = run_evolution(_sq, **KW)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(target=TARGET, kw=KW), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(script), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["history"] == json.loads(json.dumps(serial.history))  # same candidates, values, order
    assert got["factors"] == serial.factors and got["value"] == serial.value
    seen = [json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in (0, 1)]
    assert len(seen[0]) + len(seen[1]) == serial.evaluations  # each candidate scored once ...
    assert abs(len(seen[0]) - len(seen[1])) <= KW["iterations"] + 1  # ... and the work split
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 1 + serial.evaluations  # one writer: the header and each evaluation once

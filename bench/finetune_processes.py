"""One process vs two (data parallel, gloo) fine-tuning the bundled model: the same loss curve?

    python bench/finetune_processes.py [--strategy yarn:factor=4] [--length 512] [--steps 20]

Runs ``ropescale finetune`` twice on the same config: one process with batch B, and two
processes (``accelerate launch --multi_gpu --num_processes 2``, which on a machine without a GPU
makes one gloo group of CPU processes) with batch B/2 each — the same global batches in the same
order. Prints, per step, both losses and their relative difference, the largest difference over
the run, the largest relative difference of the saved weights, and tokens/s of each (on this
2-core machine the two processes share the cores, so the rate shows overhead, not speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402
from ropescale.training.report import read_log  # noqa: E402


def _run(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{res.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="reference")
    ap.add_argument("--strategy", default="yarn:factor=4")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="global batch (one process); halved per process for two")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    base = {"model": args.model, "strategy": args.strategy, "data": "kjv-train", "length": args.length,
            "steps": args.steps, "batch_size": args.batch_size, "lr": 3e-4, "warmup": 2, "seed": 0,
            "checkpoint_every": args.steps, "device": "cpu"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one_cfg, two_cfg = tmp / "one.yaml", tmp / "two.yaml"
        one_cfg.write_text(json.dumps({**base, "threads": 2}))
        two_cfg.write_text(json.dumps({**base, "batch_size": args.batch_size // 2, "threads": 1}))
        t_one = _run([sys.executable, str(ROOT / "cli.py"), "finetune", str(one_cfg), "-o", str(tmp / "one"), "-q"],
                     env)
        t_two = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                      "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                      str(ROOT / "cli.py"), "finetune", str(two_cfg), "-o", str(tmp / "two"), "-q"],
                     {**env, "OMP_NUM_THREADS": "1"})
        one = [r for r in read_log(tmp / "one") if "loss" in r]
        two = [r for r in read_log(tmp / "two") if "loss" in r]
        w1 = load_file(next((tmp / "one" / "model").glob("*.safetensors")))
        w2 = load_file(next((tmp / "two" / "model").glob("*.safetensors")))
    assert ([r["step"] for r in one] == [r["step"] for r in two]
            and [r["tokens"] for r in one] == [r["tokens"] for r in two])
    print(f"machine: {machine()}")
    print(f"model {args.model}, {args.strategy}, L = {args.length}, global batch {args.batch_size}, "
          f"{args.steps} steps, KJV training books, seed 0\n")
    print("| step | loss, 1 process | loss, 2 processes | relative difference |")
    print("|---:|---:|---:|---:|")
    rel = []
    for a, b in zip(one, two):
        rel.append(abs(a["loss"] - b["loss"]) / abs(a["loss"]))
        print(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {rel[-1]:.1e} |")
    wrel = max(((w1[k] - w2[k]).abs().max() / w1[k].abs().max().clamp_min(1e-12)).item() for k in w1)
    print(f"\nlargest relative loss difference: {max(rel):.1e}; largest relative weight difference "
          f"after {args.steps} steps (per tensor, max |Δ| / max |w|): {wrel:.1e}")
    tokens = one[-1]["tokens"]
    print(f"wall (process start to exit): 1 process {t_one:.1f} s, 2 processes {t_two:.1f} s "
          f"({tokens} training tokens each; ratio 2/1 = {t_two / t_one:.2f}); torch {torch.__version__}")


if __name__ == "__main__":
    main()

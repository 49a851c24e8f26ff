"""The same perplexity sweep through ``engine: transformers`` and ``engine: vllm``, in one run.

    python bench/engine_throughput.py [--model reference] [--lengths 256,1024] [--windows 16]
        [--strategies vanilla,yarn] [--dtype float32]

Both sweeps run with ``eval.sweep.run_sweep`` into a temporary folder (vLLM in its own
environment: ``bench/engines/install.sh vllm``). Per cell: both engines' perplexity and
``|Δ NLL|`` (the tables must agree within the parity tolerance), and examples (windows) per
second — transformers: the cell's seconds; vLLM: the cell's seconds (export, the transformers
parity check on the first window, vLLM's start-up and scoring) and its scoring seconds alone,
which is what a longer cell tends to. On the CPU vLLM's start-up (tens of seconds a cell)
dominates small cells.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="reference")
    ap.add_argument("--data", default="kjv-heldout")
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--strategies", default="vanilla,yarn")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from bench.common import machine
    from eval.config import build_config
    from eval.sweep import run_sweep

    raw = {"model": args.model, "data": args.data, "lengths": [int(x) for x in args.lengths.split(",")],
           "max_windows": args.windows, "strategies": args.strategies.split(","), "device": args.device,
           "dtype": args.dtype}
    with tempfile.TemporaryDirectory(prefix="ropescale-engines-") as tmp:
        ours = run_sweep(build_config(raw), Path(tmp) / "transformers", progress=False)
        theirs = run_sweep(build_config({**raw, "engine": "vllm"}), Path(tmp) / "vllm", progress=False)
    print(f"machine: {machine()}")
    print(f"{args.model} ({args.dtype}), perplexity, {args.windows} windows per cell; "
          f"vLLM {theirs[0]['engine_version']}, transformers {ours[0]['engine_version']}\n")
    print("| strategy | L | PPL transformers | PPL vLLM | abs. Δ NLL | tolerance | windows/s transformers "
          "| windows/s vLLM (cell) | windows/s vLLM (scoring) | vLLM start-up [s] |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(ours, theirs):
        n = a["windows"]
        print(f"| {a['strategy']} | {a['length']} | {math.exp(a['nll']):.4f} | {math.exp(b['nll']):.4f} | "
              f"{abs(a['nll'] - b['nll']):.1e} | {b['parity']['tolerance']:g} | {n / a['seconds']:.2f} | "
              f"{n / b['seconds']:.2f} | {n / b['engine_score_seconds']:.2f} | {b['engine_start_seconds']:.1f} |")


if __name__ == "__main__":
    main()

"""Peak memory and time of the truncation rules vs vanilla SDPA and vs the naive path.

    python bench/truncation_cost.py [--lengths 1024,2048,4096,8192,16384] [--naive-max 1024]

Each (variant, length) runs in its own subprocess on the bundled model's base transformer (no
LM head, so the logits tensor does not dilute attention memory) over one held-out document.
Memory = peak RSS during the forward minus RSS just before it, measured in a process where glibc
serves every allocation over 128 KiB by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave
RSS at once and the peak tracks live memory, not allocator history. Time = best of ``--repeats``,
measured in a separate process with the normal allocator (mmap-per-allocation slows everything).
Ratios are against vanilla RoPE with SDPA at the same length, measured in the same run. The
naive path (explicit n × n relative positions, the tests' oracle) runs only up to
``--naive-max`` tokens: it needs O(n²·d) memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "vanilla (sdpa)": ("vanilla", {}, {}),
    "rerope": ("rerope", {"window": 64}, {}),
    "leaky_rerope": ("leaky_rerope", {"window": 64, "k": 16.0}, {}),
    "self_extend": ("self_extend", {"window": 64, "group_size": 8}, {}),
    "rerope (naive)": ("rerope", {"window": 64}, {"attention_path": "naive"}),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(variant: str, length: int, repeats: int) -> None:
    import torch

    import ropescale
    from eval.data import DataSpec, load_documents, tokenize_documents

    model, tok = ropescale.load_model("reference", device="cpu")
    doc = max(tokenize_documents(tok, load_documents(DataSpec("kjv-heldout"))), key=len)
    ids = doc[:length][None]
    name, params, opts = VARIANTS[variant]
    ropescale.patch(model, name, **params, **opts)
    with torch.no_grad():
        model.model(input_ids=ids[:, :16], use_cache=False)  # warm-up
        before = rss_bytes()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.model(input_ids=ids, use_cache=False)
            best = min(best, time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": best, "memory": max(peak - before, 0)}))


def _run(variant: str, length: int, repeats: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", variant, "--lengths", str(length),
                          "--repeats", str(repeats)], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(variant: str, length: int, repeats: int) -> dict:
    timed = _run(variant, length, repeats, dict(os.environ))
    sized = _run(variant, length, 1, {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    return {"seconds": timed["seconds"], "memory": sized["memory"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--naive-max", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        return worker(args.worker, lengths[0], args.repeats)

    from bench.common import machine

    print(f"machine: {machine()}")
    print("bundled model (T = 128), base transformer forward, batch 1, window 64, group 8; "
          f"best of {args.repeats}\n")
    print(f"{'length':>6} {'variant':<16} {'seconds':>8} {'time ×':>7} {'peak MiB':>9} {'memory ×':>9}")
    for length in lengths:
        base = None
        for variant in VARIANTS:
            if "naive" in variant and length > args.naive_max:
                print(f"{length:>6} {variant:<16} {'skipped: needs O(n²·d) memory':>36}")
                continue
            r = measure(variant, length, args.repeats)
            base = base or r
            print(f"{length:>6} {variant:<16} {r['seconds']:>8.2f} {r['seconds'] / base['seconds']:>7.2f} "
                  f"{r['memory'] / 2**20:>9.1f} {r['memory'] / max(base['memory'], 1):>9.2f}", flush=True)


if __name__ == "__main__":
    main()

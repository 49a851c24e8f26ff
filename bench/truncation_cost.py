"""Peak memory and time of the truncation rules vs vanilla SDPA, forward and backward.

    python bench/truncation_cost.py [--lengths 2048,4096,8192,16384] [--naive-max 1024] [--no-backward]

Each (variant, length) runs in its own subprocess on the bundled model's base transformer (no
LM head, so the logits tensor does not dilute attention memory) over one held-out document.
Memory = peak RSS during the forward minus RSS just before it, measured in a process where glibc
serves every allocation over 128 KiB by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave
RSS at once and the peak tracks live memory, not allocator history. Time = best of ``--repeats``,
measured in a separate process with the normal allocator (mmap-per-allocation slows everything).
Ratios are against vanilla RoPE with SDPA at the same length, measured in the same run. The
naive path (explicit n × n relative positions, the tests' oracle) runs only up to
``--naive-max`` tokens: it needs O(n²·d) memory. ``(blocked)`` is the Python online-softmax path
(the default before the fused kernel; still used for soft-capping and dropout).

Backward: forward with autograd, then backward of the hidden states' sum; its time is reported
as a multiple of the same variant's no-grad forward, and its peak memory (forward + backward)
against vanilla's.
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
    "rerope (blocked)": ("rerope", {"window": 64}, {"attention_path": "blocked"}),
    "rerope (naive)": ("rerope", {"window": 64}, {"attention_path": "naive"}),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(variant: str, length: int, repeats: int, backward: bool) -> None:
    import torch

    import ropescale
    from eval.data import DataSpec, load_documents, tokenize_documents

    model, tok = ropescale.load_model("reference", device="cpu")
    doc = max(tokenize_documents(tok, load_documents(DataSpec("kjv-heldout"))), key=len)
    ids = doc[:length][None]
    name, params, opts = VARIANTS[variant]
    ropescale.patch(model, name, **params, **opts)
    model.requires_grad_(backward)
    with torch.no_grad():
        model.model(input_ids=ids[:, :16], use_cache=False)  # warm-up
    before = rss_bytes()
    best = float("inf")
    for _ in range(repeats):
        if backward:  # forward with autograd, then backward; the time is the backward's
            out = model.model(input_ids=ids, use_cache=False).last_hidden_state.sum()
            t0 = time.perf_counter()
            out.backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                t0 = time.perf_counter()
                model.model(input_ids=ids, use_cache=False)
        best = min(best, time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": best, "memory": max(peak - before, 0)}))


def _run(variant: str, length: int, repeats: int, env: dict, backward: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", variant, "--lengths", str(length),
                          "--repeats", str(repeats)] + (["--backward"] if backward else []),
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(variant: str, length: int, repeats: int, backward: bool = False) -> dict:
    timed = _run(variant, length, repeats, dict(os.environ), backward)
    sized = _run(variant, length, 1, {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}, backward)
    return {"seconds": timed["seconds"], "memory": sized["memory"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--naive-max", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="(worker) time the backward")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    ap.add_argument("--backward-max", type=int, default=8192, help="longest length whose backward is measured")
    ap.add_argument("--worker")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        return worker(args.worker, lengths[0], args.repeats, args.backward)

    from bench.common import machine

    print(f"machine: {machine()}")
    print("bundled model (T = 128), base transformer forward, batch 1, window 64, group 8; "
          f"best of {args.repeats}\n")
    print(f"{'length':>6} {'variant':<16} {'seconds':>8} {'time ×':>7} {'peak MiB':>9} {'memory ×':>9}"
          + ("" if args.no_backward else f" {'bwd s':>7} {'bwd/fwd':>7} {'bwd MiB':>8} {'bwd mem ×':>9}"))
    for length in lengths:
        base = base_bwd = None
        for variant in VARIANTS:
            if "naive" in variant and length > args.naive_max:
                print(f"{length:>6} {variant:<16} {'skipped: needs O(n²·d) memory':>36}")
                continue
            r = measure(variant, length, args.repeats)
            base = base or r
            line = (f"{length:>6} {variant:<16} {r['seconds']:>8.2f} {r['seconds'] / base['seconds']:>7.2f} "
                    f"{r['memory'] / 2**20:>9.1f} {r['memory'] / max(base['memory'], 1):>9.2f}")
            if not args.no_backward and length <= args.backward_max and "blocked" not in variant:
                bw = measure(variant, length, args.repeats, backward=True)
                base_bwd = base_bwd or bw
                line += (f" {bw['seconds']:>7.2f} {bw['seconds'] / r['seconds']:>7.2f} {bw['memory'] / 2**20:>8.1f}"
                         f" {bw['memory'] / max(base_bwd['memory'], 1):>9.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()

"""Peak memory and time of the truncation rules vs vanilla SDPA, forward and backward.

    python bench/truncation_cost.py [--lengths 2048,4096,8192,16384] [--naive-max 1024] [--no-backward]

Runs on the bundled model's base transformer (no LM head, so the logits tensor does not dilute
attention memory) over one held-out document. Memory = peak RSS during the forward minus RSS
just before it, each (variant, length) in its own process where glibc serves every allocation
over 128 KiB by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave RSS at once and the
peak tracks live memory, not allocator history. Time = best of ``--repeats`` rounds, all
variants of a length interleaved round by round in one process with the normal allocator, so a
drift of the machine's speed hits them alike.
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


def _setup(length: int):
    import ropescale
    from eval.data import DataSpec, load_documents, tokenize_documents

    model, tok = ropescale.load_model("reference", device="cpu")
    doc = max(tokenize_documents(tok, load_documents(DataSpec("kjv-heldout"))), key=len)
    return model, doc[:length][None]


def _once(model, ids, backward: bool) -> float:
    """Seconds of one forward (no grad), or of one backward after a forward with autograd."""
    import torch

    if backward:
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state.sum()
        t0 = time.perf_counter()
        out.backward()
        seconds = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return seconds
    with torch.no_grad():
        t0 = time.perf_counter()
        model.model(input_ids=ids, use_cache=False)
        return time.perf_counter() - t0


def time_worker(variants: list[str], length: int, repeats: int, backward: bool) -> None:
    """Best-of-``repeats`` seconds per variant, the variants interleaved round by round in one
    process, so drifts of the machine's speed hit every variant alike."""
    import torch

    import ropescale

    model, ids = _setup(length)
    model.requires_grad_(backward)
    with torch.no_grad():
        model.model(input_ids=ids[:, :16], use_cache=False)  # warm-up
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for variant in variants:
            name, params, opts = VARIANTS[variant]
            with ropescale.patch(model, name, **params, **opts):
                best[variant] = min(best[variant], _once(model, ids, backward))
    print(json.dumps(best))


def memory_worker(variant: str, length: int, backward: bool) -> None:
    """Peak RSS above the pre-run level during one forward (or forward + backward)."""
    import torch

    import ropescale

    model, ids = _setup(length)
    name, params, opts = VARIANTS[variant]
    ropescale.patch(model, name, **params, **opts)
    model.requires_grad_(backward)
    with torch.no_grad():
        model.model(input_ids=ids[:, :16], use_cache=False)  # warm-up
    before = rss_bytes()
    _once(model, ids, backward)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"memory": max(peak - before, 0)}))


def _run(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def seconds(variants: list[str], length: int, repeats: int, backward: bool) -> dict:
    return _run(["--time", ",".join(variants), "--lengths", str(length), "--repeats", str(repeats)]
                + (["--backward"] if backward else []))


def memory(variant: str, length: int, backward: bool) -> int:
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return _run(["--memory", variant, "--lengths", str(length)] + (["--backward"] if backward else []), env)["memory"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--naive-max", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="(worker) time the backward")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    ap.add_argument("--backward-max", type=int, default=8192, help="longest length whose backward is measured")
    ap.add_argument("--time", help="(worker) comma-separated variants to time")
    ap.add_argument("--memory", help="(worker) variant to size")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.time:
        return time_worker(args.time.split(","), lengths[0], args.repeats, args.backward)
    if args.memory:
        return memory_worker(args.memory, lengths[0], args.backward)

    from bench.common import machine

    print(f"machine: {machine()}")
    print("bundled model (T = 128), base transformer, batch 1, window 64, group 8; time: best of "
          f"{args.repeats} rounds, variants interleaved in one process; memory: own process each\n")
    print(f"{'length':>6} {'variant':<16} {'seconds':>8} {'time ×':>7} {'peak MiB':>9} {'memory ×':>9}"
          + ("" if args.no_backward else f" {'bwd s':>7} {'bwd/fwd':>7} {'bwd MiB':>8} {'bwd mem ×':>9}"))
    base = next(iter(VARIANTS))
    for length in lengths:
        fwd = [v for v in VARIANTS if "naive" not in v or length <= args.naive_max]
        bwd = [v for v in fwd if "blocked" not in v] if not args.no_backward and length <= args.backward_max else []
        t_f = seconds(fwd, length, args.repeats, False)
        t_b = seconds(bwd, length, args.repeats, True) if bwd else {}
        m_f = {v: memory(v, length, False) for v in fwd}
        m_b = {v: memory(v, length, True) for v in bwd}
        for variant in VARIANTS:
            if variant not in fwd:
                print(f"{length:>6} {variant:<16} {'skipped: needs O(n²·d) memory':>36}")
                continue
            line = (f"{length:>6} {variant:<16} {t_f[variant]:>8.2f} {t_f[variant] / t_f[base]:>7.2f} "
                    f"{m_f[variant] / 2**20:>9.1f} {m_f[variant] / max(m_f[base], 1):>9.2f}")
            if variant in bwd:
                line += (f" {t_b[variant]:>7.2f} {t_b[variant] / t_f[variant]:>7.2f} {m_b[variant] / 2**20:>8.1f}"
                         f" {m_b[variant] / max(m_b[base], 1):>9.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()

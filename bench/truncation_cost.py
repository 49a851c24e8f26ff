"""Peak memory and time of the relative-position rules vs vanilla SDPA, forward and backward.

    python bench/truncation_cost.py [--lengths 2048,4096,8192,16384] [--naive-max 1024]
                                    [--flex-max N] [--device cpu|cuda] [--no-backward]

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
(the default before the fused kernel; still used for dropout, and on the CPU for soft-capping).
``(flex)`` is the FlexAttention path (``ropescale.attention.flex``): on CUDA the compiled kernel (what
the default path runs there), on the CPU eager and unfused — it materialises each region's
scores — so it runs only up to ``--flex-max`` tokens (default: 2048 on the CPU, every length on
CUDA), and its backward is not measured on the CPU (torch has no CPU FlexAttention backward; the
path hands training to the fused kernel there).

``--device cuda``: the same measurements on the GPU; time is taken between
``torch.cuda.synchronize()`` calls, memory is ``torch.cuda.max_memory_allocated`` above the
allocation before the run (own process each, as on the CPU), and every variant runs once at the
full length before timing, so torch.compile's compilation of the flex kernel is not timed (on the
CPU flex, too, runs once at the full length first: eager flex traces each new shape).

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "vanilla (sdpa)": ("vanilla", {}, {}),
    "rerope": ("rerope", {"window": 64}, {}),
    "leaky_rerope": ("leaky_rerope", {"window": 64, "k": 16.0}, {}),
    "self_extend": ("self_extend", {"window": 64, "group_size": 8}, {}),
    "string": ("string", {}, {}),  # the authors' defaults at T = 128: S = 42, W = 5
    "dca": ("dca", {}, {}),  # ChunkLlama's defaults at T = 128: chunk_size 96, local_window 16 (chunks of 80)
    "rerope (blocked)": ("rerope", {"window": 64}, {"attention_path": "blocked"}),
    "rerope (flex)": ("rerope", {"window": 64}, {"attention_path": "flex"}),
    "rerope (naive)": ("rerope", {"window": 64}, {"attention_path": "naive"}),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _setup(length: int, device: str):
    import ropescale
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    model, tok = ropescale.load_model("reference", device=device)
    doc = max(tokenize_documents(tok, load_documents(DataSpec("kjv-heldout"))), key=len)
    return model, doc[:length][None].to(device)  # [1, length]


def _warm_up(model, ids, backward: bool, variant: str) -> None:
    """One untimed run per variant. On CUDA at the full length (forward, and backward when timed),
    so torch.compile compiles the flex kernel for this length before anything is measured; on the
    CPU a 16-token forward, except for flex at the full length (eager flex still traces each new
    shape with dynamo: seconds per call otherwise)."""
    import torch

    from bench.common import timed_step

    if ids.device.type != "cuda":
        with torch.no_grad():
            model.model(input_ids=ids if "flex" in variant else ids[:, :16], use_cache=False)
        return
    timed_step(model, ids, False)
    if backward:
        timed_step(model, ids, True)


def time_worker(variants: list[str], length: int, repeats: int, backward: bool, device: str) -> None:
    """Best-of-``repeats`` seconds per variant, the variants interleaved round by round in one
    process, so drifts of the machine's speed hit every variant alike."""
    import ropescale
    from bench.common import timed_step

    model, ids = _setup(length, device)
    model.requires_grad_(backward)
    for variant in variants:
        name, params, opts = VARIANTS[variant]
        with ropescale.patch(model, name, **params, **opts):
            _warm_up(model, ids, backward, variant)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for variant in variants:
            name, params, opts = VARIANTS[variant]
            with ropescale.patch(model, name, **params, **opts):
                best[variant] = min(best[variant], timed_step(model, ids, backward))
    print(json.dumps(best))


def memory_worker(variant: str, length: int, backward: bool, device: str) -> None:
    """Peak memory above the pre-run level during one forward (or forward + backward): RSS on the
    CPU, ``torch.cuda.max_memory_allocated`` on CUDA [bytes]."""
    import torch

    import ropescale
    from bench.common import timed_step

    model, ids = _setup(length, device)
    name, params, opts = VARIANTS[variant]
    ropescale.patch(model, name, **params, **opts)
    model.requires_grad_(backward)
    _warm_up(model, ids, backward, variant)
    if device == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        timed_step(model, ids, backward)
        peak = torch.cuda.max_memory_allocated()
    else:
        before = rss_bytes()
        timed_step(model, ids, backward)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"memory": max(peak - before, 0)}))


def _run(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def seconds(variants: list[str], length: int, repeats: int, backward: bool, device: str) -> dict:
    return _run(["--time", ",".join(variants), "--lengths", str(length), "--repeats", str(repeats),
                 "--device", device] + (["--backward"] if backward else []))


def memory(variant: str, length: int, backward: bool, device: str) -> int:
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return _run(["--memory", variant, "--lengths", str(length), "--device", device]
                + (["--backward"] if backward else []), env)["memory"]


def runs_at(variant: str, length: int, naive_max: int, flex_max: int | None) -> bool:
    """Whether ``variant`` is measured at ``length``: the naive path needs O(n²·d) memory, eager
    flex materialises the scores of each region (``flex_max`` None: no limit)."""
    if "naive" in variant:
        return length <= naive_max
    if "flex" in variant:
        return flex_max is None or length <= flex_max
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--naive-max", type=int, default=1024)
    ap.add_argument("--flex-max", type=int, default=None,
                    help="longest length of the flex variant [tokens]; default 2048 on the CPU (eager, unfused "
                         "there), no limit on CUDA")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="(worker) time the backward")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    ap.add_argument("--backward-max", type=int, default=8192, help="longest length whose backward is measured")
    ap.add_argument("--time", help="(worker) comma-separated variants to time")
    ap.add_argument("--memory", help="(worker) variant to size")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device on this machine")
    if args.time:
        return time_worker(args.time.split(","), lengths[0], args.repeats, args.backward, args.device)
    if args.memory:
        return memory_worker(args.memory, lengths[0], args.backward, args.device)
    flex_max = args.flex_max if args.flex_max is not None else (2048 if args.device == "cpu" else None)

    from bench.common import machine

    print(f"machine: {machine()}; measured on {args.device}")
    print("bundled model (T = 128), base transformer, batch 1, window 64, group 8; time: best of "
          f"{args.repeats} rounds, variants interleaved in one process; memory: own process each, "
          + ("CUDA max_memory_allocated" if args.device == "cuda" else "peak RSS") + "\n")
    print(f"{'length':>6} {'variant':<16} {'seconds':>8} {'time ×':>7} {'peak MiB':>9} {'memory ×':>9}"
          + ("" if args.no_backward else f" {'bwd s':>7} {'bwd/fwd':>7} {'bwd MiB':>8} {'bwd mem ×':>9}"))
    base = next(iter(VARIANTS))
    for length in lengths:
        fwd = [v for v in VARIANTS if runs_at(v, length, args.naive_max, flex_max)]
        bwd = ([v for v in fwd if "blocked" not in v and not ("flex" in v and args.device == "cpu")]
               if not args.no_backward and length <= args.backward_max else [])
        t_f = seconds(fwd, length, args.repeats, False, args.device)
        t_b = seconds(bwd, length, args.repeats, True, args.device) if bwd else {}
        m_f = {v: memory(v, length, False, args.device) for v in fwd}
        m_b = {v: memory(v, length, True, args.device) for v in bwd}
        for variant in VARIANTS:
            if variant not in fwd:
                why = "naive: needs O(n²·d) memory" if "naive" in variant else "eager flex: above --flex-max"
                print(f"{length:>6} {variant:<16} {'skipped: ' + why:>36}")
                continue
            line = (f"{length:>6} {variant:<16} {t_f[variant]:>8.2f} {t_f[variant] / t_f[base]:>7.2f} "
                    f"{m_f[variant] / 2**20:>9.1f} {m_f[variant] / max(m_f[base], 1):>9.2f}")
            if variant in bwd:
                line += (f" {t_b[variant]:>7.2f} {t_b[variant] / t_f[variant]:>7.2f} {m_b[variant] / 2**20:>8.1f}"
                         f" {m_b[variant] / max(m_b[base], 1):>9.2f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()

"""A sequence-parallel training step (DeepSpeed Ulysses) against one process at the same length.

    python bench/sp_step.py                                   # CPU: bundled model, 4096 tokens, sp = 2
    python bench/sp_step.py --device cuda --shape 8b --length 131072 --sp 2,4,8 --strategy yarn:factor=16
    python bench/sp_step.py --device cuda --shape 8b --length 131072 --sp 2,4,8 --strategy rerope:window=4096

One forward + backward of one window of ``--length`` random tokens (no optimiser step: what
sequence parallelism changes), activation checkpointing on, the chunked loss
(``ropescale.lm_head``), with the strategy patched in. ``sp = 1`` is one plain process
(``ropescale.training.loop.causal_lm_loss``); ``sp = P`` is P processes launched by torchrun, each
holding length / P tokens (``ropescale.training.sequence_parallel.SequenceParallel``: the
all-to-all around the patched attention). Every case runs in a fresh process: ``--reps`` timed
steps after one warm-up step at the same length.

On the CPU every process gets ``--threads`` threads (default 1: on a machine shared with other
work, one process spreading over all cores spends its time waiting for its slowest thread —
measured here at 146 tokens/s with 2 threads against 883 with 1), so sp = P uses P times the
cores of one process; the ratio is that of a group to one process, not of equal hardware.

Reported per case: tokens per second of the group (length / median step time), peak memory
per process — CPU: peak RSS (``ru_maxrss``) and the step's part of it (peak − RSS before the
first step); CUDA: ``torch.cuda.max_memory_allocated`` — and both as ratios to one process,
measured in the same run. ``--shape 8b`` builds Llama 3 8B's shape with random weights in
bfloat16 (hidden 4096, 32 heads, 8 KV heads, MLP 14336, 32 layers, V = 128,256) directly on the
GPU; a case that runs out of memory is reported as such. sp = 8 needs 8 GPUs on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def _model(args):
    import torch

    if args.shape == "8b":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**SHAPE_8B, attn_implementation="sdpa")
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: never a float32 copy of 8B weights
        try:
            with torch.device(args.device_name):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        return model
    from ropescale.models import load_model

    model, _ = load_model(args.model, device=args.device_name, dtype=args.dtype)
    return model


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _patched_model(args):
    """The model of ``args``, patched with ``args.strategy`` (``NAME[:k=v,...]``), checkpointed, in training mode."""
    import ropescale
    from ropescale.training.loop import enable_checkpointing

    name, _, params = args.strategy.partition(":")
    kwargs = {k: float(v) if "." in v or k == "factor" else int(v)
              for k, v in (p.split("=") for p in params.split(",") if p)}
    model = _model(args)
    ropescale.patch(model, name, **kwargs)
    enable_checkpointing(model)
    model.train()
    return model


def _measure(args, step, sync, length: int) -> dict:
    """The median step over ``args.reps`` after a warm-up, and the peak memory (device, or this
    process's resident set); ``{"oom": True}`` when the device runs out of memory."""
    import torch

    out: dict = {}
    try:
        base = _rss_mb()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(args.reps + 1):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out |= {"step_s": t, "tokens_per_s": length / t}
        if args.device == "cuda":
            out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            out |= {"peak_mb": peak, "step_mb": peak - base}
    except torch.OutOfMemoryError:
        out["oom"] = True
    return out


def _gathered(out: dict, world: int) -> dict:
    """Rank 0's measurement with every process's OOM and the largest process's memory."""
    import torch

    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, out)
    out = {**gathered[0], "oom": any(g.get("oom") for g in gathered)}
    for k in ("peak_mb", "step_mb"):
        if k in gathered[0]:
            out[k] = max(g[k] for g in gathered if k in g)  # the largest process
    return out


def worker(args) -> None:
    """One case: P = the launched world size (1 without torchrun)."""
    import torch

    from ropescale.training.loop import causal_lm_loss

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        args.device_name = f"cuda:{torch.cuda.current_device()}"
    else:
        args.device_name = "cpu"
    if world > 1:
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    model = _patched_model(args)
    L = args.length
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, L), device=args.device_name)
    sp = None
    if world > 1:
        from ropescale.training.sequence_parallel import SequenceParallel

        sp = SequenceParallel(model, world, micro_batch_size=1)
        lo, hi = rank * L // world, (rank + 1) * L // world
        labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), 1)
        batch = {"input_ids": ids[:, lo:hi], "position_ids": torch.arange(lo, hi, device=ids.device)[None],
                 "shift_labels": labels[:, lo:hi]}

    def step():
        if sp is None:
            loss = causal_lm_loss(model, {"input_ids": ids})
        else:
            loss = sp.loss(model, batch) * sp.backward_scale
        loss.backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            torch.distributed.barrier()

    out = {"world": world, **_measure(args, step, sync, L)}
    if world > 1:
        out = _gathered(out, world)
        sp.close()
        torch.distributed.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))


def _launch(args, world: int, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    for k in ("model", "shape", "strategy", "length", "device", "dtype", "reps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(29600 + world)] + cmd[1:]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        if "OutOfMemory" in res.stderr or "out of memory" in res.stderr:
            return {"world": world, "oom": True}
        raise SystemExit(f"sp = {world} failed:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="reference")
    ap.add_argument("--shape", choices=["model", "8b"], default="model",
                    help="8b: Llama 3 8B's shape, random bf16 weights built on the GPU (--model ignored)")
    ap.add_argument("--strategy", default="yarn:factor=32")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sp", default="2", help="comma-separated group sizes; 1 (one process) always runs first")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process (CPU runs)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from bench.common import machine

    sizes = [1] + [int(x) for x in args.sp.split(",") if int(x) > 1]
    with tempfile.TemporaryDirectory(prefix="ropescale-sp-") as tmp:
        rows = [_launch(args, w, Path(tmp) / f"sp{w}.json") for w in sizes]
    print(f"machine: {machine()}")
    model = "Llama 3 8B shape, random bf16" if args.shape == "8b" else f"{args.model} ({args.dtype})"
    print(f"{model}, {args.strategy}, one window of {args.length} tokens, forward + backward with activation "
          f"checkpointing and the chunked loss; median of {args.reps} steps"
          + (f"; {args.threads} thread(s) per process, so sp = P uses P times the cores" if args.device == "cpu"
             else "") + "\n")
    one = rows[0]
    mem = "peak RSS per process [MiB] (step's part)" if args.device == "cpu" else "peak allocated per GPU [MiB]"
    print(f"| processes (sp) | tokens/s | × one process | {mem} | × one process |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['world']} | out of memory | | | |")
            continue
        speed = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}" if not one.get("oom") else "—"
        peak = f"{r['peak_mb']:.0f}" + (f" ({r['step_mb']:.0f})" if "step_mb" in r else "")
        key = "step_mb" if "step_mb" in r else "peak_mb"
        ratio = f"{r[key] / one[key]:.2f}" if not one.get("oom") and one[key] > 0 else "—"
        print(f"| {r['world']} | {r['tokens_per_s']:.0f} | {speed} | {peak} | {ratio} |")


if __name__ == "__main__":
    main()

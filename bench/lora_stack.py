"""The long-context LoRA step measured on a GPU, today's stack against the new one (issue 38), beside the trace.

    python bench/lora_stack.py [--device cuda] [--shape 8b] [--lengths 131072,262144,524288]
                               [--time-length 65536] [--out DIR]

Stacks (``bench/memory_estimate.py``'s names): ``baseline`` — a bf16 base, LoRA r = 8 on q, k, v, o
(``ropescale.training.lora.apply_lora``), activation checkpointing, the chunked loss, fused AdamW; and
``offload+tiled+norms+amp`` — the same with ``activation_offload``, ``tiled_mlp``, ``tiled_norms`` and the
step under bf16 autocast with the adapters on its path (``apply_lora(..., autocast=True)``), what
``ropescale finetune`` runs with ``dtype: bfloat16``, ``mixed_precision: bf16`` and those keys. Each is
built with 2 and 3 decoder layers; everything that grows with depth grows linearly (the weights, the
offloaded inputs in host memory, LoRA's states), so the shape's depth D is reached as
X(D) = X(2) + (D − 2)·(X(3) − X(2)), as ``bench/gpu_check.py`` does. Per length: the device peak
(``torch.cuda.max_memory_allocated``) at depth D, with ``--trace`` the trace's estimate at depth D
(``bench.memory_estimate.estimate``, on the CPU: minutes per length; docs/gpu.md has them), and the
step time of the new stack against today's at ``--time-length`` (at 3 layers; the ratio holds per
layer). A case that fails (out of memory, an int32 index past 2³¹ elements) is one line in the table.

On the CPU (``--device cpu --shape small --lengths 1024,2048 --time-length 1024``) it checks the
plumbing only: peaks are then the process's RSS high-water mark, not per case. Needs DeepSpeed
(``pip install "ropescale[scale]"``) for the tiled stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.memory import SHAPES, _model, train_step

GiB = 2**30
STACKS = ("baseline", "offload+tiled+norms+amp")


def build(shape: str, n: int, device: str, layers: int, stack: str):
    """The LoRA model of ``stack`` on ``device`` and its fused AdamW (``bench.memory.prepare_lora`` plus the
    stack's options)."""
    from ropescale.training.loop import enable_checkpointing
    from ropescale.training.lora import LoraSettings, apply_lora

    model, _ = _model(shape, n, device, layers)
    new = stack != "baseline"
    enable_checkpointing(model, offload=new)
    if new:
        from ropescale.training.tiling import enable_tiled_mlp, enable_tiled_norms

        enable_tiled_mlp(model)
        enable_tiled_norms(model)
    model = apply_lora(model, LoraSettings(), autocast=new)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                            fused=device == "cuda")
    return model, opt


def step(model, opt, n: int, device: str, stack: str) -> dict:
    """One optimiser step at ``n`` tokens: {peak bytes, seconds}."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=stack != "baseline"):
        train_step(model, opt, ids)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": peak, "seconds": time.perf_counter() - t0}


def measure(shape: str, n: int, device: str, stack: str) -> dict:
    """Peak and time at 2 and 3 layers, extrapolated to the shape's depth (or the error)."""
    depth = SHAPES[shape]["num_hidden_layers"]
    got = {}
    for layers in (2, 3):
        try:
            model, opt = build(shape, n, device, layers, stack)
            step(model, opt, min(n, 1024), device, stack)  # warm-up: kernels, allocator
            got[layers] = step(model, opt, n, device, stack)
        except Exception as e:  # noqa: BLE001 — an out-of-memory or overflow is a row, not the end of the run
            traceback.print_exc()
            return {"stack": stack, "length": n, "error": f"{type(e).__name__}: {e}"[:200]}
        finally:
            model = opt = None
            if device == "cuda":
                torch.cuda.empty_cache()
    peak = got[2]["peak"] + (depth - 2) * (got[3]["peak"] - got[2]["peak"])
    return {"stack": stack, "length": n, "peak_gib": peak / GiB, "peak_gib_2_3": [got[2]["peak"] / GiB,
            got[3]["peak"] / GiB], "seconds_3_layers": got[3]["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--lengths", default="131072,262144,524288")
    ap.add_argument("--time-length", type=int, default=65536)
    ap.add_argument("--out", type=Path, default=None, help="folder for lora_stack.json")
    ap.add_argument("--trace", action="store_true", help="also the trace's estimate per length (minutes on a CPU)")
    args = ap.parse_args()
    from bench.common import machine
    from bench.memory_estimate import estimate

    rows = []
    for n in (int(x) for x in args.lengths.split(",") if x):
        row = measure(args.shape, n, args.device, STACKS[1])
        if args.trace:
            row["traced_gib"] = estimate(args.shape, n, stack=STACKS[1])["peak_gib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    timing = {s: measure(args.shape, args.time_length, args.device, s) for s in STACKS}
    ratio = None
    if all("seconds_3_layers" in t for t in timing.values()):
        ratio = timing[STACKS[1]]["seconds_3_layers"] / timing[STACKS[0]]["seconds_3_layers"]
    out = {"machine": machine(), "torch": torch.__version__, "shape": args.shape, "rows": rows,
           "timing": timing, "new_over_baseline_time": ratio}
    print(json.dumps({"timing": timing, "new_over_baseline_time": ratio}))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_stack.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Peak memory of ropescale's long-context paths against an analytic floor, at Llama 3's vocabulary.

    python bench/memory.py [--lengths 8192,16384,32768] [--device cpu|cuda] [--shape small|8b] [--layers N]

A random-weight Llama with Llama 3's vocabulary (V = 128,256), head_dim 128 and grouped-query
attention — ``small`` (hidden 256, 2 query heads, 1 KV head, MLP 896, 2 layers, float32: fits a
laptop) or ``8b`` (Llama 3 8B's shape: hidden 4096, 32 heads, 8 KV heads, MLP 14336, 32 layers,
bfloat16: a GPU). Cases, each in a fresh process:

* ``ppl``: perplexity of one window of n tokens through the harness (``ropescale.runs.scoring``);
  ``ppl (before)`` is the scoring main had before the chunked head (``model(ids).logits``
  and ``cross_entropy`` over ``[n, V]``), run only where it fits;
* ``passkey``: one passkey example of n tokens (prefill, 10 candidates, greedy answer);
* ``finetune``: one optimiser step (AdamW) on one window of n tokens with activation
  checkpointing and the chunked loss (``ropescale.lm_head.causal_lm_loss``); ``finetune
  (before)`` without either (``model(labels=ids).loss``, as the training loop had);
* ``lora``: the same step as the ``lora`` recipe trains (LoRA r = 8 on q, k, v, o through PEFT,
  ``ropescale.training.lora.apply_lora``; the base weights frozen), with activation checkpointing
  (``ropescale.training.loop.enable_checkpointing``) and the chunked loss.

``--layers N`` builds the shape with N decoder layers instead (``bench/gpu_check.py`` measures 1
and 2 and extrapolates to the shape's depth).

``--model NAME`` measures a real model instead (``ropescale.load_model``: ``gemma-3-270m``, a folder), in
float32 on the CPU, with two cases: ``ppl`` as the harness runs it — sliding-window layers through
``ropescale.attention.local`` — and ``ppl (dense masks)``, the same scoring through transformers' sdpa
and the ``[n, n]`` masks it builds for sliding-window layers (bool, plus SDPA's float copy).

Memory: CPU — peak RSS of the process (glibc serves allocations over 128 KiB by mmap, so freed
tensors leave RSS at once); CUDA — ``torch.cuda.max_memory_allocated``. ``base`` is measured in the
same process just before the case (process + weights, after a 16-token warm-up). The floor is
``base`` plus what the case must hold, analytically (4 bytes per float32 element; 2 for bf16):

* ppl: the last hidden state n·d, plus the larger of one decoder layer's MLP at n — residual,
  normed input, act(gate), up, their product: n·(2d + 3f) — and one head chunk at the default
  budget (c positions × V × (logits + their float32 copy in bf16 + log-softmax));
* passkey: the ppl layer term + the KV cache 2·layers·n·n_kv·h_d + one ``[V]`` row;
* finetune: the larger of the backward — gradients (the weights' size) + the checkpointed
  layer inputs layers·n·d + the larger of one layer's activations kept for its backward during
  recompute n·(4d + 2·q + 2·kv + 3f) (q = n_h·h_d, kv = n_kv·h_d) and one head chunk with its
  gradient — and the optimiser step: gradients + AdamW's two moments (3 × the weights);
* lora: as finetune with the trainable (LoRA) parameters in place of the weights (the frozen
  weights get no gradient; AdamW's moments, of the LoRA parameters, are in ``base``).

Ratios ``peak / floor`` are printed beside, and ``before / ropescale`` for the old paths.
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

SHAPES = {
    "small": dict(vocab_size=128_256, hidden_size=256, intermediate_size=896, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=128, dtype="float32"),
    "8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, dtype="bfloat16"),
}
CASES = ("ppl", "ppl (before)", "passkey", "finetune", "finetune (before)", "lora")
MODEL_CASES = ("ppl", "ppl (dense masks)")


def _model(shape: str, length: int, device: str, layers: int | None = None):
    """The random Llama of ``shape`` (``layers`` decoder layers instead of the shape's), built in
    its dtype on ``device`` as ``from_pretrained(dtype=...)`` builds it (rotary buffers stay float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = dict(SHAPES[shape])
    dtype = getattr(torch, s.pop("dtype"))
    if layers is not None:
        s["num_hidden_layers"] = layers
    cfg = LlamaConfig(**s, max_position_embeddings=max(length, 8192), tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return model, dtype


def floor_bytes(case: str, config, n: int, dtype, weights: int, trainable: int = 0) -> int:
    """What ``case`` must hold above ``base`` at ``n`` tokens [bytes] (the module docstring's floor):
    ``weights`` the model's parameter bytes, ``trainable`` the trainable ones' (lora)."""
    import torch

    from ropescale.lm_head import DEFAULT_BUDGET, chunk_size_for

    c = config
    V, d, f, layers = c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    e = torch.finfo(dtype).bits // 8
    layer = e * n * (2 * d + 3 * f)
    head_eval = chunk_size_for(V, 1, dtype=dtype) * V * (e + (4 if e < 4 else 0) + 4)
    if case.startswith("ppl"):
        return e * n * d + max(layer, head_eval)
    if case == "passkey":
        return layer + 2 * layers * n * kv * e + V * 4
    grads = trainable if case == "lora" else weights
    chunk = chunk_size_for(V, 1, budget=DEFAULT_BUDGET, training=True, dtype=dtype)
    backward = (grads + e * layers * n * d  # gradients, checkpointed layer inputs
                + max(e * n * (4 * d + 2 * q + 2 * kv + 3 * f), chunk * V * (e + (4 if e < 4 else 0) + 8)))
    return backward if case == "lora" else max(backward, 3 * weights)  # AdamW's moments appear at step()


def prepare_lora(model):
    """``model`` as the lora recipe trains it: activation checkpointing, then LoRA (r = 8 on q, k,
    v, o) through PEFT, in training mode; returns (the PEFT model, fused AdamW over its trainable
    parameters)."""
    import torch

    from ropescale.training.loop import enable_checkpointing
    from ropescale.training.lora import LoraSettings, apply_lora

    enable_checkpointing(model)
    model = apply_lora(model, LoraSettings())
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-5, fused=True)


def train_step(model, opt, ids) -> None:
    """One optimiser step on ``ids`` ``[1, n]`` with the chunked loss, as the training loop takes it."""
    import torch

    from ropescale.lm_head import causal_lm_loss

    loss = causal_lm_loss(model, ids, attention_mask=torch.ones_like(ids))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _memory(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _full_logit_nll(model, ids):
    """What ropescale.runs.scoring did before the chunked head (main at b72f51e)."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, use_cache=False).logits  # [b, n, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")


def _real_model(name: str, case: str):
    """A real model as the harness loads it: local attention for ``ppl``, sdpa's masks for ``ppl (dense masks)``."""
    import torch

    from ropescale.attention.local import enable_local_attention
    from ropescale.models import load_model

    model, _ = load_model(name, device="cpu")
    if case == "ppl" and not enable_local_attention(model):
        raise SystemExit(f"{name}: local attention does not apply (no sliding-window layers?)")
    return model, torch.float32


def worker(case: str, shape: str, length: int, device: str, layers: int | None = None,
           model_name: str | None = None) -> dict:
    import torch

    from ropescale.lm_head import causal_lm_loss
    from ropescale.runs.scoring import score_windows
    from ropescale.runs.windows import make_windows

    model, dtype = _real_model(model_name, case) if model_name else _model(shape, length, device, layers)
    n = length
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = 0
    if case.startswith("finetune"):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # as the training loop: no temporaries
    elif case == "lora":
        model, opt = prepare_lora(model)
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=False)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _current(device)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    floor = base + floor_bytes(case, config, n, dtype, weights, trainable)
    if case in ("ppl", "ppl (dense masks)"):
        docs = [ids[0].cpu()]
        score_windows(model, docs, make_windows([n], n), length=n, device=device)
    elif case == "ppl (before)":
        with torch.no_grad():
            _full_logit_nll(model, ids)
    elif case == "passkey":
        _passkey(model, n, device)
    elif case == "lora":
        train_step(model, opt, ids)
    else:
        if case == "finetune":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            loss = causal_lm_loss(model, ids)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"peak": _memory(device), "base": base, "floor": floor}


def _passkey(model, n: int, device: str) -> None:
    """One passkey example at n tokens through the task's own measure (prompt in the bundled
    model's tokens — valid ids of any larger vocabulary)."""
    import torch

    from eval.tasks.base import get_task
    from ropescale.models import load_tokenizer
    from ropescale.strategies import get_strategy

    cls = get_task("passkey")
    task = cls(cls.Options(depths=[0.5], trials=1), tokenizer=load_tokenizer("reference"), train_length=8192)
    examples = task.examples(n)
    task.measure(model, examples, [0], length=n, strategy=get_strategy("vanilla"), device=torch.device(device),
                 desc=None)


def run_case(case: str, shape: str, length: int, device: str, limit_gb: float, layers: int | None = None,
             model_name: str | None = None) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    args = [sys.executable, __file__, "--worker", case, "--shape", shape, "--lengths", str(length),
            "--device", device, "--limit-gb", str(limit_gb)] + (["--layers", str(layers)] if layers else [])
    args += ["--model", model_name] if model_name else []
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["killed"])[-1]
        room = f"{limit_gb:g} GiB" if device == "cpu" else "the GPU"  # the cap is the CPU's only
        return {"error": (f"does not fit in {room}" if "memory" in tail.lower() or out.returncode < 0
                          else tail[:80])}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--limit-gb", type=float, default=14.0, help="CPU: address-space cap of a case's process")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--model", default=None, help="a real model (gemma-3-270m, a folder) instead of the shape; CPU")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        if args.device == "cpu":  # a case that cannot fit fails with MemoryError instead of swapping the machine
            cap = int(args.limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        print(json.dumps(worker(args.worker, args.shape, lengths[0], args.device, args.layers, args.model)))
        return

    import torch

    from bench.common import machine

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    s = SHAPES[args.shape]
    print(f"machine: {machine()}")
    if args.model:
        print(f"model: {args.model} (ropescale.load_model), float32, device cpu; batch 1; one window of n tokens")
    else:
        print(f"model: random Llama, V = {s['vocab_size']:,}, hidden {s['hidden_size']}, head_dim {s['head_dim']}, "
              f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads, MLP {s['intermediate_size']}, "
              f"{args.layers or s['num_hidden_layers']} layers, {s['dtype']}, untied head; device {args.device}; "
              "batch 1")
    print(f"memory: {'peak RSS (fresh process per case)' if args.device == 'cpu' else 'max_memory_allocated'}; "
          "floor = base (process + weights, measured) + what the case must hold (see the docstring)\n")
    print(f"{'case':<18} {'length':>6} {'base GiB':>9} {'floor GiB':>10} {'peak GiB':>9} {'peak/floor':>10} "
          f"{'before/now':>10}")
    wanted = MODEL_CASES if args.model else args.cases.split(",")
    for length in lengths:
        results = {}
        for case in MODEL_CASES if args.model else CASES:
            if case not in wanted:
                continue
            r = results[case] = run_case(case, args.shape, length, args.device, args.limit_gb, args.layers,
                                         args.model)
            if "error" in r:
                print(f"{case:<18} {length:>6} {r['error']:>40}", flush=True)
                continue
            now = results.get(case.split(" (")[0])
            ratio = f"{r['peak'] / now['peak']:>10.2f}" if " (" in case and now and "peak" in now else f"{'':>10}"
            print(f"{case:<18} {length:>6} {r['base'] / 2**30:>9.2f} {r['floor'] / 2**30:>10.2f} "
                  f"{r['peak'] / 2**30:>9.2f} {r['peak'] / r['floor']:>10.2f} {ratio}", flush=True)


if __name__ == "__main__":
    main()

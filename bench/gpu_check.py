"""ropescale's CUDA paths checked on one GPU, in one process, within a time budget (issue 31).

    python bench/gpu_check.py --out DIR [--budget-s 420] [--device cuda|cpu] [--shape 8b|small]
                              [--lengths 32768,65536,131072] [--cost-lengths 8192,131072,32768,65536,16384]
                              [--oracle-length 4096] [--sections a,b,c,d,e]

On the device (from the repo root; ``bench/gpu_check.sh`` is this, with ``nvidia-smi`` and the
versions printed first)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out $OUT --budget-s 420

On the CPU, for the plumbing only (eager FlexAttention, no CUDA memory statistics)::

    python bench/gpu_check.py --out /tmp/gc --device cpu --shape small --lengths 256,512 --oracle-length 256

Model: a random-weight Llama of ``bench/memory.py``'s ``--shape`` (``8b``: hidden 4096, 32 heads /
8 KV heads, head_dim 128, MLP 14336, V = 128,256, bfloat16, untied head) built with as few
decoder layers as each measurement needs, L_train = 8192 for the rules. Sections, in priority
order; every case catches its own exception (one line in the tables, the traceback in
``gpu_check.log``) and runs only while the budget lasts:

a. ``oracle``: each relative-position rule (rerope, leaky_rerope, self_extend, string, dca) through
   ``flex_attention_path`` — compiled FlexAttention on CUDA — against the naive n × n oracle
   (``naive_attention``: explicit relative positions, float32 arithmetic; run in query blocks so
   4k tokens fit) at
   ``--oracle-length`` tokens, head_dim 128, 4 query / 2 KV heads, float32 inputs: outputs and
   the gradients of q, k, v, max |error| relative to the oracle's max |value|.
b. ``memory``: perplexity of one window (``ppl``), one passkey example (``passkey``: prefill,
   candidates, greedy answer) and one LoRA + activation-checkpointing optimiser step (``lora``)
   at ``--lengths``, vanilla RoPE with SDPA, the model built with 2 and with 3 decoder layers.
   Peak = ``torch.cuda.max_memory_allocated`` in this process, ``base`` = the allocation just
   before the case (weights, …); the floor is ``bench/memory.py``'s (``floor_bytes``). Every
   term that grows with depth grows linearly — the weights, the KV cache (passkey), the
   checkpointed layer inputs (lora), LoRA's parameters and moments — and everything else (one
   layer's activations, one LM-head chunk) is held once, so the shape's depth D is reached as
   X(D) = X(2) + (D − 2)·(X(3) − X(2)) for peak and base (the first layer carries one-time allocations);
   the floor is recomputed at depth D. If time is left, the longest length is also run with 4 layers and
   compared with X(2) + 2·(X(3) − X(2)).
c. ``verdicts``: the harness's memory estimate (``Task.memory``: perplexity, passkey) at depth D
   against what was measured: the estimate is meant to be a lower bound of the measured Δ = peak
   − base; ``check_fits`` is called on the device with the missing layers' bytes held in a
   ballast tensor, and its verdict compared with whether the extrapolated peak fits the memory
   free when this process started. 1M tokens is added, where the estimate must refuse.
d. ``cost``: the base transformer (1 decoder layer; no LM head) per rule through the default
   path (FlexAttention on CUDA) against vanilla RoPE with SDPA, at ``--cost-lengths``: forward
   (no grad) and forward + backward (of the hidden states' sum) time — best of a few runs after
   an untimed warm-up that compiles — and peak memory above the pre-run allocation, as ratios to
   vanilla at the same length; block-mask builds and dynamo compilations in a steady-state
   forward; every variant's runs follow each other (a GPU's speed does not drift like a shared
   CPU's). The SDPA kernel vanilla ran (torch's profiler) is recorded, and ``flex (1 region)`` —
   plain RoPE through the rules' path as one FlexAttention call (ReRoPE with a window past every
   distance) — separates FlexAttention's own cost from the rules'.
e. ``oracle+``: section a in bfloat16 (what the model runs), then a batch of two with left
   padding (a key mask), a KV-cache split (1024 queries on 4096 keys), one decoding step
   (eager route), a sliding window and soft-capping, for rerope and dca.

Compilation is watched: dynamo's ``fail_on_recompile_limit_hit`` is set, so a function past
``recompile_limit`` fails its case instead of silently running the eager, unfused kernel
(the limit is raised to 32 for this process, which runs more dtypes and variants than one run of
the harness; the number of cache entries per function is reported against torch's default 8), and
every call of FlexAttention's dense reference (``math_attention``) on CUDA above
``flex_regions.EAGER_SCORES`` scores is counted as an eager fall-back.

Writes ``gpu_check.json`` (every figure), ``gpu_check.md`` (the tables, for ``docs/gpu.md``) and
``gpu_check.log`` (per-case errors with tracebacks, compile counts) into ``--out`` after every
case, so a kill keeps what was done; prints a short summary at the end.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch._dynamo

from bench.common import sync, timed_step
from bench.memory import SHAPES, _model, _passkey, floor_bytes, prepare_lora, train_step

RULES = ("rerope", "leaky_rerope", "self_extend", "string", "dca")
TRAIN = 8192  # L_train of the 8B shape (Llama 3)
ORACLE_PARAMS = {  # every region has pairs at 4k tokens (dca: chunks of 1280, so 4 of them)
    "rerope": {"window": 512}, "leaky_rerope": {"window": 512, "k": 16.0},
    "self_extend": {"window": 512, "group_size": 8}, "string": {},  # T = 8192: S = 2703, W = 128
    "dca": {"chunk_size": 1536, "local_window": 256},
}
COST_PARAMS = {  # as bench/truncation_cost.py at T = 128 (window T/2, group 8), scaled to T = 8192
    "rerope": {"window": 4096}, "leaky_rerope": {"window": 4096, "k": 16.0},
    "self_extend": {"window": 4096, "group_size": 8}, "string": {},  # the authors' defaults: S = 2703, W = 128
    "dca": {},  # ChunkLlama's defaults: chunk_size 6144, local_window 1024 (chunks of 5120)
}
FLEX_ONE = "flex (1 region)"  # FlexAttention's own cost: plain RoPE through the rules' path, one region
MEMORY_CASES = ("ppl", "passkey", "lora")
REFUSE_LENGTH = 1 << 20  # tokens: the estimate must refuse it on an 80 GB GPU
GiB, MiB = 2**30, 2**20


class CaseTimeout(Exception):
    """A case ran past its share of the budget."""


class Check:
    """The run's state: the budget, the results (written after every case) and the counters."""

    def __init__(self, out: Path, budget_s: float, device: str):
        self.out, self.device = out, device
        self.start, self.deadline = time.monotonic(), time.monotonic() + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")
        self.data: dict = {"sections": {}, "notes": []}
        self.mask_builds = 0
        self.eager_flex = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        with self.log_path.open("a") as f:
            f.write(f"[{time.monotonic() - self.start:7.1f} s] {text}\n")

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log(text)

    def rows(self, section: str) -> list:
        return self.data["sections"].setdefault(section, [])

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_check.json")
        (self.out / "gpu_check.md").write_text(render(self.data))

    def case(self, section: str, name: str, fn, *, cap_s: float, need_s: float = 5.0, **row) -> dict | None:
        """Run ``fn()`` → dict of figures as one row of ``section`` (with ``row``'s identity), within
        ``cap_s`` seconds and the budget; an exception or a timeout becomes the row's ``error``."""
        entry = {**row}
        left = self.left()
        if left < need_s:
            entry["error"] = f"skipped: {left:.0f} s of budget left"
            self.rows(section).append(entry)
            self.save()
            return None
        limit = max(1.0, min(cap_s, left))
        graphs0, builds0, eager0 = compiles(), self.mask_builds, self.eager_flex
        t0 = time.monotonic()
        old = signal.signal(signal.SIGALRM, _alarm) if hasattr(signal, "SIGALRM") else None
        if old is not None:
            signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            entry.update(fn() or {})
        except BaseException as e:  # every failure is a finding (CaseTimeout too); KeyboardInterrupt stops
            if isinstance(e, KeyboardInterrupt):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:160]
            entry["error"] = f"{type(e).__name__}: {first}" if not isinstance(e, CaseTimeout) else \
                f"timeout after {limit:.0f} s"
            self.log(f"{section} {name}: {entry['error']}\n{traceback.format_exc()}")
        finally:
            if old is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
        entry["case_s"] = round(time.monotonic() - t0, 2)
        entry["compiles"] = compiles() - graphs0
        entry["mask_builds"] = self.mask_builds - builds0
        entry["eager_flex_calls"] = self.eager_flex - eager0
        self.rows(section).append(entry)
        self.log(f"{section} {name}: {json.dumps(entry, default=str)}")
        self.save()
        release()
        return entry


def _alarm(signum, frame):
    raise CaseTimeout()


def compiles() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cache_entries() -> dict:
    """Dynamo's cache entries per compiled function (torch's recompile_limit bounds each)."""
    from torch.nn.attention import flex_attention as F

    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return {}
    out = {}
    for fn in (F.flex_attention, F.create_block_mask):
        try:
            out[fn.__name__] = len(_debug_get_cache_entry_list(fn.__code__))
        except Exception as e:  # noqa: BLE001 - a debugging API: report, do not fail
            out[fn.__name__] = f"unknown ({type(e).__name__})"
    return out


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()




def allocated(device: str) -> int:
    if device == "cuda":
        return torch.cuda.memory_allocated()
    from bench.memory import _current

    return _current(device)


def reset_peak(device: str) -> int:
    """Start a peak measurement: returns the current allocation [bytes]."""
    release()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return allocated(device)


def peak(device: str) -> int:
    sync(device)
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    from bench.memory import _memory

    return _memory(device)


def instrument(check: Check) -> None:
    """Count block-mask builds (``flex_regions._mask_builder``'s functions and chunk rules' block-list
    structures, ``_chunk_structure``) and eager FlexAttention
    on CUDA (its dense reference ``math_attention`` on real tensors above ``EAGER_SCORES``)."""
    from ropescale.attention import flex as flex_regions

    real_builder = flex_regions._mask_builder

    def builder(device, scores=None):
        fn = real_builder(device, scores)

        def counted(*a, **kw):
            check.mask_builds += 1
            return fn(*a, **kw)
        return counted

    flex_regions._mask_builder = builder
    real_structure = flex_regions._chunk_structure  # DCA's offset-free block lists: one build per shape

    def structure(*a, **kw):
        check.mask_builds += 1
        return real_structure(*a, **kw)

    flex_regions._chunk_structure = structure
    try:  # the module, not the operator of the same name that torch._higher_order_ops exports
        hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:
        check.data["notes"].append("eager FlexAttention not watched: torch._higher_order_ops.flex_attention missing")
        return
    real_math = getattr(hop, "math_attention", None)
    if real_math is None:
        check.data["notes"].append("eager FlexAttention not watched: no math_attention in this torch")
        return

    def counting(query, key, *a, **kw):
        if (type(query) is torch.Tensor and query.device.type == "cuda"  # b·n_h·s_q·s_k, whatever the layout
                and query.numel() // query.shape[-1] * key.shape[-2] > flex_regions.EAGER_SCORES):
            check.eager_flex += 1
        return real_math(query, key, *a, **kw)

    hop.math_attention = counting


def rule_of(name: str, params: dict):
    from ropescale.strategies import get_strategy

    strat = get_strategy(name)
    return strat.compute({"original_max_position_embeddings": TRAIN}, strat.validate(params))


def inv_freq(head_dim: int, theta: float = 500000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


# ---------------------------------------------------------------------------------------- a, e: oracle


def oracle(q, k, v, q_pos, k_pos, rule, inv, scaling, grad, *, keep=None, block: int = 128, **kw):
    """``naive_attention`` (float32 arithmetic, whatever the inputs) over query blocks of ``block``
    rows, each against the keys up to its last row's slot, with the gradients of q, k, v for the
    output gradient ``grad``: (out, dq, dk, dv). Query row t is key slot s_k − s_q + t, as in every
    path."""
    from ropescale.attention.relative import naive_attention

    q, k, v, grad = (x.detach().float() for x in (q, k, v, grad))
    s_q, s_k = q.shape[2], k.shape[2]
    c0 = s_k - s_q
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for t0 in range(0, s_q, block):
        t1, end = min(t0 + block, s_q), c0 + min(t0 + block, s_q)  # keys [0, end)
        qb = q[:, :, t0:t1].clone().requires_grad_()
        kb, vb = k[:, :, :end].clone().requires_grad_(), v[:, :, :end].clone().requires_grad_()
        kp = None if keep is None else keep[..., -(t1 - t0):, :end] if keep.shape[-2] != 1 else keep[..., :end]
        o = naive_attention(qb, kb, vb, q_pos[:, t0:t1], k_pos[:, :end], rule, inv, scaling,
                            keep=kp, **kw)
        gq, gk, gv = torch.autograd.grad(o, (qb, kb, vb), grad[:, :, t0:t1])
        out[:, :, t0:t1] = o.detach()
        dq[:, :, t0:t1] = gq
        dk[:, :, :end] += gk
        dv[:, :, :end] += gv
    return out, dq, dk, dv


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (NaN when got has a non-finite entry)."""
    got = got.detach()
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def oracle_case(name: str, params: dict, dtype, device: str, *, b: int = 1, n_h: int = 4, n_kv: int = 2,
                s_q: int, s_k: int, head_dim: int, pad: int = 0, tol: float, **kw) -> dict:
    """One comparison of ``flex_attention_path`` (with its gradients) against ``oracle``."""
    from ropescale.attention.flex import flex_attention_path

    rule = rule_of(name, params)
    g = torch.Generator(device="cpu").manual_seed(0)
    # values exactly representable in bfloat16, so every dtype sees the same inputs as the oracle
    q, k, v = (torch.randn(b, h, s, head_dim, generator=g).to(torch.bfloat16).to(device)
               for h, s in ((n_h, s_q), (n_kv, s_k), (n_kv, s_k)))
    grad = torch.randn(b, n_h, s_q, head_dim, generator=g).to(torch.bfloat16).to(device)
    k_pos = torch.arange(s_k, dtype=torch.float32, device=device)[None].repeat(b, 1)  # [b, s_k]
    keep = None
    if pad:  # the last row left-padded: its positions start after the pad
        k_pos[-1] -= pad
        keep = torch.ones(b, 1, 1, s_k, dtype=torch.bool, device=device)
        keep[-1, ..., :pad] = False
    q_pos = k_pos[:, s_k - s_q:]
    inv = inv_freq(head_dim).to(device)
    scaling, scale = rule.attention_factor, head_dim ** -0.5
    want = oracle(q, k, v, q_pos, k_pos, rule, inv, scaling, grad, keep=keep, scale=scale, **kw)
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    sync(device)
    t0 = time.monotonic()
    out = flex_attention_path(*x, q_pos, k_pos, rule, inv.float(), scaling, keep=keep, scale=scale, **kw)
    got = (out, *torch.autograd.grad(out, x, grad.to(dtype)))
    sync(device)
    errs = {key: rel_err(a, w) for key, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}
    return {**{f"err_{k}": v for k, v in errs.items()}, "tol": tol, "first_call_s": round(time.monotonic() - t0, 2),
            "pass": all(e <= tol for e in errs.values())}


def section_oracle(check: Check, args, dtype, label: str) -> None:
    s, hd = args.oracle_length, SHAPES[args.shape]["head_dim"]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    failures: list[str] = []
    for name in RULES:
        row = dict(rule=name, dtype=str(dtype).replace("torch.", ""), length=s)
        if len(failures) >= 2 and failures[-1][:60] == failures[-2][:60]:  # a compile failing again costs minutes
            check.rows(label).append({**row, "error": f"skipped: as the two before ({failures[-1][:60]})"})
            continue
        r = check.case(label, name, lambda name=name: oracle_case(name, ORACLE_PARAMS[name], dtype, args.device,
                                                                   s_q=s, s_k=s, head_dim=hd, tol=tol),
                       cap_s=150, need_s=20, **row)
        if r is not None and "error" in r:
            failures.append(r["error"])


def section_oracle_extra(check: Check, args) -> None:
    s, hd = args.oracle_length, SHAPES[args.shape]["head_dim"]
    variants = {
        "padded batch": dict(b=2, pad=s // 16, s_q=s, s_k=s),
        "kv-cache split": dict(s_q=s // 4, s_k=s),
        "decoding step": dict(s_q=1, s_k=s),
        "sliding window": dict(s_q=s, s_k=s, sliding_window=s // 4),
        "soft-capping": dict(s_q=s, s_k=s, softcap=20.0),
    }
    for variant, kw in variants.items():
        for name in ("rerope", "dca"):
            if name == "dca" and "sliding_window" in kw:
                continue  # DCA under a sliding window takes the blocked path, not FlexAttention
            check.case("oracle+", f"{variant} {name}",
                       lambda name=name, kw=kw: oracle_case(name, ORACLE_PARAMS[name], torch.bfloat16, args.device,
                                                            head_dim=hd, tol=3e-2, **kw),
                       cap_s=120, need_s=20, variant=variant, rule=name, dtype="bfloat16")


# ---------------------------------------------------------------------------------------- b, c: memory


def memory_run(case: str, model, n: int, device: str, opt=None) -> dict:
    from ropescale.runs.scoring import score_windows
    from ropescale.runs.windows import make_windows

    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    base = reset_peak(device)
    if case == "ppl":
        score_windows(model, [ids[0].cpu()], make_windows([n], n), length=n, device=device)
    elif case == "passkey":
        _passkey(model, n, device)
    else:
        train_step(model, opt, ids)
    return {"base": base, "peak": peak(device),
            "reserved": torch.cuda.max_memory_reserved() if device == "cuda" else None}


def _lora(model):
    """``bench.memory.prepare_lora`` (the lora recipe's defaults through ``ropescale.training``);
    where pydantic is missing (ropescale's training config needs it), the same through PEFT and
    transformers directly: (model, optimiser, how)."""
    try:
        return (*prepare_lora(model), "ropescale.training.lora.apply_lora (the lora recipe)")
    except ModuleNotFoundError as e:
        if "pydantic" not in str(e):
            raise
    from peft import LoraConfig, get_peft_model

    kwargs = {"use_reentrant": False}  # as ropescale.training.loop.enable_checkpointing
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16.0, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    return model, opt, "peft.get_peft_model directly (no pydantic: the recipe's defaults r 8, alpha 16, q k v o)"


MEM_DEPTHS = (2, 3)  # the slope is taken between these depths; one more checks it


def section_memory(check: Check, args) -> None:
    """2 and 3 layers (then 4 at the longest length, time permitting) × cases × lengths: the first layer
    carries one-time allocations (measured on an H100: +1.4 GiB from 1 to 2 layers for a perplexity window
    at 128k, +0.4 GiB — the weights — from 2 to 3), so the slope is taken past it."""
    depth = SHAPES[args.shape]["num_hidden_layers"]
    dtype = getattr(torch, SHAPES[args.shape]["dtype"])
    lengths = args.lengths
    for layers in (*MEM_DEPTHS, MEM_DEPTHS[1] + 1):
        todo = lengths if layers in MEM_DEPTHS else lengths[-1:]
        if layers not in MEM_DEPTHS and check.left() < 240:  # leave the cost section (d) its time
            check.data["notes"].append("memory: no linearity check at a third depth (budget)")
            break
        holder: dict = {}

        def build(layers=layers, holder=holder):
            model, _ = _model(args.shape, max(lengths), args.device, layers)
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=args.device), use_cache=False)
            holder["model"] = model
            holder["weights"] = sum(p.numel() * p.element_size() for p in model.parameters())
            return {"weights": holder["weights"], "attn_implementation": model.config._attn_implementation}

        if check.case("memory build", f"{layers} layers", build, cap_s=120, need_s=30, layers=layers) is None \
                or "model" not in holder:
            continue
        for case in MEMORY_CASES:
            if case == "lora":
                try:
                    holder["model"], holder["opt"], how = _lora(holder["model"])
                    check.data.setdefault("lora", how)
                except Exception as e:  # noqa: BLE001
                    check.log(f"memory lora wrap ({layers} layers): {e}\n{traceback.format_exc()}")
                    check.rows("memory").append({"case": case, "layers": layers, "error": f"LoRA wrap: {e}"[:160]})
                    continue
                holder["trainable"] = sum(p.numel() * p.element_size() for p in holder["model"].parameters()
                                          if p.requires_grad)
            for n in todo:
                def run(case=case, n=n, holder=holder):
                    r = memory_run(case, holder["model"], n, args.device, holder.get("opt"))
                    cfg = holder["model"].config
                    r["floor"] = r["base"] + floor_bytes(case, cfg, n, dtype, holder["weights"],
                                                         holder.get("trainable", 0))
                    r["trainable"] = holder.get("trainable", 0)
                    return r
                check.case("memory", f"{case} {n} × {layers}", run, cap_s=90, need_s=10,
                           case=case, length=n, layers=layers)
        holder.clear()
        release()
        extrapolate(check, depth, dtype)  # after every depth: a kill keeps the table


def extrapolate(check: Check, depth: int, dtype) -> None:
    """X(D) = X(a) + (D − a)·(X(b) − X(a))/(b − a) for base, peak (and reserved), (a, b) = ``MEM_DEPTHS``;
    the floor at depth D."""
    a, b = MEM_DEPTHS
    rows = {(r["case"], r["length"], r["layers"]): r for r in check.rows("memory") if "peak" in r}
    cfg = _config(check, depth)
    out = check.data["sections"]["memory at depth"] = []
    for (case, n, layers), one in sorted(rows.items()):
        two = rows.get((case, n, b))
        if layers != a or two is None:
            continue
        e = {"case": case, "length": n, "depth": depth}
        for key in ("base", "peak", "reserved"):
            if one.get(key) is not None and two.get(key) is not None:
                e[f"{key}_per_layer"] = (two[key] - one[key]) / (b - a)
                e[key] = one[key] + (depth - a) * e[f"{key}_per_layer"]
        weights = _weights_at(check, depth)
        trainable = one["trainable"] + (depth - a) * (two["trainable"] - one["trainable"]) / (b - a)
        e["floor"] = e["base"] + floor_bytes(case, cfg, n, dtype, weights, trainable)
        e["peak/floor"] = e["peak"] / e["floor"]
        three = rows.get((case, n, b + 1))
        if three is not None:
            e["check-depth error MiB"] = (three["peak"] - (one["peak"] + (b + 1 - a) * e["peak_per_layer"])) / MiB
        out.append(e)
    check.save()


def _config(check: Check, depth: int):
    from transformers import LlamaConfig

    s = {k: v for k, v in SHAPES[check.data["config"]["shape"]].items() if k != "dtype"}
    s["num_hidden_layers"] = depth
    cfg = LlamaConfig(**s, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg._attn_implementation = "sdpa"
    return cfg


def _weights_at(check: Check, depth: int) -> int:
    a, b = MEM_DEPTHS
    w = {r["layers"]: r["weights"] for r in check.rows("memory build") if "weights" in r}
    return w[a] + (depth - a) * (w[b] - w[a]) // (b - a) if a in w and b in w else 0


def section_verdicts(check: Check, args) -> None:
    """The harness's estimate at depth D against the measured Δ and fit; check_fits on the device."""
    from types import SimpleNamespace

    from eval.tasks.base import get_task
    from ropescale.runs.memory import InsufficientMemoryError, check_fits

    depth = SHAPES[args.shape]["num_hidden_layers"]
    dtype = getattr(torch, SHAPES[args.shape]["dtype"])
    standin = SimpleNamespace(config=_config(check, depth), dtype=dtype)
    measured = {(r["case"], r["length"]): r for r in check.data["sections"].get("memory at depth", [])}
    free0 = check.data.get("free_at_start")
    tasks = {"ppl": get_task("perplexity")(get_task("perplexity").Options(), tokenizer=None, train_length=TRAIN,
                                           documents=[]),
             "passkey": get_task("passkey")(get_task("passkey").Options(depths=[0.5], trials=1), tokenizer=None,
                                            train_length=TRAIN)}
    for n in [*args.lengths, REFUSE_LENGTH]:
        for case in ("ppl", "passkey", "lora"):
            def verdict(case=case, n=n):
                m = measured.get((case, n))
                r: dict = {}
                if m is not None:
                    r["measured_delta"] = m["peak"] - m["base"]
                    r["measured_peak"] = m["peak"]
                    r["actual_fits"] = None if free0 is None else m["peak"] <= free0
                if case == "lora":
                    r["estimate"] = None  # ropescale has no fine-tuning estimate
                    return r
                need = tasks[case].memory(n, standin)
                r["estimate"] = sum(need.device.values())
                r["estimate_parts"] = need.device
                if m is not None:
                    r["lower_bound_holds"] = r["estimate"] <= r["measured_delta"]
                if args.device != "cuda":
                    return r
                weights = _weights_at(check, depth)
                ballast_bytes = int(max(0, (m["base"] if m else weights) - torch.cuda.memory_allocated()))
                ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")  # the 32-layer model's bytes
                try:
                    check_fits(need, "cuda")
                    r["check_fits"] = "fits"
                except InsufficientMemoryError as e:
                    r["check_fits"] = "refused"
                    r["check_fits_message"] = str(e)
                finally:
                    del ballast
                if r.get("actual_fits") is not None:
                    r["agree"] = (r["check_fits"] == "fits") == r["actual_fits"]
                elif n == REFUSE_LENGTH:
                    r["agree"] = r["check_fits"] == "refused"
                return r
            check.case("verdicts", f"{case} {n}", verdict, cap_s=30, need_s=2, case=case, length=n)


# ---------------------------------------------------------------------------------------- d: cost


def cost_run(check: Check, model, variant: str, n: int, device: str, backward: bool, repeats: int) -> dict:
    """Warm-up (compiles), then ``repeats`` timed runs; peak memory above the pre-run allocation
    over the timed runs; block-mask builds and compilations in one steady-state forward."""
    import ropescale

    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    model.requires_grad_(backward)
    # the default path (FlexAttention on CUDA); on the CPU "flex" too, so the plumbing runs it (its
    # backward hands over to the CPU kernels there)
    path = {} if device == "cuda" else {"attention_path": "flex"}
    if variant == FLEX_ONE:  # ReRoPE with a window past every distance: plain RoPE, one FlexAttention call
        patch = ropescale.patch(model, "rerope", original_max_position_embeddings=TRAIN, window=n + 1, **path)
    else:
        patch = (ropescale.patch(model, variant, original_max_position_embeddings=TRAIN, **COST_PARAMS[variant],
                                 **path) if variant != "vanilla" else None)
    try:
        g0, b0 = compiles(), check.mask_builds
        timed_step(model, ids, backward)  # warm-up: compiles, builds the masks
        r = {"warmup_compiles": compiles() - g0, "warmup_mask_builds": check.mask_builds - b0}
        before = reset_peak(device)
        g0, b0 = compiles(), check.mask_builds
        r["seconds"] = timed_step(model, ids, backward)
        r["steady_compiles"], r["steady_mask_builds"] = compiles() - g0, check.mask_builds - b0
        for _ in range(repeats - 1):
            r["seconds"] = min(r["seconds"], timed_step(model, ids, backward))
        r["memory"] = peak(device) - before
        if variant == "vanilla":
            r["sdpa_kernel"] = sdpa_kernels(model, ids)
        return r
    finally:
        if patch is not None:
            patch.unpatch()
        model.requires_grad_(False)


def sdpa_kernels(model, ids) -> str:
    """The SDPA kernels one no-grad forward of ``model`` ran (the aten ops the dispatcher picked: flash,
    efficient, cuDNN or math), from torch's profiler."""
    from torch.profiler import profile

    with torch.no_grad(), profile() as prof:
        model.model(input_ids=ids, use_cache=False)
    names = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention" in e.key.lower()}
    picked = sorted(n for n in names if n.startswith("aten::_"))
    return ", ".join(picked) or ", ".join(sorted(names)) or "none seen"


def section_cost(check: Check, args) -> None:
    model = None

    def build():
        nonlocal model
        model, _ = _model(args.shape, max(args.cost_lengths), args.device, 1)
        return {"attn_implementation": model.config._attn_implementation}

    if check.case("cost build", "1 layer", build, cap_s=120, need_s=30) is None or model is None:
        return
    for n in args.cost_lengths:
        repeats = 3 if n <= 32768 else 2
        for backward in (False, True):
            for variant in ("vanilla", FLEX_ONE, *RULES):
                check.case("cost", f"{n} {variant} {'fwd+bwd' if backward else 'fwd'}",
                           lambda variant=variant, backward=backward, n=n, repeats=repeats: cost_run(
                               check, model, variant, n, args.device, backward, repeats),
                           cap_s=150, need_s=10, length=n, variant=variant, mode="fwd+bwd" if backward else "fwd")
    model = None
    release()


# ---------------------------------------------------------------------------------------- report


def _g(x) -> str:
    return "" if x is None else f"{x / GiB:.2f}"


def _e(x) -> str:
    return "" if x is None else "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.1e}"


def _errs(r: dict) -> str:
    return " | ".join(_e(r.get(f"err_{k}")) for k in ("out", "dq", "dk", "dv"))


def _err(r: dict) -> str:
    return r.get("error", "")


def _render_oracle(rows: list, label: str) -> list[str]:
    lines = [f"### {label}: flex_attention_path against the naive oracle at {rows[0].get('length')} "
             "tokens (max |error| / max |oracle|)", "",
             "| rule | dtype | out | dq | dk | dv | tol | pass | first call s | compiles | eager flex "
             "| error |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.get('rule')} | {r.get('dtype')} | {_errs(r)} | {_e(r.get('tol'))} | "
                     f"{r.get('pass', '')} | {r.get('first_call_s', '')} | {r.get('compiles', '')} | "
                     f"{r.get('eager_flex_calls', '')} | {_err(r)} |")
    return [*lines, ""]


def _render_oracle_plus(rows: list) -> list[str]:
    lines = ["### oracle+: more shapes, bfloat16", "",
             "| variant | rule | out | dq | dk | dv | pass | compiles | eager flex | error |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.get('variant')} | {r.get('rule')} | {_errs(r)} | {r.get('pass', '')} | "
                     f"{r.get('compiles', '')} | {r.get('eager_flex_calls', '')} | {_err(r)} |")
    return [*lines, ""]


def _render_memory(rows: list) -> list[str]:
    lines = ["### memory: measured (peak = max_memory_allocated; GiB)", "",
             "| case | length | layers | base | floor | peak | peak/floor | reserved | s | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{r['peak'] / r['floor']:.2f}" if "peak" in r and r.get("floor") else ""
        lines.append(f"| {r.get('case')} | {r.get('length')} | {r.get('layers')} | {_g(r.get('base'))} | "
                     f"{_g(r.get('floor'))} | {_g(r.get('peak'))} | {ratio} | {_g(r.get('reserved'))} | "
                     f"{r.get('case_s', '')} | {_err(r)} |")
    return [*lines, ""]


def _render_memory_at_depth(rows: list) -> list[str]:
    depth = rows[0]["depth"]
    lines = [f"### memory at {depth} layers: X({depth}) = X(2) + {depth - 2}·(X(3) − X(2)) (GiB)", "",
             "| case | length | base | floor | peak | peak/floor | per layer MiB | reserved | 4-layer check MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        three = r.get("check-depth error MiB")
        lines.append(f"| {r['case']} | {r['length']} | {_g(r.get('base'))} | {_g(r.get('floor'))} | "
                     f"{_g(r.get('peak'))} | {r['peak/floor']:.2f} | {r.get('peak_per_layer', 0) / MiB:.0f} | "
                     f"{_g(r.get('reserved'))} | {'' if three is None else f'{three:+.0f}'} |")
    return [*lines, ""]


def _render_verdicts(rows: list) -> list[str]:
    lines = ["### verdicts: the harness's estimate (Task.memory) at the shape's depth against what was measured",
             "", "| case | length | estimate GiB | measured Δ GiB | estimate ≤ Δ | check_fits | peak fits | "
             "agree | error |", "|---|---:|---:|---:|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('case')} | {r.get('length')} | {_g(r.get('estimate'))} | "
                     f"{_g(r.get('measured_delta'))} | {r.get('lower_bound_holds', '')} | "
                     f"{r.get('check_fits', '')} | {r.get('actual_fits', '')} | {r.get('agree', '')} | {_err(r)} |")
    return [*lines, ""]


def _render_cost(rows: list) -> list[str]:
    lines = ["### cost: base transformer (1 layer), each rule through the default path against vanilla SDPA", "",
             "| length | variant | mode | seconds | time × | MiB | memory × | warm-up compiles | mask builds "
             "(warm-up / steady) | steady compiles | eager flex | error |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    base = {(r["length"], r["mode"]): r for r in rows if r["variant"] == "vanilla" and "memory" in r}
    kernels: set[str] = set()
    for r in rows:
        b = base.get((r["length"], r["mode"]))
        t = f"{r['seconds']:.3f}" if "memory" in r else ""
        tx = f"{r['seconds'] / b['seconds']:.2f}" if b and "memory" in r else ""
        mx = f"{r['memory'] / max(b['memory'], 1):.2f}" if b and "memory" in r else ""
        mib = f"{r['memory'] / MiB:.0f}" if "memory" in r else ""
        if r.get("sdpa_kernel"):
            kernels.add(r["sdpa_kernel"])
        lines.append(f"| {r['length']} | {r['variant']} | {r['mode']} | {t} | {tx} | {mib} | {mx} | "
                     f"{r.get('warmup_compiles', '')} | {r.get('warmup_mask_builds', '')} / "
                     f"{r.get('steady_mask_builds', '')} | {r.get('steady_compiles', '')} | "
                     f"{r.get('eager_flex_calls', '')} | {_err(r)} |")
    return [*lines, "", f"vanilla's SDPA kernels: {'; '.join(sorted(kernels)) or 'not recorded'}; "
            f"`{FLEX_ONE}`: plain RoPE as one FlexAttention call (ReRoPE, window past every distance), so a "
            "rule's time × over it is the rule's own cost and its time × is FlexAttention's", ""]


def render(data: dict) -> str:
    """The tables as Markdown (what docs/gpu.md takes): one per section measured, in this order."""
    S = data["sections"]
    lines = [f"machine: {data.get('machine', '?')}", "", f"versions: {data.get('versions', '?')}", "",
             f"config: {json.dumps(data.get('config', {}))}", ""]
    if data.get("free_at_start") is not None:
        lines += [f"device memory free at start: {data['free_at_start'] / GiB:.2f} GiB "
                  f"(total {data.get('total_memory', 0) / GiB:.2f} GiB)", ""]
    for label in ("oracle", "oracle bf16"):
        if label in S:
            lines += _render_oracle(S[label], label)
    if "oracle+" in S:
        lines += _render_oracle_plus(S["oracle+"])
    if "memory" in S:
        lines += _render_memory(S["memory"])
    if S.get("memory at depth"):
        lines += _render_memory_at_depth(S["memory at depth"])
    if "verdicts" in S:
        lines += _render_verdicts(S["verdicts"])
    if "cost" in S:
        lines += _render_cost(S["cost"])
    if data.get("cache_entries"):
        lines += [f"dynamo cache entries per function at the end: {json.dumps(data['cache_entries'])} "
                  "(torch's default recompile_limit: 8)", ""]
    for note in data.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _skipped(rows: list) -> int:
    return sum(1 for r in rows if r.get("error", "").startswith("skipped"))


def summary(data: dict) -> str:
    """A few lines for stdout (the device returns only its tail)."""
    S = data["sections"]
    out = [f"elapsed {data.get('elapsed_s')} s; machine {data.get('machine', '?')[:120]}"]
    for label in ("oracle", "oracle bf16", "oracle+"):
        rows = S.get(label, [])
        if rows:
            ok = sum(1 for r in rows if r.get("pass"))
            worst = max((max(r.get(k, 0) for k in ("err_out", "err_dq", "err_dk", "err_dv")) for r in rows
                         if "err_out" in r), default=None)
            errs = [f"{r.get('rule')}{' ' + r['variant'] if 'variant' in r else ''}: {r['error'][:60]}"
                    for r in rows if "error" in r and not r["error"].startswith("skipped")]
            out.append(f"{label}: {ok}/{len(rows)} pass, worst rel err {_e(worst)}, {_skipped(rows)} skipped; "
                       + "; ".join(errs)[:400])
    for r in S.get("memory at depth", []):
        out.append(f"memory {r['case']:<8} {r['length']:>7} @ {r['depth']} layers: peak {_g(r['peak'])} GiB, "
                   f"floor {_g(r['floor'])} GiB, ×{r['peak/floor']:.2f}")
    bad = [r for r in S.get("memory", []) if "error" in r and not r["error"].startswith("skipped")]
    if bad:
        out.append("memory errors: " + "; ".join(f"{r.get('case')} {r.get('length')}×{r.get('layers')}: "
                                                 f"{r['error'][:60]}" for r in bad)[:400])
    if _skipped(S.get("memory", [])):
        out.append(f"memory: {_skipped(S['memory'])} skipped")
    for r in S.get("verdicts", []):
        if r.get("estimate") is not None or ("error" in r and not r["error"].startswith("skipped")):
            out.append(f"verdict {r.get('case'):<8} {r.get('length'):>8}: estimate {_g(r.get('estimate'))} GiB, "
                       f"Δ {_g(r.get('measured_delta'))} GiB, check_fits {r.get('check_fits', '-')}, "
                       f"agree {r.get('agree', '-')} {r.get('error', '')[:60]}")
    base = {(r["length"], r["mode"]): r for r in S.get("cost", []) if r["variant"] == "vanilla" and "memory" in r}
    for r in S.get("cost", []):
        b = base.get((r["length"], r["mode"]))
        if "memory" in r and b:
            out.append(f"cost {r['length']:>6} {r['mode']:<7} {r['variant']:<12} "
                       f"time ×{r['seconds'] / b['seconds']:.2f} mem ×{r['memory'] / max(b['memory'], 1):.2f} "
                       f"builds {r.get('steady_mask_builds')} "
                       f"compiles {r.get('steady_compiles')} eager {r.get('eager_flex_calls')}")
        elif "error" in r and not r["error"].startswith("skipped"):
            out.append(f"cost {r['length']:>6} {r['mode']:<7} {r['variant']:<12} {r['error'][:70]}")
    for label in ("verdicts", "cost"):
        if _skipped(S.get(label, [])):
            out.append(f"{label}: {_skipped(S[label])} skipped (budget)")
    entries = data.get("cache_entries", {})
    over = [k for k, v in entries.items() if isinstance(v, int) and v > 8]
    beyond = f": over it: {', '.join(over)}" if over else ""
    out.append(f"dynamo cache entries {json.dumps(entries)} (torch's default limit 8{beyond}); "
               f"notes: {'; '.join(data.get('notes', []))}")
    return "\n".join(out)


def _dynamo_set(names: tuple, value):
    """Set the first of ``names`` this torch's dynamo config has (they were renamed); its name."""
    for name in names:
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
            return f"{name} = {value}"
    return f"none of {names} in this torch"


def versions() -> str:
    import importlib.metadata as md

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu build"]
    for pkg in ("transformers", "triton", "peft", "accelerate", "pydantic"):
        try:
            parts.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            parts.append(f"{pkg} absent")
    return ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json, .md, .log")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of all sections [s]")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--lengths", default=None, help="memory lengths [tokens] (default 32768,65536,131072)")
    ap.add_argument("--cost-lengths", default=None,
                    help="cost lengths in run order [tokens] (default 8192,131072,32768,65536,16384; "
                         "with --lengths given, those)")
    ap.add_argument("--oracle-length", type=int, default=4096)
    ap.add_argument("--sections", default="a,b,c,d,e")
    args = ap.parse_args()
    try:
        cost = args.cost_lengths or args.lengths or "8192,131072,32768,65536,16384"
        args.lengths = [int(x) for x in (args.lengths or "32768,65536,131072").split(",")]
        args.cost_lengths = [int(x) for x in cost.split(",")]
    except ValueError:
        ap.error("--lengths and --cost-lengths are comma-separated whole numbers of tokens")
    sections = set(args.sections.split(","))
    if not sections <= set("abcde"):
        ap.error(f"--sections takes a, b, c, d, e; got {args.sections}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu for the plumbing)")

    from bench.common import machine

    check = Check(args.out, args.budget_s, args.device)
    check.data["config"] = {"shape": args.shape, "device": args.device, "lengths": args.lengths,
                            "cost_lengths": args.cost_lengths, "oracle_length": args.oracle_length,
                            "sections": sorted(sections), "budget_s": args.budget_s, "L_train": TRAIN,
                            "oracle_params": ORACLE_PARAMS, "cost_params": COST_PARAMS}
    check.data["machine"], check.data["versions"] = machine(), versions()
    check.data["dynamo"] = {
        "recompile_limit": _dynamo_set(("recompile_limit", "cache_size_limit"), 32),
        "fail_on_recompile_limit_hit": _dynamo_set(("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True)}
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons in float32, not TF32
        torch.set_float32_matmul_precision("highest")
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        check.data["free_at_start"], check.data["total_memory"] = free, total
    instrument(check)
    if args.device == "cpu":
        check.data["notes"].append("CPU: plumbing only (eager FlexAttention; with gradients the path runs the fused "
                                   "CPU kernels, torch has no FlexAttention backward there; memory is peak RSS)")
    check.say(f"machine: {check.data['machine']}\nversions: {check.data['versions']}")
    check.save()
    def oracle_a():
        section_oracle(check, args, torch.float32, "oracle")
        if any("error" in r for r in check.rows("oracle")):  # float32 failed somewhere: bfloat16 now, not last
            check.data["notes"].append("float32 oracle cases failed: the bfloat16 ones ran right after them")
            section_oracle(check, args, torch.bfloat16, "oracle bf16")

    def oracle_e():
        if "oracle bf16" not in check.data["sections"]:
            section_oracle(check, args, torch.bfloat16, "oracle bf16")
        section_oracle_extra(check, args)

    steps = [("a", oracle_a),
             ("b", lambda: section_memory(check, args)),
             ("c", lambda: section_verdicts(check, args)),
             ("d", lambda: section_cost(check, args)),
             ("e", oracle_e)]
    for key, step in steps:
        if key not in sections:
            continue
        check.say(f"section {key} ({check.left():.0f} s of budget left)")
        try:
            step()
        except Exception as e:  # noqa: BLE001 - a section's own plumbing failed: log it, go on
            check.data["notes"].append(f"section {key}: {type(e).__name__}: {str(e)[:160]}")
            check.log(f"section {key}: {traceback.format_exc()}")
        check.data["cache_entries"] = cache_entries()
        check.log(f"after section {key}: cache entries {check.data['cache_entries']}, compiles {compiles()}")
        check.save()
    print("\n" + summary(check.data), flush=True)


if __name__ == "__main__":
    main()

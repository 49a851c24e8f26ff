"""Peak GPU memory of a training step, estimated on any machine: the real step traced on fake tensors.

    python bench/memory_estimate.py [--shape 8b|small] [--length 131072[,262144]] [--stack baseline]
                                    [--layers N] [--card H100=78.7,H200=139] [--json]

The step is the one ``bench/memory.py``'s ``lora`` case and ``bench/gpu_check.py`` measure on a GPU — LoRA
(r = 8 on q, k, v, o, through ``ropescale.training.lora.apply_lora``) on a frozen bf16 base, activation
checkpointing (``ropescale.training.loop.enable_checkpointing``), the chunked loss
(``ropescale.lm_head.causal_lm_loss``, recomputed in backward) and fused AdamW — on a random Llama of the
shape (``8b``: Llama 3 8B's, V = 128,256), one sequence of n tokens. It runs under
``torch._subclasses.fake_tensor.FakeTensorMode``: every op computes shapes only, nothing is allocated, an
8B step at 128k takes ~40 s on 2 CPU cores. A ``TorchDispatchMode`` adds each new tensor storage's bytes
when an op creates it and subtracts them when the storage is freed; the peak of that count, with the
weights, buffers and inputs counted from the start, is what ``torch.cuda.max_memory_allocated`` reports
for the same step (allocator rounding and the CUDA context aside).

What the GPU step does and a CPU trace would not, the trace does as CUDA would: attention is
PyTorch's SDPA with ``is_causal`` and grouped-query heads (``enable_gqa``), no mask — what transformers
runs for an unpadded batch on CUDA (under fake tensors it cannot see that the mask is all ones and
would build an n × n one); the LM head's reproduction check, a host read made once per run, counts as
passed.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it installs a gradient hook on every
parameter (a frozen LoRA base refuses one) and refuses modules called twice in one step (the chunked
head, checkpoint recomputation). The count here has no module attribution, only the total.

Checked against the H100 (``docs/gpu.md``, issue 31: peak 32.19 GiB at 32k, 83.69 GiB at 128k for the
8B LoRA step): see ``docs/gpu.md`` "The memory estimate without a GPU". ``--stack``: ``baseline`` is
today's stack; ``offload`` adds ``activation_offload`` (``ropescale.training.loop.enable_checkpointing``):
what its ``save_on_cpu`` packs is booked to host memory (``host_gib``), and each input it brings back for
a layer's recomputation to the device again; ``offload+tiled`` adds ``tiled_mlp``
(``ropescale.training.tiling``, DeepSpeed's ``TiledMLP``: needs ``ropescale[scale]``);
``offload+tiled+norms+amp`` adds ``tiled_norms`` (the same tiling for the RMSNorms) and
``mixed_precision: bf16`` — the step under autocast (the CPU's autocast in the trace, CUDA's on the GPU:
both run matmuls and attention in bfloat16), the LoRA adapters (float32) taking the bf16 activations
without PEFT's float32 copy (``apply_lora(..., autocast=True)``), as ``ropescale finetune`` runs
with ``dtype: bfloat16`` and ``mixed_precision: bf16``.

The longest length that fits a card: at fixed depth the step's peak is affine in n (flash attention and
every activation are O(n); the loss chunk is fixed), so two traces give the line, solved for the card
and checked by one more trace at the answer (rounded down to a multiple of 1,024).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GiB = 2**30
STACKS = {"baseline": "LoRA r 8 (q, k, v, o) + activation checkpointing + chunked loss + fused AdamW",
          "offload": "baseline + activation_offload (each checkpointed layer's input in host memory)",
          "offload+tiled": "offload + tiled_mlp (DeepSpeed's TiledMLP, ⌈n / hidden⌉ slices)",
          "offload+tiled+norms+amp": "offload+tiled + tiled_norms + mixed_precision: bf16 (autocast; the adapters "
                                     "take the activations without PEFT's float32 copy)"}
ATTENTION = "ropescale_estimate_sdpa"


class PeakBytes(TorchDispatchMode):
    """Live bytes of the tensor storages ops create while active (and of those ``track``-ed before),
    freed when their storage is; ``peak`` the most at once. Storages are told apart by their
    address (``_cdata``), so views and in-place results count once."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, bool]] = {}  # storage → (bytes, in host memory)
        self.now = self.peak = 0  # on the device
        self.host_now = self.host_peak = 0  # moved to host memory (activation_offload)
        self.to_host = False  # set while save_on_cpu packs: what is created then lives on the host

    def track(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = (size, self.to_host)
        if self.to_host:
            self.host_now += size
            self.host_peak = max(self.host_peak, self.host_now)
        else:
            self.now += size
            self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size, host = self.live.pop(key, (0, False))
        if host:
            self.host_now -= size
        else:
            self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.track(t)
        return out


def _causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' sdpa as it runs on CUDA for an unpadded batch: causal, no mask, GQA in the kernel."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           dropout_p=dropout, enable_gqa=True)  # [b, n_h, s, h_d]
    return out.transpose(1, 2).contiguous(), None  # [b, s, n_h, h_d]


def _host_booked_offload(count: PeakBytes):
    """``torch.autograd.graph.save_on_cpu`` whose packs ``count`` books to host memory, and whose unpacks
    give a device copy back (the trace runs on one fake device; on a GPU these are the copies out and in)."""
    real = torch.autograd.graph.save_on_cpu

    class Booked(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack, unpack = self.pack_hook, self.unpack_hook

            def booked(tensor):
                count.to_host = True
                try:
                    return pack(tensor)
                finally:
                    count.to_host = False

            self.pack_hook = booked
            self.unpack_hook = lambda packed: unpack(packed).clone()

    return Booked


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _causal_sdpa)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)


def _meta_model(shape: str, n: int, layers: int | None, offload: bool = False, tiled: bool = False,
                norms: bool = False, autocast: bool = False):
    """The LoRA-wrapped model of ``shape``, as the lora recipe prepares it, on the meta device (PEFT's
    adapter casts cannot run on fake tensors)."""
    from bench.memory import _model
    from ropescale.training.loop import enable_checkpointing
    from ropescale.training.lora import LoraSettings, apply_lora

    model, _ = _model(shape, n, "meta", layers)
    model.set_attn_implementation(ATTENTION)
    enable_checkpointing(model, offload=offload)
    if tiled or norms:
        from ropescale.training.tiling import enable_tiled_mlp, enable_tiled_norms

        if tiled:
            enable_tiled_mlp(model)
        if norms:
            enable_tiled_norms(model)
    model = apply_lora(model, LoraSettings(), autocast=autocast)
    model.train()
    return model


def _to_fake(model):
    """Each parameter and buffer replaced by a fake tensor (in the active FakeTensorMode) of its shape,
    dtype and grad flag."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                              requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def check_sizes(n: int, layers: int | None) -> None:
    """Refuse (``SystemExit``, one line) a step the trace cannot make: fewer than 2 tokens (no token
    to predict: no loss, no backward) or fewer than 1 decoder layer (nothing for LoRA to wrap)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise SystemExit(f"--length {n}: a training step needs at least 2 tokens (one to predict from the other)")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise SystemExit(f"--layers {layers}: a model needs at least 1 decoder layer")


def estimate(shape: str, n: int, *, stack: str = "baseline", layers: int | None = None) -> dict:
    """Trace one training step at ``n`` tokens; ``{"peak_gib", "base_gib", "seconds", ...}`` where base
    is the weights, buffers and inputs, peak the most bytes alive at once during the step. ``SystemExit``
    (one line) for an unknown stack, ``n`` < 2 or ``layers`` < 1 (``check_sizes``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ropescale.lm_head import OutputHead, causal_lm_loss

    if stack not in STACKS:
        raise SystemExit(f"--stack {stack}: unknown; stacks: {', '.join(STACKS)}")
    check_sizes(n, layers)
    _register_attention()
    t0 = time.perf_counter()
    parts = stack.split("+")
    amp = "amp" in parts
    model = _meta_model(shape, n, layers, offload="offload" in parts, tiled="tiled" in parts, norms="norms" in parts,
                        autocast=amp)
    with FakeTensorMode():
        _to_fake(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
        ids = torch.zeros(1, n, dtype=torch.long)
        count = PeakBytes()
        for t in (*model.parameters(), *model.buffers(), ids):
            count.track(t)
        base = count.now
        head = OutputHead(model)
        head.verified = True  # the run's one host read, on its first step
        real_offload = torch.autograd.graph.save_on_cpu
        torch.autograd.graph.save_on_cpu = _host_booked_offload(count)
        try:
            with count, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = causal_lm_loss(model, ids, head=head)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            torch.autograd.graph.save_on_cpu = real_offload
    return {"shape": shape, "length": n, "stack": stack, "layers": model.config.num_hidden_layers,
            "base_gib": base / GiB, "peak_gib": count.peak / GiB, "host_gib": count.host_peak / GiB,
            "seconds": round(time.perf_counter() - t0, 1)}


def longest(shape: str, card_gib: float, *, stack: str = "baseline", layers: int | None = None,
            probes: tuple[int, int] = (32_768, 131_072), check: bool = True) -> dict:
    """The longest n (a multiple of 1,024) whose traced peak fits ``card_gib``: the affine fit through
    two traces, checked by a third at the answer and stepped down by 1% until it fits (``check=False``:
    the fit alone, ``"checked": False`` — a trace at a million tokens takes many minutes)."""
    (n1, p1), (n2, p2) = ((n, estimate(shape, n, stack=stack, layers=layers)["peak_gib"]) for n in probes)
    slope = (p2 - p1) / (n2 - n1)  # GiB per token
    n = int((n1 + (card_gib - p1) / slope) // 1024 * 1024)
    if not check:
        return {"card_gib": card_gib, "longest": n, "peak_gib": p1 + (n - n1) * slope,
                "gib_per_1k_tokens": slope * 1024, "checked": False}
    while n >= 1024:
        got = estimate(shape, n, stack=stack, layers=layers)["peak_gib"]
        if got <= card_gib:
            return {"card_gib": card_gib, "longest": n, "peak_gib": got, "gib_per_1k_tokens": slope * 1024,
                    "checked": True}
        n = int(n * 0.99) // 1024 * 1024
    return {"card_gib": card_gib, "longest": 0, "peak_gib": None, "gib_per_1k_tokens": slope * 1024, "checked": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", help="small | 8b (bench/memory.py's shapes)")
    ap.add_argument("--length", default="32768,65536,131072", help="comma-separated n [tokens]")
    ap.add_argument("--stack", default="baseline", help=", ".join(STACKS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--card", default="H100=78.7,H200=139",
                    help="NAME=GiB free on a card, comma-separated ('' for none): the longest length that fits")
    ap.add_argument("--fit-only", action="store_true",
                    help="the longest length from the affine fit alone (no trace at that length)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()

    from bench.common import machine
    from bench.memory import SHAPES

    if args.shape not in SHAPES:
        raise SystemExit(f"--shape {args.shape}: choose one of {', '.join(SHAPES)}")
    try:
        lengths = [int(x) for x in args.length.split(",") if x]
        cards = {k: float(v) for k, v in (c.split("=") for c in args.card.split(",") if c)}
    except ValueError:
        raise SystemExit("--length takes integers, --card NAME=GiB pairs") from None
    for n in lengths:  # every one before the first trace (each takes up to minutes)
        check_sizes(n, args.layers)
    rows = [estimate(args.shape, n, stack=args.stack, layers=args.layers) for n in lengths]
    fits = {name: longest(args.shape, gib, stack=args.stack, layers=args.layers, check=not args.fit_only)
            for name, gib in cards.items()}
    out = {"machine": machine(), "torch": torch.__version__, "stack": STACKS.get(args.stack), "rows": rows,
           "longest": fits}
    if args.json:
        print(json.dumps(out))
        return
    s = SHAPES[args.shape]
    print(f"traced on: {out['machine']}")
    print(f"model: random Llama {args.shape}, V = {s['vocab_size']:,}, hidden {s['hidden_size']}, "
          f"{args.layers or s['num_hidden_layers']} layers, {s['dtype']}; one sequence; stack {args.stack}: "
          f"{out['stack']}")
    print(f"{'length':>9} {'base GiB':>9} {'peak GiB':>9} {'host GiB':>9} {'trace s':>8}")
    for r in rows:
        print(f"{r['length']:>9} {r['base_gib']:>9.2f} {r['peak_gib']:>9.2f} {r['host_gib']:>9.2f} {r['seconds']:>8}")
    for name, f in fits.items():
        how = "traced" if f["checked"] else "from the fit, not traced there"
        print(f"longest on {name} ({f['card_gib']:g} GiB): {f['longest']:,} tokens "
              f"(peak {f['peak_gib'] or 0:.1f} GiB, {how}; {f['gib_per_1k_tokens']:.3f} GiB per 1k tokens)")


if __name__ == "__main__":
    main()

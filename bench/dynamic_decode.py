"""Decode cost and exactness of dynamic NTK under the KV cache, vs transformers' own ``dynamic``.

    python bench/dynamic_decode.py [--prompt 96] [--new 416] [--repeats 2]

Greedy ``generate()`` on the bundled model (T = 128) from a held-out prompt well past T. Rows:
transformers ``rope_type: dynamic`` (the baseline: fast but inexact, cached keys keep old
rotations), ropescale ``dynamic_ntk`` with ``dynamic_cache="recompute"`` (exact; per token and
per 64-token block), with ``"rerotate"`` (cheap, approximate), and static vanilla RoPE for
scale. ``max |Δlogit|`` compares each step's logits with a full forward over the same prefix
under the same rule, at every 16th step. Time is best of ``--repeats``; ratio = time / baseline.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import AutoModelForCausalLM

import ropescale
from bench.common import machine
from ropescale.models import REFERENCE_MODEL
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents


@torch.no_grad()
def run(model, prompt, new, check_every=16):
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    seconds = time.perf_counter() - t0
    worst = 0.0
    for i in range(0, new, check_every):
        full = model(out.sequences[:, : prompt.shape[1] + i]).logits[:, -1]
        worst = max(worst, (out.logits[i] - full).abs().max().item())
    return seconds, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--new", type=int, default=416)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    model, tok = ropescale.load_model("reference", device="cpu")
    native_cfg = copy.deepcopy(model.config)
    native_cfg.rope_parameters = {**native_cfg.rope_parameters, "rope_type": "dynamic", "factor": 1.0}
    native = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, config=native_cfg).eval()
    doc = tokenize_documents(tok, load_documents(DataSpec("kjv-heldout")))[2]  # Ezekiel
    prompt = doc[: args.prompt][None]

    rows = [("transformers dynamic (baseline)", native, None),
            ("ropescale dynamic_ntk, recompute", model, {"dynamic_cache": "recompute"}),
            ("ropescale dynamic_ntk, recompute, block 64", model, {"dynamic_cache": "recompute", "dynamic_block": 64}),
            ("ropescale dynamic_ntk, rerotate", model, {"dynamic_cache": "rerotate"}),
            ("static vanilla RoPE (reference)", model, "vanilla")]
    print(f"machine: {machine()}")
    print(f"bundled model, prompt {args.prompt} tokens, {args.new} new tokens "
          f"(to {args.prompt + args.new} = {(args.prompt + args.new) / 128:g}T), batch 1, best of {args.repeats}\n")
    print(f"{'variant':<44} {'seconds':>8} {'ratio':>6} {'max |Δlogit|':>13}")
    base = None
    for name, m, opts in rows:
        best, worst = float("inf"), 0.0
        for _ in range(args.repeats):
            if opts is None:
                seconds, worst = run(m, prompt, args.new)
            else:
                strategy, kw = ("vanilla", {}) if opts == "vanilla" else ("dynamic_ntk", opts)
                with ropescale.patch(m, strategy, **kw):
                    seconds, worst = run(m, prompt, args.new)
            best = min(best, seconds)
        base = base or best
        print(f"{name:<44} {best:>8.2f} {best / base:>6.2f} {worst:>13.2e}")


if __name__ == "__main__":
    main()

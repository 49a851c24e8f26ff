"""RULER on the bundled model: ropescale's suite against lm-eval's ``ruler`` tasks, and sample
generation with and without ropescale's cache.

    python bench/ruler_vs_lmeval.py [--tasks niah_single_1 niah_multikey_2 vt cwe fwe] [--lengths 1024]
                                    [--samples 5] [--out runs/bench-ruler]

1. **Generation**: every task × length's samples built by ropescale with an empty cache (cold:
   RULER's size search and draws), then again from the cache (warm), in one process.
2. **Throughput**: examples per second, wall time end to end as a user runs it (sample generation,
   model load, greedy decoding, scoring), for the same model, tasks, lengths and number of scored
   examples: ropescale's ``ruler`` suite (vanilla RoPE, batch 8, fresh cache) and lm-eval 0.4.13's
   ``ruler`` tasks through ``HFLM`` (``limit`` = samples; lm-eval generates its 500 samples per task
   and length on every run, the cost measured here). Tasks lm-eval cannot build offline (its
   essay haystack downloads Paul Graham's essays; its niah module asks nltk to download punkt_tab)
   are listed with the reason and left out of both sides.

Both sides run here, one after the other, on this machine (named in the output); a ratio is
only meaningful within one run. Writes ``bench.json`` and ``bench.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LMEVAL_NAMES = {"niah_single_1": "niah_single_1", "niah_multikey_2": "niah_multikey_2",
                "niah_multikey_3": "niah_multikey_3", "vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe",
                "niah_single_2": "niah_single_2", "niah_single_3": "niah_single_3",
                "niah_multikey_1": "niah_multikey_1", "niah_multivalue": "niah_multivalue",
                "niah_multiquery": "niah_multiquery"}


def generation_times(tasks: list[str], lengths: list[int], samples: int) -> list[dict]:
    from transformers import AutoTokenizer

    from eval.tasks import get_task
    from ropescale.models import REFERENCE_MODEL
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    tok = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    docs = tokenize_documents(tok, load_documents(DataSpec("kjv-heldout")))
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ROPESCALE_CACHE"] = cache
        for name in tasks:
            for length in lengths:
                cls = get_task(name)
                row = {"task": name, "length": length}
                for kind in ("cold", "warm"):
                    t = cls(cls.Options(num_samples=samples), tokenizer=tok, train_length=128, documents=docs)
                    t0 = time.perf_counter()
                    try:
                        t.examples(length)
                        row[kind] = time.perf_counter() - t0
                    except ValueError as e:
                        row[kind], row["refused"] = None, str(e)
                rows.append(row)
                print("generation", row, flush=True)
    return rows


def ropescale_run(tasks: list[str], lengths: list[int], samples: int, out: Path) -> dict:
    from eval.config import build_config
    from eval.sweep import run_sweep

    with tempfile.TemporaryDirectory() as cache:
        os.environ["ROPESCALE_CACHE"] = cache
        cfg = build_config({"task": "ruler", "model": "reference", "data": "kjv-heldout", "lengths": lengths,
                            "strategies": ["vanilla"], "device": "cpu",
                            "ruler": {"tasks": tasks, "num_samples": samples, "batch_size": 8}})
        t0 = time.perf_counter()
        records = run_sweep(cfg, out, progress=False)
        wall = time.perf_counter() - t0
    n = sum(len(r["scores"]) for r in records) * samples
    return {"wall_s": wall, "examples": n, "examples_per_s": n / wall,
            "scores": {r["length"]: r["scores"] for r in records}}


def lmeval_run(tasks: list[str], lengths: list[int], samples: int) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from ropescale.models import REFERENCE_MODEL

    built, refused = [], {}
    model = HFLM(pretrained=str(REFERENCE_MODEL), max_length=max(lengths), batch_size=8, device="cpu")
    t0 = time.perf_counter()
    results = {}
    for name in tasks:
        try:
            res = lm_eval.simple_evaluate(model=model, tasks=[LMEVAL_NAMES[name]], limit=samples,
                                          metadata={"max_seq_lengths": lengths, "pretrained": str(REFERENCE_MODEL)})
            results[name] = {k: v for k, v in res["results"][LMEVAL_NAMES[name]].items() if k.split(",")[0].isdigit()}
            built.append(name)
        except Exception as e:  # noqa: BLE001 — lm-eval raises many kinds when a download fails offline
            refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print("lm-eval", name, results.get(name), refused.get(name), flush=True)
    wall = time.perf_counter() - t0
    n = len(built) * len(lengths) * samples
    return {"wall_s": wall, "examples": n, "examples_per_s": n / wall if n else None, "built": built,
            "refused": refused, "scores": results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--out", default="runs/bench-ruler")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()})"
    gen = generation_times(args.tasks, args.lengths, args.samples)
    lm = lmeval_run(args.tasks, args.lengths, args.samples)
    ours = ropescale_run([t for t in args.tasks if t in lm["built"]] or args.tasks, args.lengths, args.samples,
                         out / "ropescale-run")
    doc = {"machine": machine, "tasks": args.tasks, "lengths": args.lengths, "samples": args.samples,
           "generation": gen, "lm_eval": lm, "ropescale": ours}
    (out / "bench.json").write_text(json.dumps(doc, indent=1))
    lines = [f"Machine: {machine}. Bundled model, tasks {', '.join(args.tasks)}, lengths {args.lengths}, "
             f"{args.samples} scored samples per task and length.", "",
             "| task | length | generation cold (s) | from the cache (s) |", "|---|---:|---:|---:|"]
    for r in gen:
        cold = "refused" if r["cold"] is None else f"{r['cold']:.2f}"
        warm = "refused" if r["warm"] is None else f"{r['warm']:.3f}"
        lines.append(f"| {r['task']} | {r['length']} | {cold} | {warm} |")
    lines += ["", "| harness | tasks built | examples | wall (s) | examples/s |", "|---|---|---:|---:|---:|"]
    for name, r in (("lm-eval ruler", lm), ("ropescale ruler", ours)):
        eps = "—" if r["examples_per_s"] is None else f"{r['examples_per_s']:.3f}"
        built = ", ".join(r.get("built", [t for t in args.tasks if t in lm["built"]] or args.tasks))
        lines.append(f"| {name} | {built} | {r['examples']} | {r['wall_s']:.1f} | {eps} |")
    if lm["refused"]:
        lines += ["", "lm-eval could not build offline: " + "; ".join(f"{k} ({v})" for k, v in lm["refused"].items())]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

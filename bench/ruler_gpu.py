"""The RULER suite on an 8B-shaped random Llama at 32k tokens, bfloat16, on one GPU: peak memory
(against the harness's estimate) and examples per second. A prepared script for a lent GPU.

    python bench/ruler_gpu.py [--length 32768] [--samples 4] [--batch 4] [--tasks niah_single_1 vt fwe cwe]
                              [--strategies vanilla yarn] [--out runs/bench-ruler-gpu]

The model: Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336, θ 500000,
T = 8192) with the bundled tokenizer's 4096-token vocabulary, random weights made on the GPU in
bfloat16 (no download, no checkpoint written); sdpa attention. Tasks: those with haystacks that need
no text (noise, needles, word lists), so the machine needs nothing but this checkout. Per
strategy: the cell's examples are built once (RULER's generators, the sample cache), then decoded
by ``RulerSuite.measure`` exactly as ``ropescale eval`` does; timings exclude generation (printed
separately). Writes ``gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eval.tasks.ruler.suite import RulerSuite, RulerSuiteOptions
    from ropescale.models import REFERENCE_MODEL
    from ropescale.patching import patch
    from ropescale.runs.memory import fmt_gib
    from ropescale.strategies import get_strategy

    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tasks", nargs="+", default=["niah_single_1", "vt", "fwe", "cwe"])
    ap.add_argument("--strategies", nargs="+", default=["vanilla", "yarn"])
    ap.add_argument("--out", default="runs/bench-ruler-gpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")

    tok = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, made in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    suite = RulerSuite(RulerSuiteOptions(tasks=args.tasks, num_samples=args.samples, batch_size=args.batch),
                       tokenizer=tok, train_length=8192)
    estimate = suite.memory(args.length, model)
    t0 = time.perf_counter()
    examples = suite.examples(args.length)
    generation = time.perf_counter() - t0
    print(f"{len(examples)} examples generated in {generation:.1f}s; refused: {suite.refused[args.length]}",
          flush=True)
    rows = []
    for name in args.strategies:
        strat = get_strategy(name)
        params = strat.resolve({}, length=args.length, train_length=8192)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with patch(model, name, original_max_position_embeddings=8192, **params):
            part = suite.measure(model, examples, list(range(len(examples))), length=args.length, strategy=strat,
                                 device=device, desc=None)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rec = suite.combine([part], examples, length=args.length, strategy=strat)
        rows.append({"strategy": name, "params": params, "seconds": seconds,
                     "examples_per_s": len(examples) / seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "scores": rec["scores"], "prompt_tokens_max": max(t["prompt_tokens_max"]
                                                                      for t in rec["per_task"].values())})
        print(rows[-1], flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "length": args.length, "samples": args.samples, "batch": args.batch,
           "tasks": args.tasks, "dtype": "bfloat16", "generation_s": generation,
           "estimate_device_gib": sum(estimate.device.values()) / 2**30,
           "estimate": {k: fmt_gib(v) for k, v in estimate.device.items()}, "rows": rows}
    (out / "gpu.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

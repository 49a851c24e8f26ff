"""Which scorer is fastest for a real model on a CPU, and does it agree: one run, the same windows for each.

    python bench/scorers.py [--model smollm2-135m] [--lengths 8192,16384] [--engines transformers-float32,...]

For each engine and length, one window of the KJV's held-out books (read as one text; the same window for
every engine) is scored as the perplexity task scores it: seconds, tokens per second, peak resident memory
of the process tree that scored it, and the mean NLL, with its difference from transformers in float32 (the
reference: the dequantized weights in full precision). Engines:

- ``transformers-float32`` / ``transformers-bfloat16``: the in-process engine (``eval.sweep``), SDPA;
- ``vllm`` / ``mlx``: the scoring engines ``engine: vllm`` / ``engine: mlx`` (each in its own environment,
  ``bench/engines/install.sh``); seconds: vLLM's scoring alone (it reports it), MLX's cell (start-up included);
- ``llama.cpp-q4_1``: llama-cpp-python over the GGUF the model came from (SmolLM2's own Q4_1 file: the
  weights the float32 folder dequantizes, exactly), logits of every position, flash attention on;
- ``llama.cpp-f32``: the same over the float32 folder converted by llama.cpp's own converter (F32 tensors).

Each engine runs in a fresh process (``--one``), so its peak memory is its own. Ratios are against
transformers float32 measured in the same run, on the same machine (printed). The model's own positions only
(vanilla): a strategy changes what is computed, not how fast an engine computes it. Seconds are scoring only:
transformers' cell (the model loaded before it), llama.cpp's ``eval`` (the model loaded before it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = ("transformers-float32", "transformers-bfloat16", "vllm", "mlx", "llama.cpp-q4_1", "llama.cpp-f32")
LLAMA_NLL = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, ids = sys.argv[1], json.load(open(sys.argv[2]))
n = len(ids)
llm = Llama(model_path=path, n_ctx=n, n_batch=512, n_ubatch=512, n_threads=int(sys.argv[3]), logits_all=True,
            flash_attn=True, verbose=False)
t = time.perf_counter()
llm.eval(ids)
seconds = time.perf_counter() - t
x = np.asarray(llm.scores[: n - 1], dtype=np.float64)  # [n-1, V] logits predicting tokens 1 … n-1
m = x.max(1)
nll = m + np.log(np.exp(x - m[:, None]).sum(1)) - x[np.arange(n - 1), ids[1:]]
print(json.dumps({"seconds": seconds, "nll": float(nll.mean()), "tokens": n - 1}))
"""


def window_ids(model: str, length: int) -> list[int]:
    """The first whole window of ``length`` tokens of the KJV's held-out books read as one text."""
    from ropescale.models import load_tokenizer
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    tok = load_tokenizer(model)
    ids = tokenize_documents(tok, load_documents(DataSpec("kjv-heldout", join=True)))[0]
    return ids[:length].tolist()


def _sweep(model: str, length: int, engine: str, dtype: str, text: Path, out: Path) -> dict:
    from eval.config import build_config
    from eval.sweep import run_sweep

    raw = {"model": model, "data": str(text), "lengths": [length], "strategies": ["vanilla"], "max_windows": 1,
           "device": "cpu", "dtype": dtype, **({"engine": engine} if engine != "transformers" else {})}
    (record,) = run_sweep(build_config(raw), out, progress=False)
    # the cell's own seconds (the model loaded before); an engine's scoring alone where it reports it (vLLM)
    return {"seconds": record.get("engine_score_seconds", record["seconds"]), "cell_seconds": record["seconds"],
            "nll": record["nll"], "tokens": record["tokens"]}


def _llama(model: str, length: int, kind: str, ids_file: Path, work: Path, threads: int) -> dict:
    from eval.engines import engine_python  # the llama.cpp environment's Python

    python = engine_python("llama.cpp")
    if kind == "q4_1":
        from importlib.util import find_spec

        from ropescale.pip_models import PIP_MODELS

        spec = PIP_MODELS[model]
        gguf = Path(next(iter(find_spec(spec.package).submodule_search_locations))) / spec.gguf
    else:  # the float32 folder through llama.cpp's own converter (eval/engines/convert_gguf.py), F32 tensors
        from eval.engines.llama_cpp import llama_cpp_source
        from ropescale.models import resolve_model

        gguf = work / "model-f32.gguf"
        request = {"mode": "convert", "model": resolve_model(model), "out": str(gguf),
                   "source": str(llama_cpp_source()), "outtype": "f32"}
        (work / "request.json").write_text(json.dumps(request))
        subprocess.run([str(python), str(ROOT / "eval" / "engines" / "llama_cpp" / "scripts" / "convert_gguf.py"),
                        str(work / "request.json"),
                        str(work / "result.json")], check=True, capture_output=True)
    out = subprocess.run([str(python), "-c", LLAMA_NLL, str(gguf), str(ids_file), str(threads)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one(engine: str, model: str, length: int, threads: int) -> dict:
    """Score one window with ``engine`` in this process (and its children); its numbers and peak memory."""
    import torch

    torch.set_num_threads(threads)
    ids = window_ids(model, length)
    with tempfile.TemporaryDirectory(prefix="ropescale-scorers-") as tmp:
        work = Path(tmp)
        if engine.startswith("llama.cpp"):
            (work / "ids.json").write_text(json.dumps(ids))
            result = _llama(model, length, engine.split("-", 1)[1], work / "ids.json", work, threads)
        else:
            from ropescale.models import load_tokenizer

            text = work / "window.txt"  # the window as text: the sweep cuts its one window of L tokens from it
            text.write_text(load_tokenizer(model).decode(ids + ids[:64]), encoding="utf-8")
            name, _, dtype = engine.partition("-")
            result = _sweep(model, length, name, dtype or "float32", text, work / "run")
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))  # KiB
    return {**result, "engine": engine, "length": length, "peak_gib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.one:
        print(json.dumps(one(args.one, args.model, lengths[0], args.threads)))
        return
    from bench.common import machine

    rows = []
    for length in lengths:
        for engine in args.engines.split(","):
            run = subprocess.run([sys.executable, __file__, "--one", engine, "--model", args.model, "--lengths",
                                  str(length), "--threads", str(args.threads)], capture_output=True, text=True)
            if run.returncode:
                last = (run.stderr.strip().splitlines() or ["failed"])[-1]
                rows.append({"engine": engine, "length": length, "error": last[:160]})
            else:
                rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"machine: {machine()}\nmodel {args.model}, one window of the KJV's held-out books per length, vanilla\n")
    print("| engine | L | seconds | tokens/s | × transformers float32 | peak memory [GiB] | mean NLL | Δ NLL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        base = next((r for r in rows if r["length"] == length and r["engine"] == "transformers-float32"
                     and "error" not in r), None)
        for r in (r for r in rows if r["length"] == length):
            if "error" in r:
                print(f"| {r['engine']} | {length} | did not run: {r['error']} | | | | | |")
                continue
            ratio = f"{base['seconds'] / r['seconds']:.2f}" if base else "—"
            delta = f"{r['nll'] - base['nll']:+.1e}" if base else "—"
            print(f"| {r['engine']} | {length} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:.0f} | {ratio} | "
                  f"{r['peak_gib']:.2f} | {r['nll']:.5f} | {delta} |")


if __name__ == "__main__":
    main()

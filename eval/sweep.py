"""Perplexity sweep: every (strategy, length) cell on the same windows, resumable.

The model is loaded once; each strategy is patched in and removed in place per cell. Each
finished cell is appended to ``results.jsonl`` at once (flushed), so an interrupted run loses
at most the cell in progress and a rerun with the same output folder skips finished cells.
When the sweep ends, ``results.csv``, ``results.md`` and the plots are written from the cells
of this sweep.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import ropescale
from ropescale.models import load_model, resolve_device
from ropescale.patching import NoRotaryEmbeddingError, find_rotary_modules, patch, rope_context, unpatch
from ropescale.strategies import get_strategy
from eval.config import StrategySpec, SweepConfig
from eval.data import load_documents, tokenize_documents
from eval.perplexity import score_windows
from eval.report import write_reports
from eval.windows import make_windows

__all__ = ["run_sweep", "cell_id", "read_results", "environment"]

RESULTS = "results.jsonl"


def cell_id(cfg: SweepConfig, spec: StrategySpec, length: int) -> str:
    """Stable id of a cell: everything that changes its number, hashed."""
    key = {"model": cfg.model, "data": cfg.data.spec().describe(), "strategy": spec.name,
           "params": spec.params, "logn": spec.logn, "length": length, "mode": cfg.mode,
           "stride": cfg.stride if cfg.mode == "sliding" else None, "add_bos": cfg.add_bos,
           "max_windows": cfg.max_windows, "dtype": cfg.dtype,
           "dynamic_block": cfg.dynamic_block if get_strategy(spec.name).dynamic else None,
           "original_max_position_embeddings": cfg.original_max_position_embeddings}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_results(path: str | Path) -> list[dict]:
    """Records of a ``results.jsonl`` (a torn last line from a killed run is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _git_hash() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(ropescale.__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    import transformers
    return {"ropescale": ropescale.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "git": _git_hash(), "machine": platform.machine(),
            "threads": torch.get_num_threads()}


def _append_safely(path: Path):
    """Open ``results.jsonl`` for appending; a torn last line (killed mid-write) is ended first."""
    sink = path.open("a+")
    sink.seek(0, 2)
    if sink.tell():
        sink.seek(sink.tell() - 1)
        if sink.read(1) != "\n":
            sink.write("\n")
    return sink


def _training_window(cfg: SweepConfig, model) -> int:
    if cfg.original_max_position_embeddings:
        return cfg.original_max_position_embeddings
    rotary = find_rotary_modules(model)
    if not rotary:
        raise NoRotaryEmbeddingError(f"{cfg.model}: no rotary embedding (no `inv_freq` buffer) to sweep")
    train_len = rope_context(model, rotary[0][1])["original_max_position_embeddings"]
    if not train_len:
        raise ValueError(f"{cfg.model}: config has no max_position_embeddings; "
                         "set original_max_position_embeddings in the sweep config")
    return train_len


def _dynamic_semantics(block: int | None) -> str:
    if block is None:
        return "one scale per window (L = window length), as a single forward"
    return (f"block-wise, block {block}: tokens [kB, (k+1)B) scored by a forward over the first (k+1)B "
            "tokens, as exact cached generation with dynamic_block=B (B=1: per position)")


def _score_cell(cfg, model, docs, windows, spec: StrategySpec, length: int, train_len: int,
                bos: int | None, device, progress: bool) -> dict:
    """Patch, score, unpatch; the cell's record (without id and environment)."""
    strat = get_strategy(spec.name)
    params = strat.validate(spec.params, fill_auto={"scale": max(1.0, length / train_len),
                                                    "length": float(length), "half_train": train_len // 2})
    block = cfg.dynamic_block if strat.dynamic else None
    t0 = time.perf_counter()
    with patch(model, spec.name, original_max_position_embeddings=train_len, logn=spec.logn, **params):
        score = score_windows(model, docs, windows, length=length, bos_token_id=bos,
                              batch_size=cfg.batch_size, buckets=cfg.position_buckets, device=device,
                              desc=f"{spec.display} @ {length}" if progress else None, prefix_block=block)
    seconds = time.perf_counter() - t0
    return {
        "strategy": spec.display, "name": spec.name, "params": params, "logn": spec.logn, "length": length,
        "train_length": train_len, "ppl": math.exp(score.mean_nll), "nll": score.mean_nll,
        "tokens": score.tokens, "windows": len(windows), "mode": cfg.mode,
        "stride": (cfg.stride or length // 2) if cfg.mode == "sliding" else None,
        "add_bos": cfg.add_bos, "model": cfg.model, "data": cfg.data.spec().describe(),
        "dtype": cfg.dtype, "device": str(device),
        "dynamic": _dynamic_semantics(block) if strat.dynamic else None,
        "nll_by_position": score.by_position(), "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(w.end - w.start for w in windows) / seconds, 1),
    }


def run_sweep(cfg: SweepConfig, output: str | Path, *, progress: bool = True) -> list[dict]:
    """Run (or resume) the sweep; returns this sweep's records in (length, strategy) order.

    Raises ``eval.data.DataError`` / ``eval.windows.WindowError`` for unusable data (before any
    cell runs), ``NoRotaryEmbeddingError`` for a model without RoPE, and ``ValueError`` for
    strategy parameters that fail at a given length.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    results_path = output / RESULTS
    done = {r["cell"]: r for r in read_results(results_path) if "cell" in r}
    cells = [(length, spec, cell_id(cfg, spec, length)) for length in cfg.lengths for spec in cfg.strategies]
    todo = [c for c in cells if c[2] not in done]
    if progress and len(todo) < len(cells):
        print(f"resuming: {len(cells) - len(todo)} of {len(cells)} cells already in {results_path}")

    if todo:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = resolve_device(cfg.device)
        model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=str(device))
        unpatch(model)  # a patch saved with the model would stack under the sweep's strategies
        train_len = _training_window(cfg, model)
        bos = tokenizer.bos_token_id if cfg.add_bos else None
        if cfg.add_bos and bos is None:
            raise ValueError(f"add_bos is set but the tokenizer of {cfg.model} has no BOS token")
        docs = tokenize_documents(tokenizer, load_documents(cfg.data.spec()))
        # cut every length first: a too-short dataset fails before any work is done
        windows = {length: make_windows([len(d) for d in docs], length, cfg.mode, cfg.stride,
                                        cfg.add_bos, cfg.max_windows)
                   for length in sorted({c[0] for c in todo})}
        env = environment()
        with _append_safely(results_path) as sink:
            for length, spec, cid in todo:
                record = {"cell": cid, **_score_cell(cfg, model, docs, windows[length], spec, length,
                                                     train_len, bos, device, progress), "env": env}
                sink.write(json.dumps(record) + "\n")
                sink.flush()  # written as it completes: a rerun resumes from here
                done[cid] = record
                if progress:
                    print(f"{spec.display:>24} @ {length:>6}: ppl {record['ppl']:8.3f} "
                          f"({record['tokens']} tokens, {record['seconds']:.1f}s)", flush=True)
    records = [done[cid] for _, _, cid in cells]
    write_reports(records, output)
    return records

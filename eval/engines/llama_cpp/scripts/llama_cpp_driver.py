"""llama.cpp driver (llama-cpp-python): runs inside its own environment (never imports ropescale).

    python llama_cpp_driver.py REQUEST.json RESULT.json

Modes (``request["mode"]``):

``logprobs``: ``{"jobs": [{"gguf": FILE, "n_ctx": N, "ids": [[int, ...], ...]}, ...]}`` →
``{"jobs": [{"logprobs": [[float, ...], ...], "seconds": s}], "llama_cpp": version}``. Each job is
one ``Llama(model_path=FILE, n_ctx=N, n_batch=N, n_ubatch=N, logits_all=True, type_k=type_v=F32)``
(the default f16 KV cache alone moves log p by up to 1.8e-2 on the bundled model); each sequence
is evaluated from an empty cache; ``logprobs[k][j]`` = log p(ids[j+1] | ids[:j+1]) from the
runtime's logits (log-softmax in float64).

``rope``: ``{"cases": [{"gguf": FILE, "n_ctx": N}]}`` → per case ``{"meta": {key: value}}``: the
GGUF metadata as the llama.cpp runtime read it (``llama_model_meta_*``), plus the runtime's
``rope_freq_scale_train`` and ``n_ctx_train``: what the runtime will rotate with. (The rotation itself
is computed by ggml inside the graph, which llama-cpp-python does not expose; the end-to-end
log-probabilities are the runtime's own check of it.) ``{"error": line}`` for a GGUF the runtime refuses
to load: the error lines of its own log.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path


def _llama(path: str, n_ctx: int, *, vocab_only: bool = False):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_threads=2,
                           n_threads_batch=2, seed=0, verbose=False, vocab_only=vocab_only)


def logprobs(request: dict) -> dict:
    """Per job (a GGUF, its ``n_ctx`` and token windows): llama.cpp's log-probability of each next token
    [nats], with the seconds taken."""
    import llama_cpp
    import numpy as np

    out = []
    for job in request["jobs"]:
        start = time.perf_counter()
        llm = _llama(job["gguf"], int(job["n_ctx"]))
        seqs = []
        for ids in job["ids"]:
            llm.reset()
            llm.eval([int(t) for t in ids])
            scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
            scores -= scores.max(axis=1, keepdims=True)
            logp = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
            nxt = np.asarray(ids[1:], dtype=np.int64)
            seqs.append(logp[np.arange(len(ids) - 1), nxt].tolist())
        out.append({"logprobs": seqs, "seconds": time.perf_counter() - start})
        llm.close() if hasattr(llm, "close") else None
        del llm
    return {"jobs": out, "llama_cpp": llama_cpp.__version__}


def _meta(model) -> dict:
    import llama_cpp

    meta = {}
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_count(model)
    for i in range(n):
        llama_cpp.llama_model_meta_key_by_index(model, i, buf, len(buf))
        key = buf.value.decode("utf-8", "replace")
        llama_cpp.llama_model_meta_val_str_by_index(model, i, buf, len(buf))
        val = buf.value.decode("utf-8", "replace")
        if key.startswith("tokenizer."):
            continue
        meta[key] = val
    return meta


def _load_error(path: str) -> str:
    """Why llama.cpp refuses to load ``path``: the error lines of its own log (C-level stderr, captured),
    one line."""
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            import llama_cpp

            llama_cpp.Llama(model_path=path, n_ctx=64, verbose=True)
        except Exception:  # noqa: BLE001 — the failure is expected: its log is what is wanted
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
    return " ".join(" / ".join(lines[-2:]).split())[:300]


def rope(request: dict) -> dict:
    """Per case (a GGUF and ``n_ctx``): the rope parameters llama.cpp reads from it, as its model reports them."""
    import llama_cpp

    out = []
    for case in request["cases"]:
        # what is answered is the model's (its metadata and hparams), not the context's: a small context
        # (a 128k one with a 128k batch would not allocate)
        try:
            llm = _llama(case["gguf"], min(int(case["n_ctx"]), 512))
        except ValueError as e:  # llama.cpp refuses the GGUF: its reason, from its own log
            out.append({"error": _load_error(case["gguf"]) or str(e)})
            continue
        model = llm.model
        out.append({"meta": _meta(model),
                    "rope_freq_scale_train": float(llama_cpp.llama_model_rope_freq_scale_train(model)),
                    "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(model))})
        del llm
    return {"cases": out, "llama_cpp": llama_cpp.__version__}


def main() -> int:
    """Read one JSON request on stdin (``mode``: rope or logprobs), write the JSON answer on stdout."""
    request = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    result = {"logprobs": logprobs, "rope": rope}[request["mode"]](request)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

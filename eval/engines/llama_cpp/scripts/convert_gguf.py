"""llama.cpp's own converter (``convert_hf_to_gguf.py``) with one mapping added: runs inside the
llama.cpp environment (never imports ropescale) and does not copy the converter.

    python convert_gguf.py REQUEST.json RESULT.json

Request: ``{"mode": "convert", "model": DIR, "out": FILE.gguf, "source": LLAMA_CPP_DIR,
"outtype": "f32"}`` (or ``"jobs": [{"model": DIR, "out": FILE}, ...]`` for several in one process);
``source`` is the ``vendor/llama.cpp`` folder of the llama-cpp-python sdist (its
``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py``, imported from there). Result:
``{"out": FILE, "pre": name}`` (``{"jobs": [...]}`` for jobs, each ``{"out": FILE, "error": line}`` where
the converter refused that model).

Why the mapping: the converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a
fixed string and refuses hashes it does not list — also a from-scratch vocabulary whose
pre-tokenizer is exactly GPT-2's byte-level one (the bundled model's). For that case only (the
``tokenizer.json`` pre-tokenizer is a plain ``ByteLevel``) this wrapper answers ``"gpt-2"``, with
which llama.cpp reproduces transformers' token ids exactly; any other unknown hash is still
refused as the converter refuses it.

And one more, for the same vocabulary: the converter's Phi-3 (``Phi3MiniModel``) reads only a
SentencePiece ``tokenizer.model`` (a ``GPT2Tokenizer`` aside: Phi-4) and its Gemma 4 (``Gemma4Model``)
only a byte-fallback BPE ``tokenizer.json``, so both refuse a folder whose one tokenizer is a
byte-level BPE — the tiny models ``ropescale conformance`` builds, which carry the bundled one. For
such a folder only (no ``tokenizer.model``; a plain ``ByteLevel`` pre-tokenizer) their vocabulary is
written as the converter's own GPT-2 BPE (``_set_vocab_gpt2``), which is what it does for Phi-4 and,
without a ``tokenizer.model``, for Gemma 3. Nothing else of the conversion changes (the rope keys, the
tensors); a folder with its own tokenizer (the real checkpoints) is converted as the converter does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _byte_level(model_dir: Path) -> bool:
    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel"


# converter classes (module, class) whose vocabulary step refuses a byte-level BPE tokenizer.json alone
VOCAB_AS_GPT2 = (("phi", "Phi3MiniModel"), ("gemma", "Gemma4Model"))


def _vocab_as_gpt2(model_dir: Path) -> None:
    """Phi-3's and Gemma 4's ``set_vocab`` writing the GPT-2 BPE for a folder with a byte-level BPE
    tokenizer.json and no tokenizer.model (see the module docstring); their own otherwise."""
    import importlib

    byte_level_only = _byte_level(model_dir) and not (model_dir / "tokenizer.model").is_file()
    for module, name in VOCAB_AS_GPT2:
        cls = getattr(importlib.import_module(f"conversion.{module}"), name, None)
        if cls is None:
            continue
        own = cls.__dict__.get("_ropescale_own_vocab", cls.set_vocab)
        cls._ropescale_own_vocab = own

        def set_vocab(self, own=own):
            return self._set_vocab_gpt2() if byte_level_only else own(self)

        cls.set_vocab = set_vocab


def convert(request: dict) -> dict:
    """Run llama.cpp's converter (``convert_hf_to_gguf.py`` from ``source``) on the model folder ``model``;
    a request with ``jobs`` converts each. Returns the written GGUF's path (per job)."""
    if "jobs" in request:
        return {"jobs": [_job({k: v for k, v in {**request, **job}.items() if k != "jobs"})
                         for job in request["jobs"]]}
    source = Path(request["source"]).resolve()
    model_dir = Path(request["model"]).resolve()
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))
        sys.path.insert(1, str(source / "gguf-py"))
    import convert_hf_to_gguf
    from conversion import base

    original = getattr(base.TextModel, "_ropescale_original", base.TextModel.get_vocab_base_pre)
    base.TextModel._ropescale_original = original
    chosen = {}

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            res = original(self, tokenizer)
        except NotImplementedError:
            if not _byte_level(model_dir):
                raise
            res = "gpt-2"
        chosen["pre"] = res
        return res

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    _vocab_as_gpt2(model_dir)
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(request["out"]),
                "--outtype", request.get("outtype", "f32")]
    try:
        convert_hf_to_gguf.main()
    except SystemExit as e:  # the converter exits when done, non-zero on failure
        if e.code not in (0, None):
            raise
    return {"out": str(request["out"]), "pre": chosen.get("pre")}


def _job(request: dict) -> dict:
    """One of several conversions: its answer, or ``{"error": line}`` when the converter refuses the
    model (an architecture it does not know, a missing key) — the next job still runs."""
    try:
        return convert(request)
    except (Exception, SystemExit) as e:  # noqa: BLE001 — the converter's refusal is the answer
        return {"out": str(request["out"]), "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}


def main() -> int:
    """Read one JSON request on stdin, write the JSON answer on stdout (the driver protocol)."""
    request_path, result_path = sys.argv[1:3]  # read first: convert() sets sys.argv for the converter
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    result = convert(request)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

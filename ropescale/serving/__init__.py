"""Serve what you measured: a patched model exported for vLLM and llama.cpp, with proof of parity.

The path of every export: strategy → transformers ``rope_parameters`` (the strategy's export
hook, ``ropescale.export``) → one engine's translation by rope type (``vllm``, ``gguf``), and a
one-line ``ExportRefused`` naming the engine and the reason for what it cannot express.
``ropescale_rope`` / ``vllm_rope`` / ``llama_cpp_rope`` say what each side rotates by at a served
length (``EngineRope``); ``compare`` gives the verdict.

    from ropescale.serving import export_for
    export_for(model, "vllm", 1024, "out/yarn-vllm", tokenizer=tok)
"""

from ropescale.serving.export import TARGETS, ExportResult, check_export, export_for
from ropescale.serving.gguf import (
    GgufRope,
    GgufUnavailable,
    gguf_rope,
    llama_cpp_rope,
    read_gguf_rope,
    rewrite_gguf,
)
from ropescale.serving.rope import EngineRope, ExportRefused, Verdict, compare, ropescale_rope
from ropescale.serving.vllm import VllmExport, export_vllm, vllm_rope

__all__ = ["TARGETS", "EngineRope", "ExportRefused", "ExportResult", "GgufRope", "GgufUnavailable", "Verdict",
           "VllmExport", "check_export", "compare", "export_for", "export_vllm", "gguf_rope", "llama_cpp_rope",
           "read_gguf_rope", "rewrite_gguf", "ropescale_rope", "vllm_rope"]

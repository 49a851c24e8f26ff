"""Serve what you measured: a patched model exported for an engine, with proof of parity.

The path of every export: strategy → transformers ``rope_parameters`` (the strategy's export
hook, ``ropescale.models.native_rope_parameters``) → one engine's translation by rope type, and a
one-line ``ExportRefused`` naming the engine and the reason for what it cannot express. The
engines are registered entries (``ropescale.serving.engines``: ``transformers``, ``vllm``,
``llama.cpp``, ``mlx``, ``sglang``, and plugins through the ``ropescale.engines`` entry points);
``export_for`` names none of them. ``ropescale_rope`` / ``vllm_rope`` / ``llama_cpp_rope`` /
``mlx_rope`` / ``sglang_rope`` say what each side rotates
by at a served length (``EngineRope``); ``compare`` gives the verdict — per layer type for a model
with several (Gemma 3: ``ropescale_layer_ropes``, ``vllm_layer_ropes``, ``llama_cpp_layer_ropes``,
``compare_layers``).

    from ropescale.serving import export_for
    export_for(model, "vllm", 1024, "out/yarn-vllm", tokenizer=tok)
"""

from ropescale.serving.engines import ENGINES, Engine, UnknownEngineError, engine_names, get_engine
from ropescale.serving.engines.llama_cpp import gguf_rope, llama_cpp_layer_ropes, llama_cpp_rope
from ropescale.serving.engines.mlx import MlxExport, export_mlx, mlx_layer_ropes, mlx_rope
from ropescale.serving.engines.sglang import SglangExport, export_sglang, sglang_layer_ropes, sglang_rope
from ropescale.serving.engines.vllm import VllmExport, export_vllm, vllm_layer_ropes, vllm_rope
from ropescale.serving.export import ExportResult, check_export, export_for
from ropescale.serving.gguf import GgufRope, GgufUnavailable, read_gguf_rope, rewrite_gguf
from ropescale.serving.rope import (
    EngineRope,
    ExportRefused,
    Verdict,
    compare,
    compare_layers,
    ropescale_layer_ropes,
    ropescale_rope,
)

__all__ = ["ENGINES", "Engine", "EngineRope", "ExportRefused", "ExportResult", "GgufRope", "GgufUnavailable",
           "MlxExport", "SglangExport", "UnknownEngineError", "Verdict", "VllmExport", "check_export", "compare",
           "compare_layers", "engine_names", "export_for", "export_mlx", "export_sglang", "export_vllm", "get_engine",
           "gguf_rope", "llama_cpp_layer_ropes", "llama_cpp_rope", "mlx_layer_ropes", "mlx_rope", "read_gguf_rope",
           "rewrite_gguf", "ropescale_layer_ropes", "ropescale_rope", "sglang_layer_ropes", "sglang_rope",
           "vllm_layer_ropes", "vllm_rope"]

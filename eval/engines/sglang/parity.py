"""SGLang's parity driver: its rotation re-implemented from its sources (it does not run here).

SGLang 0.5.23's wheel requires CUDA 13 packages and its CPU backend is built from source for Intel
Xeon with AMX, so every SGLang row — ropescale's export and, with ``--baseline``, the config as
written or as shipped — is ``sglang_rope`` (``ropescale.serving.engines.sglang``): what SGLang's
config reader and rotary classes compute from that config.json, per layer type where it has
several (its Gemma 3 rotates every layer with ``default``). SGLang reads a folder through
transformers' ``AutoConfig``, so a config.json as shipped (transformers 4 keys: ``rope_scaling``,
``rope_local_base_freq``) is given to ``sglang_rope`` as this process's transformers standardizes it.
"""

from __future__ import annotations

from ropescale.serving.engines.sglang import sglang_layer_ropes

from ..base import Case, EngineDriver, fill, standardized

__all__ = ["SglangDriver"]


class SglangDriver(EngineDriver):
    name = "sglang"
    as_written = "save_patched config.json as written"

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        theirs = sglang_layer_ropes(standardized(folder), case.length)
        ours = case.ours if None in theirs else case.ours_layers or {None: case.ours}
        fill(row, ours, theirs.get(None, theirs), case.length,
             f"re-implementation ({self.engine.rope_source}; SGLang does not run on this CPU)")
        row.export = "config.json as it is"

"""vLLM's parity driver: its own config reader and rotary class, and end-to-end log-probabilities.

Each export becomes a model folder (``exports/vllm/<case>``: the exported config.json, the weights and
tokenizer linked). Where vLLM is installed (``ROPESCALE_VLLM_PYTHON``, ``<root>/vllm``), its driver
script (``vllm_driver.py``) reads every folder through vLLM's ``ModelConfig`` and applies its rotary
class (``get_rope``, ``forward_native``) to unit vectors at positions 0 … L−1 — every angle measured;
positions past its cos/sin cache are a failure. Otherwise the row is ``vllm_rope``'s re-implementation.
``--baseline``: save_patched's config.json given to vLLM as it is.
"""

from __future__ import annotations

import math

import torch

from ropescale.serving.rope import EngineRope

from . import run_engine
from .base import Case, EngineDriver, angle_table_diff, case_name, fill, link_model

__all__ = ["VllmDriver"]


class VllmDriver(EngineDriver):
    name = "vllm"
    python_env = "ROPESCALE_VLLM_PYTHON"
    venv = "vllm"
    script = "vllm_driver.py"
    as_written = "save_patched config.json as written"

    def __init__(self, engine, run):
        super().__init__(engine, run)
        self.pending: list[tuple] = []  # (row, ours, request case)

    def serve(self, row, case: Case, translation) -> None:
        folder = link_model(self.run.src, self.run.exports / "vllm" / case.slug, translation.config)
        if self.installed:
            self.pending.append((row, case.ours, {"model": str(folder), "max_model_len": translation.max_model_len,
                                                  "length": case.length}))
        else:
            self.reimplemented(row, case, translation)
        if case.ids is not None:
            self.jobs.append((row, {"model": str(folder), "max_model_len": translation.max_model_len + 1,
                                    "ids": case.ids, "ours": case.ours_lp}))

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        from ropescale.serving.engines.vllm import vllm_rope

        row.export = f"max_model_len {case.length}; max_position_embeddings as saved"
        if self.installed:
            self.pending.append((row, case.ours, {"model": str(folder), "max_model_len": case.length,
                                                  "length": case.length}))
        else:
            fill(row, case.ours, vllm_rope(config, case.length), case.length,
                 f"re-implementation ({self.engine.rope_source}; vLLM not installed)")
        if case.ids is not None:
            row.notes = "end to end with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
            self.jobs.append((row, {"model": str(folder), "max_model_len": case.length + 1, "ids": case.ids,
                                    "ours": case.ours_lp}))

    def finish(self) -> None:
        if self.pending:
            self.run.say(f"vLLM: rotary classes for {len(self.pending)} exports")
            res = run_engine("vllm", {"mode": "rope", "cases": [c for *_, c in self.pending]}, log_dir=self.run.logs)
            self.version = f"vLLM {res.get('vllm', '?')}"
            asked = [case_name(r) for r, *_ in self.pending]
            for (row, ours, case), got in zip(self.pending, self.answers(res, "cases", asked,
                                                                         ("error", "cos", "sin", "evaluated"))):
                _fill_real(row, ours, got, case["length"], res.get("vllm", "?"))
        self.end_to_end()


def _fill_real(row, ours, got: dict, length: int, version: str) -> None:
    """A row from vLLM's rotary module: θ from the angle at position 1, magnitude from position 0,
    the angle difference over every evaluated position; a cache shorter than L is a failure."""
    source = f"vLLM {version} ModelConfig + get_rope ({got.get('class', '?')}.forward_native)"
    if "error" in got:
        error = got["error"]
        if "Value error, " in error:  # pydantic's wrapping of vLLM's own sentence
            error = error.split("Value error, ", 1)[1].split(" To allow", 1)[0]
        row.source, row.verdict, row.same = source, f"differs: vLLM refuses it: {error}", False
        return
    cos, sin = torch.tensor(got["cos"], dtype=torch.float64), torch.tensor(got["sin"], dtype=torch.float64)
    if cos.shape[0] < 2:
        row.source, row.verdict, row.same = source, "differs: vLLM's rotary module computed no angles", False
        return
    inv = torch.atan2(sin[1], cos[1])
    magnitude = float(torch.hypot(cos[0], sin[0]).mean())
    failure = None
    if got["evaluated"] < length:
        failure = (f"vLLM's cos/sin cache holds {got['cache_length']} positions (NaN past it), fewer than the "
                   f"served {length}")
    theirs = EngineRope(inv, magnitude, 1.0, source, failure)
    fill(row, ours, theirs, length, source,
         angle=angle_table_diff(cos, sin, ours.inv_freq) if failure is None else math.inf)
    row.extra = {"vllm_class": got.get("class"), "cache_length": got.get("cache_length"),
                 "max_position": got.get("max_position")}

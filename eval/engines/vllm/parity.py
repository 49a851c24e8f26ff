"""vLLM's parity driver: its own config reader and rotary class, and end-to-end log-probabilities.

Each export becomes a model folder (``exports/vllm/<case>``: the exported config.json, the weights and
tokenizer linked). Where vLLM is installed (``ROPESCALE_VLLM_PYTHON``, ``<root>/vllm``), its driver
script (``scripts/vllm_driver.py``) reads every folder through vLLM's ``ModelConfig`` and applies its rotary
class (``get_rope``, ``forward_native``) to unit vectors at positions 0 … L−1 — every angle measured;
positions past its cos/sin cache are a failure. Otherwise the row is ``vllm_rope``'s re-implementation.
A per-layer-type export (Gemma 3) is read once per layer type (``rope_parameters[layer_type]``, as
vLLM's model passes each layer's to ``get_rope``) and compared type by type.
``--baseline``: save_patched's config.json given to vLLM as it is.
"""

from __future__ import annotations

import math

import torch

from ropescale.serving.engines.vllm import nested_layer_types, vllm_layer_ropes, vllm_temperature
from ropescale.serving.rope import EngineRope

from .. import process
from ..base import Case, EngineDriver, angle_table_diff, case_name, fill, link_model, sampled_positions, standardized
from . import ENVIRONMENT

__all__ = ["VllmDriver"]


class VllmDriver(EngineDriver):
    name = "vllm"
    environment = ENVIRONMENT
    as_written = "save_patched config.json as written"

    def __init__(self, engine, run):
        super().__init__(engine, run)
        self.pending: list[tuple] = []  # (row, ours, request case)

    def serve(self, row, case: Case, translation) -> None:
        folder = link_model(self.run.src, self.run.exports / "vllm" / case.slug, translation.config,
                            translation.generation)
        if self.installed:
            self._ask(row, case, {"model": str(folder), "max_model_len": translation.max_model_len,
                                  "length": case.length}, translation.config)
        else:
            self.reimplemented(row, case, translation)
        if case.ids is not None:
            self.jobs.append((row, {"model": str(folder), "max_model_len": translation.max_model_len + 1,
                                    "ids": case.ids, "ours": case.ours_lp}))

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        row.export = f"max_model_len {case.length}; max_position_embeddings as saved"
        if self.installed:  # layer types as vLLM's transformers reads them (Gemma 3's rope_local_base_freq …)
            self._ask(row, case, {"model": str(folder), "max_model_len": case.length, "length": case.length},
                      standardized(folder))
        else:
            theirs = vllm_layer_ropes(standardized(folder), case.length)
            ours = case.ours if None in theirs else case.ours_layers
            fill(row, ours, theirs.get(None, theirs), case.length,
                 f"re-implementation ({self.engine.rope_source}; vLLM not installed)")
        if case.ids is not None:
            row.notes = "end to end with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
            self.jobs.append((row, {"model": str(folder), "max_model_len": case.length + 1, "ids": case.ids,
                                    "ours": case.ours_lp}))

    def _ask(self, row, case: Case, request: dict, config: dict) -> None:
        """One rope request for ``row`` — one per layer type (``layer_type`` in the request) for a
        per-layer-type ``config``."""
        positions = sampled_positions(case.length)
        if positions is not None:
            request = {**request, "positions": positions}
        types = nested_layer_types(config)
        if not types:
            self.pending.append((row, case.ours, request))
            return
        for lt in types:
            self.pending.append((row, case.ours_layers, {**request, "layer_type": lt}))

    def finish(self) -> None:
        if self.pending:
            self.run.say(f"vLLM: rotary classes for {len(self.pending)} exports")
            res = process.run_engine(self.name, {"mode": "rope", "cases": [c for *_, c in self.pending]},
                                     log_dir=self.run.logs)
            version = res.get("vllm", "?")
            self.version = f"vLLM {version}"
            asked = [case_name(r) + (f" ({c['layer_type']})" if "layer_type" in c else "") for r, _, c in self.pending]
            got = self.answers(res, "cases", asked, ("error", "cos", "sin", "evaluated"))
            per_type: dict[int, list] = {}
            for (row, ours, case), answer in zip(self.pending, got):
                if "layer_type" in case:  # gathered: one row from every layer type's answer
                    per_type.setdefault(id(row), [row, ours, case["length"], {}])[3][case["layer_type"]] = answer
                else:
                    _fill_real(row, ours, {None: answer}, case["length"], version)
            for row, ours, length, answers in per_type.values():
                _fill_real(row, ours, answers, length, version)
        self.end_to_end()


def _fill_real(row, ours, answers: dict, length: int, version: str) -> None:
    """A row from vLLM's rotary module (``answers``: layer type → the driver's answer; ``{None: ...}``
    for one set, ``ours`` then one ``EngineRope``, else per layer type): θ from the angle at position 1,
    magnitude from position 0, the angle difference over every evaluated position; a cache shorter
    than L is a failure."""
    classes = sorted({str(a.get("class", "?")) for a in answers.values()})
    source = f"vLLM {version} ModelConfig + get_rope ({', '.join(classes)}.forward_native)"
    theirs, angles = {}, []
    for lt, got in answers.items():
        where = "" if lt is None else f"{lt}: "
        if "error" in got:
            error = got["error"]
            if "Value error, " in error:  # pydantic's wrapping of vLLM's own sentence
                error = error.split("Value error, ", 1)[1].split(" To allow", 1)[0]
            row.source, row.verdict, row.same = source, f"differs: {where}vLLM refuses it: {error}", False
            return
        cos, sin = torch.tensor(got["cos"], dtype=torch.float64), torch.tensor(got["sin"], dtype=torch.float64)
        if cos.shape[0] < 2:
            row.source, row.same = source, False
            row.verdict = f"differs: {where}vLLM's rotary module computed no angles"
            return
        failure = None
        if got["evaluated"] < length:
            failure = (f"vLLM's cos/sin cache holds {got['cache_length']} positions (NaN past it), fewer than the "
                       f"served {length}")
        temperature = vllm_temperature({"architectures": got.get("architectures"),
                                        "num_attention_heads": 1, "llama_4_scaling": got.get("llama_4_scaling")})
        theirs[lt] = EngineRope(torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean()),
                                float(got.get("softmax_scale", 1.0)), source, failure, temperature)
        mine = ours[lt] if isinstance(ours, dict) and lt in ours else ours
        angles.append(math.inf if failure is not None or isinstance(mine, dict)
                      else angle_table_diff(cos, sin, mine.inv_freq, got.get("positions")))
    fill(row, ours, theirs.get(None, theirs), length, source, angle=max(angles))
    first = next(iter(answers.values()))
    row.extra = {"vllm_class": first.get("class"), "cache_length": first.get("cache_length"),
                 "max_position": first.get("max_position")}

"""MLX's parity driver: mlx-lm's own model classes and rotary modules, and end-to-end log-probabilities.

Each export becomes a model folder (``exports/mlx/<case>``: the exported config.json, the weights and
tokenizer linked). Where mlx-lm is installed (``ROPESCALE_MLX_PYTHON``, ``<root>/mlx``: ``pip install
"mlx[cpu]" mlx-lm``, which runs on a Linux CPU), its driver script (``scripts/mlx_driver.py``) builds the model
mlx-lm builds from each folder and applies a layer's rotary module to unit vectors at positions
0 … L−1 — one layer per layer type for Gemma 3 — and scores held-out windows end to end; otherwise
the row is ``mlx_rope``'s re-implementation. ``--baseline``: ``save_patched``'s config.json given to
mlx-lm as it is (transformers 5 keys, which mlx-lm's Llama does not read).
"""

from __future__ import annotations

import torch

from ropescale.serving.engines.mlx import GEMMA3, mlx_layer_ropes, mlx_model_type
from ropescale.serving.engines.vllm import nested_layer_types
from ropescale.serving.rope import EngineRope

from .. import process
from ..base import Case, EngineDriver, angle_table_diff, case_name, fill, link_model, sampled_positions
from . import ENVIRONMENT

__all__ = ["MlxDriver"]


def _layer_types(config: dict, per_type: bool) -> list[str | None]:
    """The layer types whose rotary modules mlx-lm is asked for: gemma3_text's two (mlx-lm builds them from
    its own keys, ``rope_local_base_freq`` …); the types a config's ``rope_parameters`` is keyed by (mlx-lm
    0.32.2's gemma4_text builds each type's module from ``rope_parameters[type]``, its global layers at
    ``global_head_dim``) where ropescale rotates per layer type too (``per_type``); else one set
    (``[None]``: layer 0)."""
    if mlx_model_type(config) == GEMMA3:
        return ["full_attention", "sliding_attention"]
    return (nested_layer_types(config) if per_type else []) or [None]


class MlxDriver(EngineDriver):
    name = "mlx"
    environment = ENVIRONMENT
    as_written = "save_patched config.json as written"

    def __init__(self, engine, run):
        super().__init__(engine, run)
        self.pending: list[tuple] = []  # (row, ours, request case)

    def serve(self, row, case: Case, translation) -> None:
        folder = link_model(self.run.src, self.run.exports / "mlx" / case.slug, translation.config)
        self._serve(row, case, folder, translation.config)

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        row.export = "config.json as saved"
        self._serve(row, case, folder, config)

    def _serve(self, row, case: Case, folder, config: dict) -> None:
        types = _layer_types(config, case.ours_layers is not None)
        if self.installed:
            ours = case.ours if types == [None] else case.ours_layers
            positions = sampled_positions(case.length)
            for lt in types:
                self.pending.append((row, ours, {"model": str(folder), "length": case.length, "layer_type": lt,
                                                 **({"positions": positions} if positions else {})}))
        else:
            theirs = mlx_layer_ropes(config, case.length)
            fill(row, case.ours if None in theirs else case.ours_layers, theirs.get(None, theirs), case.length,
                 f"re-implementation ({self.engine.rope_source}; MLX not installed)")
        if case.ids is not None:
            self.jobs.append((row, {"model": str(folder), "ids": case.ids, "ours": case.ours_lp}))

    def finish(self) -> None:
        if self.pending:
            self.run.say(f"MLX: rotary modules for {len(self.pending)} exports")
            res = process.run_engine(self.name, {"mode": "rope", "cases": [c for *_, c in self.pending]},
                                     log_dir=self.run.logs)
            self.version = res.get("mlx", "MLX")
            asked = [case_name(r) + (f" ({c['layer_type']})" if c["layer_type"] else "") for r, _, c in self.pending]
            got = self.answers(res, "cases", asked, ("error", "cos", "sin"))
            rows: dict[int, list] = {}
            for (row, ours, case), answer in zip(self.pending, got):
                rows.setdefault(id(row), [row, ours, case["length"], {}])[3][case["layer_type"]] = answer
            for row, ours, length, answers in rows.values():
                self._fill_real(row, ours, answers, length)
        self.end_to_end()

    def _fill_real(self, row, ours, answers: dict, length: int) -> None:
        """A row from mlx-lm's rotary modules (``answers``: layer type → the driver's answer): θ from the
        angle at position 1, magnitude from position 0, the angle difference over every position."""
        classes = sorted({str(a.get("class", "?")) for a in answers.values()})
        source = f"{self.version} model class + {', '.join(classes)}"
        theirs, angles = {}, []
        for lt, got in answers.items():
            if "error" in got:
                row.source, row.same = source, False
                row.verdict = f"differs: {lt + ': ' if lt else ''}mlx-lm refuses it: {got['error']}"
                return
            cos, sin = torch.tensor(got["cos"], dtype=torch.float64), torch.tensor(got["sin"], dtype=torch.float64)
            theirs[lt] = EngineRope(torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean()),
                                    float(got.get("softmax_scale", 1.0)), source)
            mine = ours[lt] if isinstance(ours, dict) else ours
            angles.append(angle_table_diff(cos, sin, mine.inv_freq, got.get("positions")))
        fill(row, ours, theirs.get(None, theirs), length, source, angle=max(angles))

"""The transformers engine's parity driver: its export loaded back by plain transformers, in process.

``export_for(model, "transformers", L, folder)`` loaded with ``AutoModelForCausalLM.from_pretrained``
(no ropescale), its own rotary module run at positions 0 … L−1 (a dynamic type updates as in
generation's first forward; per layer type for a per-layer-type model: Gemma 3's module takes the
type), and with ``--end-to-end`` its log-probabilities on the held-out windows.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from ropescale.rotary import inv_freq_name, layer_types_of
from ropescale.rotary.quirks import model_softmax_scale
from ropescale.serving.export import export_for
from ropescale.serving.rope import EngineRope

from ..base import Case, EngineDriver, angle_table_diff, e2e_numbers, fill, our_logprobs

__all__ = ["TransformersDriver"]


def _rotation(rotary, length: int, layer_type: str | None, source: str
              ) -> tuple[EngineRope, torch.Tensor, torch.Tensor]:
    """``(EngineRope, cos, sin)``: the rotary module's own cos/sin ``[L, d/2]`` at positions 0 … L−1 (of
    ``layer_type``'s layers for a per-layer-type module), θ from the angle at position 1, the
    magnitude from position 0."""
    with torch.no_grad():
        args = () if layer_type is None else (layer_type,)
        out = rotary(torch.zeros(1, length, 1), torch.arange(length)[None], *args)
    cos, sin = (out.real, out.imag) if torch.is_tensor(out) and out.is_complex() else out  # Llama 4: freqs_cis
    half = rotary._buffers[inv_freq_name(layer_type)].numel()  # d/2 columns, once or twice (gpt-oss: once)
    cos, sin = cos[0, :, :half].double(), sin[0, :, :half].double()
    return EngineRope(torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean()), 1.0, source), cos, sin


class TransformersDriver(EngineDriver):
    """transformers runs in this process: always installed, nothing batched."""

    name = "transformers"
    as_written = "save_patched config.json as written"

    def baseline_ready(self, shipped: bool = False) -> bool:
        """Only a config as shipped: save_patched's folder loaded back is the export row already."""
        return shipped

    def add(self, row, case: Case) -> None:
        folder = self.run.exports / "transformers" / case.slug
        result = export_for(self.run.model, "transformers", case.length, folder, tokenizer=self.run.tokenizer)
        record = json.loads((folder / "ropescale.json").read_text(encoding="utf-8"))
        if not record.get("native"):
            row.source, row.same = "ropescale export", False
            row.verdict = (f"refused: transformers: {row.strategy} has no transformers rope type; plain "
                           "from_pretrained refuses the saved folder (load it with ropescale.load_model)")
            return
        plain = self._compare(row, case, folder)
        row.export = "; ".join(result.notes) or "config.json rope_parameters as saved"
        if case.ids is not None:
            start = time.perf_counter()
            for k, v in e2e_numbers(case.ours_lp, our_logprobs(plain, case.ids)).items():
                setattr(row, k, v)
            row.engine_seconds = round(time.perf_counter() - start, 2)

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        self._compare(row, case, folder)
        row.export = "config.json as it is"

    def _compare(self, row, case: Case, folder):
        """Fill ``row`` from ``folder`` loaded by plain transformers (``from_pretrained``, no ropescale):
        its own rotary module run at positions 0 … L−1, per layer type where it has several.
        Returns the loaded model."""
        import transformers
        from transformers import AutoModelForCausalLM

        source = f"transformers {transformers.__version__} from_pretrained + its rotary module"
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rotary = next(mod for mod in plain.modules() if layer_types_of(mod))
        ours = case.ours_layers or {None: case.ours}
        softmax = model_softmax_scale(plain)  # DeepSeek's mscale², where its attention applies it
        theirs, angles = {}, []
        for lt, mine in ours.items():
            rope, cos, sin = _rotation(rotary, case.length, lt, source)
            theirs[lt] = dataclasses.replace(rope, softmax_scale=softmax)
            angles.append(angle_table_diff(cos, sin, mine.inv_freq))
        if case.ours_layers is None:
            fill(row, case.ours, theirs[None], case.length, source, angle=angles[0])
        else:
            fill(row, ours, theirs, case.length, source, angle=max(angles))
        return plain

    def line(self) -> str:
        import transformers

        return f"transformers {transformers.__version__} (in process)"

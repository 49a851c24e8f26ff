"""The transformers engine's parity driver: its export loaded back by plain transformers, in process.

``export_for(model, "transformers", L, folder)`` loaded with ``AutoModelForCausalLM.from_pretrained``
(no ropescale), its own rotary module run at positions 0 … L−1 (a dynamic type updates as in
generation's first forward), and with ``--end-to-end`` its log-probabilities on the held-out windows.
"""

from __future__ import annotations

import json
import time

import torch

from ropescale.serving.export import export_for
from ropescale.serving.rope import EngineRope

from .base import Case, EngineDriver, angle_table_diff, e2e_numbers, fill, our_logprobs

__all__ = ["TransformersDriver"]


class TransformersDriver(EngineDriver):
    """transformers runs in this process: always installed, nothing batched."""

    name = "transformers"

    def add(self, row, case: Case) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        folder = self.run.exports / "transformers" / case.slug
        result = export_for(self.run.model, "transformers", case.length, folder, tokenizer=self.run.tokenizer)
        record = json.loads((folder / "ropescale.json").read_text(encoding="utf-8"))
        if not record.get("native"):
            row.source, row.same = "ropescale export", False
            row.verdict = (f"refused: transformers: {row.strategy} has no transformers rope type; plain "
                           "from_pretrained refuses the saved folder (load it with ropescale.load_model)")
            return
        source = f"transformers {transformers.__version__} from_pretrained + its rotary module"
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rotary = next(mod for mod in plain.modules() if hasattr(mod, "inv_freq"))
        length = case.length
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, length, 1), torch.arange(length)[None])
        half = cos.shape[-1] // 2
        cos, sin = cos[0, :, :half].double(), sin[0, :, :half].double()
        theirs = EngineRope(torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean()), 1.0, source)
        fill(row, case.ours, theirs, length, source, angle=angle_table_diff(cos, sin, case.ours.inv_freq))
        row.export = "; ".join(result.notes) or "config.json rope_parameters as saved"
        if case.ids is not None:
            start = time.perf_counter()
            for k, v in e2e_numbers(case.ours_lp, our_logprobs(plain, case.ids)).items():
                setattr(row, k, v)
            row.engine_seconds = round(time.perf_counter() - start, 2)

    def line(self) -> str:
        import transformers

        return f"transformers {transformers.__version__} (in process)"

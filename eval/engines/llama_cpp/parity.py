"""llama.cpp's parity driver: the GGUF metadata as its runtime reads it, and end-to-end log-probabilities.

Each export is written into a GGUF (``exports/gguf/<case>.gguf``: the base GGUF — ``--gguf``, else
llama.cpp's own converter run on the model once — with its rope metadata rewritten). Where llama.cpp
is installed (``ROPESCALE_LLAMA_CPP_PYTHON``, ``<root>/llama``), its driver script
(``scripts/llama_cpp_driver.py``) loads every GGUF and answers its metadata as the runtime read it, which
``llama_cpp_rope`` turns into the rotation (the rotation itself runs inside ggml's graph, which
llama-cpp-python does not expose; the end-to-end log-probabilities check it). Otherwise the row is
``llama_cpp_rope`` on the exported metadata. A per-layer-type export (Gemma 3) is compared layer type
by layer type (``llama_cpp_layer_ropes``: the sliding-window layers at ``rope.freq_base_swa``,
unscaled). ``--baseline``: llama.cpp's converter run on save_patched's folder (needs llama.cpp installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ropescale.errors import InvalidInput
from ropescale.serving.engines.llama_cpp import llama_cpp_layer_ropes
from ropescale.serving.gguf import read_gguf_rope, rewrite_gguf
from ropescale.serving.rope import ExportRefused

from .. import process
from ..base import Case, EngineDriver, case_name, fill
from ..process import EngineFailed
from . import ENVIRONMENT, llama_cpp_source

__all__ = ["LlamaCppDriver"]


# architectures whose rope the runtime computes in a way llama_cpp_rope does not re-implement: their rows say so
# (``not run here`` in a conformance table) instead of comparing a rotation the runtime does not use
UNREAD_ARCHS = {"gemma4": "its gemma4 graph's rope (src/models/gemma4.cpp: per layer type rope.dimension_count_swa "
                          "and rope.freq_base_swa on the sliding layers, rope_freqs on the global ones) is not "
                          "re-implemented by llama_cpp_rope"}


def _json_value(text: str) -> Any:
    """A metadata value as llama.cpp prints it (a string) back as a number where it is one."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


class LlamaCppDriver(EngineDriver):
    name = "llama.cpp"
    environment = ENVIRONMENT
    shipped_reader = "its converter (convert_hf_to_gguf.py)"
    e2e_setting = "an f32 KV cache"
    as_written = "llama.cpp's converter on save_patched"

    def __init__(self, engine, run):
        super().__init__(engine, run)
        self.pending: list[tuple] = []  # (row, ours, gguf path, length, rotary dim)
        self.conversions: list[dict] = []  # baseline GGUFs to make with llama.cpp's converter

    def serve(self, row, case: Case, translation) -> None:
        path = None
        if self.installed or self.run.gguf is not None:
            if self.run.gguf is None:
                try:
                    self.run.gguf = self._convert_base()
                except EngineFailed as e:  # its converter refuses the model: no GGUF to rewrite
                    row.source, row.same = "llama.cpp's converter", False
                    row.verdict = f"refused: llama.cpp: its converter cannot convert the model: {e}"
                    return
            try:  # the GGUF's architecture is known only now (Phi-3's reads rope_factors_long/short, not rope_freqs)
                path = rewrite_gguf(self.run.gguf, self.run.exports / "gguf" / f"{case.slug}.gguf", translation)
            except ExportRefused as e:
                row.verdict, row.source, row.same = f"refused: {e}", "ropescale export", False
                return
        if self.installed:
            self.pending.append((row, case, path, translation.dim or case.context["dim"], translation.swa_types))
        else:
            self.reimplemented(row, case, translation)
        if case.ids is not None:
            self.jobs.append((row, {"gguf": str(path), "n_ctx": case.length, "ids": case.ids, "ours": case.ours_lp}))

    def _convert_base(self) -> Path:
        """llama.cpp's converter on the model folder (f32), once per output folder."""
        run = self.run
        dst = run.exports / "gguf" / "base-f32.gguf"
        if dst.is_file():
            return dst
        if "convert_failed" in run.data:  # once per output folder, a refusal too
            raise EngineFailed(run.data["convert_failed"])
        source = llama_cpp_source()
        if source is None:
            raise InvalidInput("no llama.cpp source with convert_hf_to_gguf.py (bench/engines/install.sh puts it in "
                               "<prefix>/llama/src/llama.cpp; or set ROPESCALE_LLAMA_CPP_SOURCE, or give --gguf "
                               "BASE.gguf)")
        run.say(f"llama.cpp: converting {run.src.name} to GGUF (f32) with llama.cpp's converter")
        dst.parent.mkdir(parents=True, exist_ok=True)
        got = process.run_engine(self.name, {"mode": "convert", "source": str(source), "outtype": "f32",
                                             "jobs": [{"model": str(run.src), "out": str(dst)}]},
                                 script="convert_gguf.py", log_dir=run.logs)
        error = (got.get("jobs") or [{}])[0].get("error")
        if error:
            run.data["convert_failed"] = error
            raise EngineFailed(error)
        return dst

    @classmethod
    def not_ready(cls) -> str | None:
        """llama.cpp installed but its converter (``convert_hf_to_gguf.py``), which its rows of a model without a
        GGUF need, not found."""
        if cls.environment.python() is not None and llama_cpp_source() is None:
            return ("llama.cpp is installed but its converter (convert_hf_to_gguf.py) is not found: set "
                    "ROPESCALE_LLAMA_CPP_SOURCE or install with bench/engines/install.sh")
        return None

    def baseline_ready(self, shipped: bool = False) -> bool:
        return self.installed  # the converter runs in llama.cpp's environment

    def add_baseline(self, row, case: Case, folder, config: dict) -> None:
        path = self.run.exports / "as-written" / f"{case.slug}.gguf"
        row.export = "GGUF from convert_hf_to_gguf.py"
        self.conversions.append({"model": str(folder), "out": str(path)})
        # the converter writes a per-layer-type model's sliding base as rope.freq_base_swa
        swa = {lt: "sliding" in lt for lt in case.ours_layers} if case.ours_layers else {}
        self.pending.append((row, case, path, case.context["dim"], swa))
        if case.ids is not None:
            self.jobs.append((row, {"gguf": str(path), "n_ctx": case.length, "ids": case.ids, "ours": case.ours_lp}))

    def finish(self) -> None:
        run = self.run
        if self.conversions:
            source = llama_cpp_source()
            if source is None:
                raise InvalidInput("--baseline needs llama.cpp's converter (convert_hf_to_gguf.py): set "
                                   "ROPESCALE_LLAMA_CPP_SOURCE or install with bench/engines/install.sh")
            run.say(f"llama.cpp: converting {len(self.conversions)} save_patched folders with llama.cpp's converter")
            got = process.run_engine(self.name, {"mode": "convert", "source": str(source), "outtype": "f32",
                                                 "jobs": self.conversions}, script="convert_gguf.py", log_dir=run.logs)
            refused = {j.get("out"): j["error"] for j in got.get("jobs", []) if "error" in j}
            for row, _, path, _, _ in [p for p in self.pending if str(p[2]) in refused]:
                row.source, row.same = "llama.cpp's converter", False
                row.verdict = f"differs: llama.cpp's converter refuses it: {refused[str(path)]}"
            self.pending = [p for p in self.pending if str(p[2]) not in refused]
            self.jobs = [(r, j) for r, j in self.jobs if j["gguf"] not in refused]
        if self.pending:
            run.say(f"llama.cpp: runtime metadata of {len(self.pending)} GGUFs")
            res = process.run_engine(self.name, {"mode": "rope", "cases": [{"gguf": str(p), "n_ctx": c.length}
                                                                           for _, c, p, _, _ in self.pending]},
                                     log_dir=run.logs)
            version = res.get("llama_cpp", "?")
            self.version = f"llama-cpp-python {version}"
            asked = [case_name(r) for r, *_ in self.pending]
            for (row, case, path, dim, swa), got in zip(self.pending,
                                                        self.answers(res, "cases", asked, ("error", "meta"))):
                if "error" in got:
                    row.source, row.same = f"llama.cpp {version} runtime", False
                    row.verdict = f"differs: llama.cpp refuses it: {got['error']}"
                    continue
                kv = {k: _json_value(v) for k, v in got["meta"].items()}
                arch = str(kv.get("general.architecture", ""))
                if arch in UNREAD_ARCHS:
                    row.source, row.same = f"llama.cpp {version} runtime", False
                    row.verdict = f"differs: llama.cpp {version} loads it; {UNREAD_ARCHS[arch]}"
                    continue
                _, tensors = read_gguf_rope(path)
                theirs = llama_cpp_layer_ropes(kv, tensors, case.length, dim, swa)
                fill(row, case.ours if None in theirs else case.ours_layers, theirs.get(None, theirs), case.length,
                     f"llama.cpp {version} runtime metadata + llama_cpp_rope")
        self.end_to_end()

"""One call to write a patched model for an engine: ``export_for(model, target, serve_length, output)``.

Targets: ``transformers`` (``ropescale.save_patched``, plus ``max_position_embeddings`` raised to the
served length; ⌈T·s⌉ for YaRN, the ratio transformers checks the factor against), ``vllm`` (that
folder with vLLM's config.json and ``vllm.json``: ``ropescale.serving.vllm``), ``gguf``
(``OUT/model.gguf``, an existing GGUF with its rope metadata rewritten: ``ropescale.serving.gguf``).
Refusals happen before anything is written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ropescale.errors import InvalidInput
from ropescale.models import save_patched
from ropescale.serving.gguf import gguf_rope, rewrite_gguf
from ropescale.serving.rope import check_length, patch_handle
from ropescale.serving.vllm import export_vllm

__all__ = ["TARGETS", "VLLM_FILE", "ExportResult", "export_for"]

TARGETS = ("transformers", "vllm", "gguf")
VLLM_FILE = "vllm.json"


@dataclass
class ExportResult:
    """What ``export_for`` wrote: ``path`` (the model folder, or the ``.gguf`` file), the served
    length [tokens] (None for a plain transformers export), notes, and the command that serves it."""

    target: str
    path: Path
    serve_length: int | None
    notes: list[str] = field(default_factory=list)
    command: str | None = None


def export_for(model, target: str, serve_length: int | None, output, *, tokenizer=None, gguf=None,
               freeze_dynamic_at: int | None = None) -> ExportResult:
    """Write the patched ``model`` for ``target`` (``"transformers"``, ``"vllm"`` or ``"gguf"``) to serve
    ``serve_length`` = L tokens, into the folder ``output``.

    ``tokenizer``: saved beside the weights (transformers, vllm; required there). ``gguf``: the
    GGUF of the *unpatched* model to rewrite (gguf; required), e.g. llama.cpp's
    ``convert_hf_to_gguf.py`` output. ``freeze_dynamic_at``: the length F dynamic NTK is frozen at
    (vllm: default L; gguf: required for dynamic NTK).

    Raises ``ExportRefused`` (one line naming the engine) for what the engine cannot express,
    ``InvalidInput`` for an unknown target, a missing tokenizer/GGUF/served length or an unpatched
    model, ``GgufUnavailable`` without the ``gguf`` package (gguf target).
    """
    if target not in TARGETS:
        raise InvalidInput(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    handle = patch_handle(model)
    output = Path(output)
    if target == "gguf":
        if gguf is None:
            raise InvalidInput("the gguf target rewrites an existing GGUF: give the base model's (--gguf BASE.gguf)")
        length = check_length(serve_length)
        rope = gguf_rope(handle, length, freeze_dynamic_at=freeze_dynamic_at)
        path = rewrite_gguf(gguf, output / "model.gguf", rope)
        return ExportResult(target, path, length, rope.notes, f"llama-cli -m {path} -c {length}")
    if tokenizer is None:
        raise InvalidInput(f"the {target} target writes a model folder: give the tokenizer too")
    if target == "vllm":
        length = check_length(serve_length)
        export = export_vllm(handle, length, freeze_dynamic_at=freeze_dynamic_at)
        save_patched(model, tokenizer, output)
        (output / "config.json").write_text(json.dumps(export.config, indent=2, sort_keys=True, default=str) + "\n",
                                            encoding="utf-8")
        record = {"max_model_len": export.max_model_len, "hf_overrides": export.hf_overrides, "notes": export.notes}
        (output / VLLM_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
        return ExportResult(target, output, length, export.notes, export.serve_command(str(output)))
    length = None if serve_length is None else check_length(serve_length)
    notes = []
    path = save_patched(model, tokenizer, output)
    if length is not None:
        config_file = path / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        rp = config.get("rope_parameters") or {}
        if handle.strategy_obj.dynamic and handle.strategy != "longrope":
            notes.append("max_position_embeddings kept at the training window: transformers' dynamic rope reads it "
                         "as the window it rescales from")
        elif rp.get("rope_type") == "yarn" and "original_max_position_embeddings" in rp:
            # transformers warns on every load unless max_position_embeddings / T equals the factor
            mpe = math.ceil(rp["original_max_position_embeddings"] * rp["factor"])
            config["max_position_embeddings"] = mpe
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            notes.append(f"yarn: max_position_embeddings = ⌈T·s⌉ = {mpe} (transformers checks it against the factor)")
        elif "max_position_embeddings" in config and config["max_position_embeddings"] < length:
            config["max_position_embeddings"] = length
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            notes.append(f"max_position_embeddings = {length} (the served length)")
    return ExportResult(target, path, length, notes)

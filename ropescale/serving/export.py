"""One call to write a patched model for an engine: ``export_for(model, target, serve_length, output)``.

Targets: ``transformers`` (``ropescale.save_patched``, plus ``max_position_embeddings`` raised to the
served length; ⌈T·s⌉ for YaRN, the ratio transformers checks the factor against), ``vllm`` (that
folder with vLLM's config.json and ``vllm.json``: ``ropescale.serving.vllm``), ``gguf``
(``OUT/model.gguf``, an existing GGUF with its rope metadata rewritten: ``ropescale.serving.gguf``).
Refusals happen before anything is written (``check_export``: the checks that need no model, for a
command line to run before loading one), and the files are written into a staging folder moved
into place once complete (``ropescale.serving.output``): a full disk leaves no half export.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ropescale.errors import InvalidInput
from ropescale.models import save_patched
from ropescale.serving.gguf import gguf_rope, rewrite_gguf
from ropescale.serving.output import check_output, same_path, staged
from ropescale.serving.plan import check_freeze, static_equivalent
from ropescale.serving.rope import check_length, patch_handle
from ropescale.serving.vllm import export_vllm

__all__ = ["TARGETS", "VLLM_FILE", "ExportResult", "check_export", "export_for"]

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


def check_export(target: str, serve_length: int | None, output, *, gguf=None, freeze_dynamic_at: int | None = None,
                 source=None) -> tuple[int | None, Path]:
    """The checks of ``export_for`` that need no model: ``(L, output)`` — the served length
    (``check_length``: [2, 2^24] tokens; None for a transformers export without one) and the output
    folder — once they pass. ``source``: the model's folder, which the output may not be.

    Raises ``InvalidInput`` (one line) for an unknown target, a served length missing (vllm, gguf)
    or out of range, a ``freeze_dynamic_at`` out of range, a GGUF given to a target that does not
    read it, or missing / not a file / the output's ``model.gguf`` for the gguf target;
    ``OutputError`` (``ropescale.serving.output.check_output``) for an output that is a file, not
    writable, or ``source``. Creates nothing.
    """
    if target not in TARGETS:
        raise InvalidInput(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    if gguf is not None and target != "gguf":
        raise InvalidInput(f"a GGUF to rewrite (--gguf {gguf}) is read by the gguf target only; the {target} target "
                           "writes a model folder from the weights: leave --gguf out, or use --engine llama.cpp")
    if target == "gguf" and gguf is None:
        raise InvalidInput("the gguf target rewrites an existing GGUF: give the base model's (--gguf BASE.gguf)")
    length = None if serve_length is None and target == "transformers" else check_length(serve_length)
    if freeze_dynamic_at is not None:
        check_length(freeze_dynamic_at, "freeze_dynamic_at")
    output = check_output(output, source=source)
    if target == "gguf":
        if not Path(gguf).is_file():
            raise InvalidInput(f"{gguf}: no such GGUF file")
        if same_path(output / "model.gguf", gguf):
            raise InvalidInput(f"{output / 'model.gguf'}: writing over the source GGUF; choose another output folder")
    return length, output


def _source_folder(model) -> Path | None:
    """The local folder ``model`` was loaded from (transformers' ``name_or_path``), or None (a hub
    id, a model built in memory)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return Path(name) if name and Path(str(name)).is_dir() else None


def export_for(model, target: str, serve_length: int | None, output, *, tokenizer=None, gguf=None,
               freeze_dynamic_at: int | None = None) -> ExportResult:
    """Write the patched ``model`` for ``target`` (``"transformers"``, ``"vllm"`` or ``"gguf"``) to serve
    ``serve_length`` = L tokens, into the folder ``output``.

    ``tokenizer``: saved beside the weights (transformers, vllm; required there). ``gguf``: the
    GGUF of the *unpatched* model to rewrite (gguf only; required), e.g. llama.cpp's
    ``convert_hf_to_gguf.py`` output. ``freeze_dynamic_at``: the length F dynamic NTK is frozen at
    (vllm: default L; gguf: required for dynamic NTK); refused for the transformers target, whose
    ``dynamic`` rope type recomputes the base from the length as ropescale does (the export is
    exact unfrozen, and a frozen config.json would contradict the ``ropescale.json`` that
    ``load_model`` restores; the message names the static strategy to patch instead).

    Everything is checked before anything is written; the files are written into a staging
    folder and moved into ``output`` once complete (an existing folder keeps its other files).

    Raises ``ExportRefused`` (one line naming the engine) for what the engine cannot express,
    ``InvalidInput`` for an unknown target, a missing tokenizer/GGUF/served length, a length past
    2^24, a GGUF for another target, ``freeze_dynamic_at`` with a strategy other than dynamic NTK
    or with the transformers target, or an unpatched model; ``OutputError`` for an output that is
    a file, not writable, the model's own folder, or that could not be written (a full disk: the
    output is left as it was); ``GgufUnavailable`` without the ``gguf`` package (gguf target).
    """
    length, output = check_export(target, serve_length, output, gguf=gguf, freeze_dynamic_at=freeze_dynamic_at,
                                  source=_source_folder(model))
    handle = patch_handle(model)
    freeze = check_freeze(handle, freeze_dynamic_at)
    if freeze is not None and target == "transformers":
        raise InvalidInput(f"freeze_dynamic_at={freeze} (--freeze-dynamic-at) is for the engines that serve one static "
                           "rotation (vllm, gguf): transformers' dynamic rope type recomputes the base from the "
                           "length as ropescale does, so this export is exact unfrozen; for a static model with the "
                           f"rotation of {freeze} tokens, patch {static_equivalent(handle, freeze)} instead")
    if target == "gguf":
        rope = gguf_rope(handle, length, freeze_dynamic_at=freeze)
        path = rewrite_gguf(gguf, output / "model.gguf", rope)  # staged there: whole or nothing
        return ExportResult(target, path, length, rope.notes, f"llama-cli -m {path} -c {length}")
    if tokenizer is None:
        raise InvalidInput(f"the {target} target writes a model folder: give the tokenizer too")
    if target == "vllm":
        export = export_vllm(handle, length, freeze_dynamic_at=freeze)
        with staged(output) as stage:
            save_patched(model, tokenizer, stage)
            (stage / "config.json").write_text(json.dumps(export.config, indent=2, sort_keys=True, default=str) + "\n",
                                               encoding="utf-8")
            record = {"max_model_len": export.max_model_len, "hf_overrides": export.hf_overrides,
                      "notes": export.notes}
            (stage / VLLM_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
        return ExportResult(target, output, length, export.notes, export.serve_command(str(output)))
    notes = []
    with staged(output) as stage:
        save_patched(model, tokenizer, stage)
        if length is not None:
            notes = _serve_length_notes(handle, stage / "config.json", length)
    return ExportResult(target, output, length, notes)


def _serve_length_notes(handle, config_file: Path, length: int) -> list[str]:
    """The transformers target's ``max_position_embeddings`` for the served length (written into
    ``config_file``), and the notes saying what was decided."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    rp = config.get("rope_parameters") or {}
    if handle.strategy_obj.dynamic and handle.strategy != "longrope":
        return ["max_position_embeddings kept at the training window: transformers' dynamic rope reads it as the "
                "window it rescales from"]
    if rp.get("rope_type") == "yarn" and "original_max_position_embeddings" in rp:
        # transformers warns on every load unless max_position_embeddings / T equals the factor
        mpe = math.ceil(rp["original_max_position_embeddings"] * rp["factor"])
        note = f"yarn: max_position_embeddings = ⌈T·s⌉ = {mpe} (transformers checks it against the factor)"
    elif "max_position_embeddings" in config and config["max_position_embeddings"] < length:
        mpe, note = length, f"max_position_embeddings = {length} (the served length)"
    else:
        return []
    config["max_position_embeddings"] = mpe
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [note]

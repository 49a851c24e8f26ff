"""The transformers engine: the patched model saved so that plain ``from_pretrained`` reproduces it.

``save_patched`` writes the patch into config.json's ``rope_parameters`` where transformers has the
rope type (``ropescale.models.exported_config``, from each strategy's export hook), plus
``ropescale.json``; other strategies get a marker transformers refuses (load them with
``ropescale.load_model``). With a served length L, ``max_position_embeddings`` is raised to L
(⌈T·s⌉ for YaRN, the ratio transformers checks the factor against; kept as it is where a written
rope type is dynamic, which transformers reads as the window it rescales from). Then the folder is
loaded back with plain ``from_pretrained`` and its logits compared with the patched model's
(``ropescale.serving.plain.check_plain``, at positions up to max(L, 4T)): only then is it said to
reproduce the patch; where it does not, the folder is rewritten with the marker
(``ropescale.models.save_unexpressed``) and a note says by how much it differed.

transformers recomputes dynamic NTK from the length as ropescale does, so this engine is not
``static``: the export is exact unfrozen and ``freeze_dynamic_at`` is refused. Its rope is
transformers' own code, run in process by the parity harness (``eval/engines/transformers_engine.py``).

Notation: T = training window (``original_max_position_embeddings``), s = ``factor``, L = served length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ropescale.errors import InvalidInput
from ropescale.models import PATCH_FILE, save_patched, save_unexpressed
from ropescale.patching import PatchHandle
from ropescale.runs.memory import device_available, fmt_gib
from ropescale.serving.engines import ENGINES, Engine
from ropescale.serving.output import staged
from ropescale.serving.plain import check_plain
from ropescale.serving.plan import static_equivalent

__all__ = ["TransformersEngine", "TransformersExport"]


@dataclass
class TransformersExport:
    """What the transformers engine writes: the patch ``handle`` at ``serve_length`` [tokens] (None:
    ``max_position_embeddings`` left as it is); notes: what the export decided."""

    handle: PatchHandle
    serve_length: int | None
    notes: list[str] = field(default_factory=list)


class TransformersEngine(Engine):
    """Plain transformers: ``save_patched``'s folder, ``max_position_embeddings`` for the served length."""

    name = "transformers"
    static = False

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None) -> TransformersExport:
        """Refuses ``freeze_dynamic_at`` (``InvalidInput``, naming the static strategy with the
        rotation of that length): transformers' ``dynamic`` type recomputes the base from the
        length, and a frozen config.json would contradict the ``ropescale.json`` that
        ``load_model`` restores."""
        if freeze_dynamic_at is not None:
            static = ", ".join(n for n, cls in sorted(ENGINES.items()) if cls.static)
            raise InvalidInput(f"freeze_dynamic_at={freeze_dynamic_at} (--freeze-dynamic-at) is for the engines that "
                               f"serve one static rotation ({static}): transformers' dynamic rope type recomputes the "
                               "base from the length as ropescale does, so this export is exact unfrozen; for a static "
                               f"model with the rotation of {freeze_dynamic_at} tokens, patch "
                               f"{static_equivalent(handle, freeze_dynamic_at)} instead")
        return TransformersExport(handle, serve_length)

    def write(self, model, tokenizer, translation: TransformersExport, output: Path, *, gguf=None
              ) -> tuple[Path, list[str]]:
        notes = []
        with staged(output) as stage:
            save_patched(model, tokenizer, stage)
            if translation.serve_length is not None:
                notes = _serve_length_notes(translation.handle, stage / "config.json", translation.serve_length)
            notes += _checked(model, translation, stage)
        return output, notes

    def usage(self, translation, path: Path, command: str | None) -> str:
        """Whether plain transformers reproduces the patch (``native`` in ``ropescale.json``: set only
        where ``write`` has checked it)."""
        record = json.loads((path / PATCH_FILE).read_text(encoding="utf-8"))
        native = record["native"]
        if native and record.get("plain_checked") is False:
            return ("plain transformers (AutoModelForCausalLM.from_pretrained) loads it with the rope parameters "
                    "written (not checked here: see the note)")
        return ("plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it" if native else
                "transformers cannot express this strategy: load it with ropescale.load_model "
                "(plain from_pretrained refuses it rather than run vanilla RoPE)")


def _checked(model, translation: TransformersExport, stage: Path) -> list[str]:
    """Plain ``from_pretrained`` of the written ``stage`` against the patched ``model`` (where the
    patch was written as transformers rope parameters): a note saying what was compared, and the
    folder rewritten so that plain transformers refuses it when the logits differ."""
    record = json.loads((stage / PATCH_FILE).read_text(encoding="utf-8"))
    if not record.get("native"):
        return []
    param = next(model.parameters())
    copy = sum(p.numel() * p.element_size() for p in model.parameters())  # the reload's second copy [bytes]
    free = device_available(param.device)
    if free is not None and copy > 0.8 * free:  # an 8B float32 model on a host without room for a second copy
        record["plain_checked"] = False
        (stage / PATCH_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        return [f"not checked against plain from_pretrained: a second copy of the weights ({fmt_gib(copy)}) does not "
                f"fit the {fmt_gib(free)} free on {param.device}; config.json holds the transformers rope parameters"]
    window = translation.handle.context.get("original_max_position_embeddings") or 0
    result = check_plain(model, stage, far=max(translation.serve_length or 0, 4 * window))
    if result.same:
        return [f"checked: plain from_pretrained of the folder gives the patched model's logits ({result.line})"]
    save_unexpressed(model, stage)
    return [f"plain from_pretrained of the transformers rope parameters does not reproduce the patch ({result.line}): "
            "written for ropescale.load_model only"]


def _keeps_window(handle, rope_parameters: dict) -> bool:
    """Whether ``max_position_embeddings`` must stay as it is: a written rope type is dynamic (transformers
    reads it as the window it rescales from), or a dynamic strategy is written with the marker."""
    kinds = [str(rp.get("rope_type", "")) for rp in (rope_parameters, *rope_parameters.values())
             if isinstance(rp, dict) and "rope_type" in rp]
    marked = any(kind.startswith("ropescale:") for kind in kinds)
    return any("dynamic" in kind for kind in kinds if not kind.startswith("ropescale:")) or (
        marked and handle.strategy_obj.dynamic)


def _serve_length_notes(handle, config_file: Path, length: int) -> list[str]:
    """The transformers engine's ``max_position_embeddings`` for the served length (written into
    ``config_file``), and the notes saying what was decided."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    rp = config.get("rope_parameters") or {}
    if _keeps_window(handle, rp):
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

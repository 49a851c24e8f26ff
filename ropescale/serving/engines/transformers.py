"""The transformers engine: the patched model saved so that plain ``from_pretrained`` reproduces it.

``save_patched`` writes the patch into config.json's ``rope_parameters`` where transformers has the
rope type (``ropescale.models.exported_config``, from each strategy's export hook), plus
``ropescale.json``; other strategies get a marker transformers refuses (load them with
``ropescale.load_model``). With a served length L, ``max_position_embeddings`` is raised to L
(⌈T·s⌉ for YaRN, the ratio transformers checks the factor against; kept at T for a dynamic rope,
which transformers reads as the window it rescales from).

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
from ropescale.models import PATCH_FILE, save_patched
from ropescale.patching import PatchHandle
from ropescale.serving.engines import ENGINES, Engine
from ropescale.serving.output import staged
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
        return output, notes

    def usage(self, translation, path: Path, command: str | None) -> str:
        """Whether plain transformers reproduces the patch (``native`` in ``ropescale.json``)."""
        native = json.loads((path / PATCH_FILE).read_text(encoding="utf-8"))["native"]
        return ("plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it" if native else
                "transformers cannot express this strategy: load it with ropescale.load_model "
                "(plain from_pretrained refuses it rather than run vanilla RoPE)")


def _serve_length_notes(handle, config_file: Path, length: int) -> list[str]:
    """The transformers engine's ``max_position_embeddings`` for the served length (written into
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

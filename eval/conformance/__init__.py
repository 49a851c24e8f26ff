"""``ropescale conformance``: how each serving engine rotates a model's config *as shipped*.

No patch: for each shipped config (``configs/*.json``: the hub config.json's shape and rope keys,
as the model's authors publish them) a tiny random model is built with every rope key unchanged
(``build_tiny``: fewer layers, heads, experts and a 4,096-token vocabulary; ``head_dim``, the
rotary dims, the windows and the layer-type pattern kept), and ``ropescale parity --strategy native
--baseline`` is run on it at the length the config serves (capped at ``LENGTH_CAP``): every
engine is given that config.json as it is and reads it with its own code — transformers'
``from_pretrained`` and rotary module; vLLM's ``ModelConfig`` + ``get_rope``; llama.cpp's converter
and runtime metadata; mlx-lm's model class; SGLang's, re-implemented from its sources — and its
rotation is compared, layer type by layer type, with what transformers rotates by. Each cell is
``same``, ``differs`` (by how much, on which layer types, with the engine's version), ``cannot
express`` (the engine refuses the config) or ``not run here`` (what stops the engine here whatever
the rope keys, said: ``NOT_RUN``; llama.cpp without its converter, ``unread_cells``). The second
table is ropescale's own ``native`` export for each engine (``patch --strategy native --engine E``):
what serving through ropescale changes.

Rotation only (frequencies per rotary pair, the cos/sin magnitude): the attention-side terms some of
these configs carry — Llama 4's and Ministral 3's query temperatures, DeepSeek's mscale² on the
softmax — are not in the cells; ``docs/serving.md`` names what was read about them.

A config of one's own: a JSON file like those in ``configs/`` (``name``, ``hub``, ``what``, ``config``:
the config.json as shipped, ``tiny``: the keys that shrink it) passed by path. Its ``name`` (default:
the file's stem) names its folders in the output folder: a plain file name, one config's alone.

Errors (one line each), all but the last two before anything is written (``check_inputs``):
``InvalidInput`` for an unknown config name, a file that is not such a JSON object, a name that is
not a plain file name or is another config's, a length or ``max_position_embeddings`` that is not a
whole number of tokens, an unknown engine or none; ``OutputError`` for an unusable output folder or
a path that would lead out of it; ``InvalidInput`` for a tiny model transformers cannot build; what
``run_parity`` raises.
"""

from __future__ import annotations

import copy
import csv
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ropescale.errors import InvalidInput

__all__ = ["CONFIGS", "LENGTH_CAP", "NOT_RUN", "Cell", "Shipped", "build_tiny", "cell_of", "check_inputs",
           "load_shipped", "markdown", "run_conformance", "shipped_names", "tiny_config", "unread_cells",
           "write_conformance"]

CONFIGS = Path(__file__).parent / "configs"
LENGTH_CAP = 131072  # the longest length a cell is measured at [tokens]: every shipped window's 128k reach
PER_LAYER = ("layer_types", "no_rope_layers")  # per-layer lists: cut to the tiny model's layers


@dataclass(frozen=True)
class Shipped:
    """One shipped config: ``name``; ``hub``: where it is published; ``what``: its rope in a line;
    ``config``: the config.json keys as shipped; ``tiny``: the keys replaced to make it tiny;
    ``length``: the served length L [tokens] its cells are measured at (default: its
    ``max_position_embeddings``, at most ``LENGTH_CAP``)."""

    name: str
    hub: str
    what: str
    config: dict[str, Any]
    tiny: dict[str, Any]
    length: int


def shipped_names() -> list[str]:
    """The bundled shipped configs' names (``configs/<name>.json``), sorted."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def load_shipped(name_or_path: str) -> Shipped:
    """The shipped config ``name_or_path``: a JSON file of the form of the bundled ones, or a bundled
    name (``shipped_names``). ``InvalidInput`` (one line) for an unknown name, a malformed file, a
    ``name`` that is not a plain file name (``checks.check_name``), or a ``length`` or
    ``max_position_embeddings`` (``config``'s, ``tiny``'s) that is not a whole number of tokens >= 2."""
    from ropescale.serving.rope import MAX_LENGTH

    from .checks import check_name, check_tokens

    where = f"--config {name_or_path}"
    path = Path(name_or_path)
    if not path.is_file():
        if name_or_path not in shipped_names():
            raise InvalidInput(f"{where}: not a shipped config ({', '.join(shipped_names())}) nor a JSON file")
        path = CONFIGS / f"{name_or_path}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        config, tiny = raw["config"], raw.get("tiny", {})
        if not isinstance(config, dict) or not isinstance(tiny, dict):
            raise TypeError("config and tiny must be objects")
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidInput(f"{where}: not a shipped-config JSON object with a 'config' "
                           f"({type(e).__name__}: {e})") from None
    for part, keys in (("config", config), ("tiny", tiny)):
        if keys.get("max_position_embeddings") is not None:
            check_tokens(keys["max_position_embeddings"], f"{where}: {part}.max_position_embeddings")
    mpe = config.get("max_position_embeddings") or LENGTH_CAP
    length = min(mpe, LENGTH_CAP) if raw.get("length") is None else \
        check_tokens(raw["length"], f"{where}: length", at_most=MAX_LENGTH)
    name = check_name(path.stem if raw.get("name") is None else raw["name"], where)
    return Shipped(name, str(raw.get("hub", "")), str(raw.get("what", "")), config, tiny, length)


def tiny_config(entry: Shipped) -> dict[str, Any]:
    """``entry``'s config.json with its ``tiny`` keys, the per-layer lists (``layer_types``,
    ``no_rope_layers``) cut to the tiny model's layers and the bundled tokenizer's special ids;
    every rope key as shipped."""
    config = copy.deepcopy(entry.config) | copy.deepcopy(entry.tiny)
    n = config.get("num_hidden_layers")
    for key in PER_LAYER:
        if isinstance(config.get(key), list) and n is not None:
            config[key] = config[key][:n]
    config.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return config


def build_tiny(entry: Shipped, folder: Path, *, seed: int = 0) -> Path:
    """A model folder for ``entry``: ``tiny_config`` as config.json (written last, keys as shipped —
    ``save_pretrained`` would rewrite them in transformers' own form), random float32 weights
    (seeded) and the bundled reference model's tokenizer. Returns ``folder``; ``InvalidInput`` (one
    line) when transformers cannot build the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ropescale.models import REFERENCE_MODEL

    config = tiny_config(entry)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 — transformers' reason, in one line
        raise InvalidInput(f"{entry.name}: transformers cannot build it: {type(e).__name__}: "
                           f"{' '.join(str(e).split())[:300]}") from None
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REFERENCE_MODEL / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return folder


@dataclass
class Cell:
    """One shipped config × engine: ``kind`` ``same`` / ``differs`` / ``cannot express`` / ``not run here``; ``text``:
    the verdict in full; ``max_rel_freq_diff``; ``source``: where the engine's numbers came from."""

    config: str
    engine: str
    exported_by: str
    kind: str
    text: str
    max_rel_freq_diff: float | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# what stops an engine here whatever the rope keys — neither a verdict on the config nor a refusal of it: vLLM's
# model module failing to import in its CPU environment (Qwen3.5's needs torchvision); llama.cpp's Phi-3
# converter wanting a SentencePiece tokenizer.model and its Gemma 4 one a vocabulary it knows (the tiny models
# carry the bundled BPE tokenizer); its Qwen3.5 graph wanting the multi-token-prediction layer's weights
# (transformers' model has none); what the harness does not read yet (vLLM's per-layer head_dim of Gemma 4, a
# rope type ropescale has not re-implemented for an engine that does not run here)
NOT_RUN = ("failed to be inspected", "tokenizer.model", "' not found", "Cannot find Llama BPE tokenizer",
           "AmbiguousGlobalPerLayerAttributeError", "not re-implemented")


def cell_of(config: str, row) -> Cell:
    """The cell of a parity ``row`` (``eval.parity.ParityRow``) for shipped config ``config``: ``same``; ``not run
    here`` for what stops the engine here whatever the config (``NOT_RUN``); ``cannot express`` for a refusal
    (the engine's or ropescale's export's); else ``differs``."""
    verdict = row.verdict
    if row.same:
        kind = "same"
    elif any(s in verdict for s in NOT_RUN):
        kind = "not run here"
    elif verdict.startswith("refused") or "refuses" in verdict:
        kind = "cannot express"
    else:
        kind = "differs"
    return Cell(config, row.engine, row.exported_by, kind, verdict, row.max_rel_freq_diff, row.source)


def run_conformance(names: list[str], *, engines: list[str], output: str | Path, length: int | None = None,
                    say: Callable[[str], None] | None = None) -> tuple[list[Cell], dict]:
    """``(cells, meta)`` for the shipped configs ``names`` (names or JSON paths; see ``load_shipped``)
    × ``engines``: each config's tiny model built under ``output/models/<name>``, then
    ``run_parity(..., native, baseline=True)`` at its length (``length`` [tokens] for every
    config instead) into ``output/<name>``. Cells with ``exported_by`` = ``AS_SHIPPED`` are the
    engines reading the config as shipped (``not run here``, with why, for an engine that cannot
    here); the others, ropescale's ``native`` export. Every input is checked (``check_inputs``)
    before anything is written."""
    from ropescale.runs.config import parse_strategy

    from ..parity import run_parity, write_parity

    say = say or (lambda _m: None)
    entries, engines, folders = check_inputs(names, engines, output, length)
    output = Path(output)
    cells, lines, done = [], {}, []
    for entry in entries:
        L = entry.length if length is None else length
        say(f"{entry.name}: building the tiny model ({entry.hub})")
        models, results = folders[entry.name]
        folder = build_tiny(entry, models)
        say(f"{entry.name}: every engine at L = {L}")
        rows, meta = run_parity(str(folder), [parse_strategy("native")], [L], engines=engines, baseline=True,
                                output=results, say=say)
        write_parity(rows, results, meta)  # each config's rows, kept whatever comes next
        for engine, line in zip(engines, meta["engines"]):
            if engine not in lines or (_versioned(line) and not _versioned(lines[engine])):
                lines[engine] = line
        mine = [cell_of(entry.name, r) for r in rows] + unread_cells(entry.name, engines, rows)
        for c in mine:
            c.extra = {"length": L, "hub": entry.hub, "what": entry.what}
        cells += mine
        done.append(entry)
        meta = {"configs": [e.name for e in done], "engines": list(engines), "engine_lines": list(lines.values()),
                "length_cap": LENGTH_CAP, "lengths": {e.name: e.length if length is None else length for e in done}}
        write_conformance(cells, output, meta)  # the table so far: a failed config later loses nothing
    return cells, meta


def check_inputs(names: list[str], engines: list[str], output: str | Path,
                 length: int | None) -> tuple[list[Shipped], list[str], dict[str, tuple[Path, Path]]]:
    """``(entries, engines, folders)`` of a conformance run, before anything is written: the configs
    loaded (``load_shipped``), each name once; the engines by their one names; per config name its
    tiny model's folder and its parity folder, both inside ``output``. ``InvalidInput`` /
    ``OutputError`` (one line) for no config, a bad or repeated config, an unknown engine or none, a
    ``length`` that is not a whole number of tokens in [2, 2^24], an unusable output folder or a
    path that would lead out of it."""
    from ropescale.serving.output import check_output
    from ropescale.serving.rope import MAX_LENGTH

    from .checks import check_drivers_ready, check_engines, check_tokens, inside, unique_names

    engines = check_engines(engines)
    if length is not None:
        check_tokens(length, "--length", at_most=MAX_LENGTH)
    if not names:
        raise InvalidInput("--config: name at least one shipped config")
    entries = [load_shipped(n) for n in names]
    unique_names([e.name for e in entries], [str(n) for n in names])
    check_drivers_ready(engines)
    output = check_output(output)
    folders = {e.name: (check_output(inside(output, "models", e.name)), check_output(inside(output, e.name)))
               for e in entries}
    return entries, engines, folders


def unread_cells(config: str, engines: list[str], rows) -> list[Cell]:
    """A ``not run here`` cell, saying why, for each engine of ``engines`` without a row of the config
    as shipped among ``rows`` (``eval.parity.ParityRow``): llama.cpp reads a config.json only through
    its converter, which runs in its own environment, not installed here."""
    from ropescale.serving.engines import get_engine

    from ..engines import driver_class
    from ..parity import AS_SHIPPED

    shipped = [r for r in rows if r.exported_by == AS_SHIPPED]
    out = []
    for engine in engines:
        if any(r.engine == engine for r in shipped):
            continue
        label, cls = get_engine(engine).label, driver_class(engine)
        if not shipped:  # none read it: ropescale has no rotation of it to compare with
            why = next((r.verdict for r in rows if r.engine == engine), "no rotation of ropescale's to compare with")
            text = f"{label}: not given the config as shipped ({why})"
        elif cls is None or cls.as_written is None:
            text = f"{label}: its parity driver does not read a config as shipped"
        else:
            text = (f"{label}: reads the config as shipped with {cls.shipped_reader}, absent here "
                    f"({label} not installed)")
        out.append(Cell(config, engine, AS_SHIPPED, "not run here", text))
    return out


def _versioned(line: str) -> bool:
    """Whether an engine's report line names a version (the engine ran), not only where it would run."""
    return any(ch.isdigit() for ch in line.split("(")[0])


def _short(text: str, width: int = 170) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(cells: list[Cell], entries: list[str], engines: list[str], shipped: bool) -> list[str]:
    from ropescale.serving.engines import get_engine

    from ..parity import AS_SHIPPED

    labels = [get_engine(e).label for e in engines]
    lines = ["| config | rope as shipped | L | " + " | ".join(labels) + " |", "|" + "---|" * (3 + len(engines))]
    for name in entries:
        mine = [c for c in cells if c.config == name and (c.exported_by == AS_SHIPPED) == shipped]
        if not mine:
            continue
        extra = mine[0].extra
        row = [f"`{name}`", extra.get("what", ""), str(extra.get("length", ""))]
        for engine in engines:
            c = next((c for c in mine if c.engine == engine), None)
            if c is None:
                row.append("—")
            elif c.kind == "same":
                row.append("same")
            else:
                text = c.text.removeprefix("differs: ").removeprefix("refused: ")
                row.append(f"**{c.kind}**: {_short(text)}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(cells: list[Cell], meta: dict) -> str:
    """Two tables under a line naming the models, lengths and engines: each engine given the config
    as shipped, then given ropescale's ``native`` export."""
    engines, names = meta["engines"], meta["configs"]
    engine_lines = [re.sub(r" \(/[^)]*\)", "", line) for line in meta["engine_lines"]]  # no local paths
    head = ("Conformance of shipped configs — tiny random models built from each config.json with every rope "
            f"key as shipped; rotation per layer type (frequencies, cos/sin magnitude, softmax factor) at L = "
            f"the config's served length (at most {meta['length_cap']:,} tokens) against transformers'; "
            "engines: " + "; ".join(engine_lines) + ".")
    out = [head, "", "Each engine given the config.json as shipped:", ""]
    out += _table(cells, names, engines, True)
    out += ["", "Each engine given ropescale's export of the model as shipped (`patch --strategy native --engine E`):",
            ""]
    out += _table(cells, names, engines, False)
    return "\n".join(out) + "\n"


def write_conformance(cells: list[Cell], output: str | Path, meta: dict) -> dict[str, Path]:
    """``conformance.md``, ``conformance.csv`` (one row per config × engine × export, full verdicts) and
    ``conformance.json`` (cells and ``meta``) in ``output``; returns their paths."""
    from dataclasses import asdict

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": output / "conformance.md", "csv": output / "conformance.csv",
             "json": output / "conformance.json"}
    paths["markdown"].write_text(markdown(cells, meta), encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["config", "hub", "length", "engine", "exported_by", "kind", "max_rel_freq_diff", "verdict",
                    "source"])
        for c in cells:
            w.writerow([c.config, c.extra.get("hub", ""), c.extra.get("length", ""), c.engine, c.exported_by, c.kind,
                        "" if c.max_rel_freq_diff is None else f"{c.max_rel_freq_diff:.3g}", c.text, c.source])
    paths["json"].write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells]}, indent=1,
                                        default=str) + "\n", encoding="utf-8")
    return paths

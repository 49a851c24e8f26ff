"""An engine's driver for ``ropescale parity``: how the harness gets the engine's own numbers.

``EngineDriver`` is the harness side of one library engine (``ropescale.serving.engines.Engine``,
same ``name``), in the engine's harness package (``eval/engines/<engine>/parity.py``); subclassing it with a
``name`` registers it as the engine's ``driver`` (``eval.engines.registry.ROLES``). For every
strategy × served length (a ``Case``) ``run_parity`` hands each engine's driver a row to fill
(``add``): the engine's export of the patch (``Engine.translate``) or its refusal, then what the
engine computes from it (``serve``). This base class serves every engine through its library
re-implementation (``Engine.rope``), so an engine needs a driver of its own only to run the real
engine: a subprocess in the engine's own environment (``environment``: ``eval.engines.process.Environment``),
its rope and end-to-end jobs gathered while the cases are added and run once
all are (``finish``). ``as_written`` names what a user served before ropescale's export
(``--baseline`` rows, ``add_baseline``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ropescale.errors import InvalidInput
from ropescale.patching import PatchHandle
from ropescale.serving.engines import Engine, write_generation
from ropescale.serving.rope import EngineRope, ExportRefused, compare, compare_layers

from . import process
from .process import EngineFailed, Environment
from .registry import add_role

__all__ = ["Case", "EngineDriver", "Run", "angle_table_diff", "case_name", "e2e_numbers", "fill", "link_model",
           "our_logprobs", "sampled_positions", "standardized"]

# what a model folder for an engine links from the model's own (beside its own config.json)
_LINKED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "special_tokens_map.json", "tokenizer.model")


@dataclass
class Case:
    """One strategy × served length of a parity run, the same for every engine.

    display: the strategy as the user wrote it; length: L [tokens]; handle: the active patch;
    ours: what ropescale computes at L (None for a relative-position rule: ``why`` says so); freeze: the
    length dynamic NTK is exported frozen at (None: not frozen); ids: the end-to-end windows of L
    token ids (None without ``--end-to-end``), ours_lp: ropescale's log-probabilities on them [nats];
    ours_layers: for a per-layer-type model, what ropescale computes per layer type
    (``ropescale_layer_ropes``: the patched types, ``ours``'s first, and those kept as shipped), else None.
    """

    display: str
    length: int
    handle: PatchHandle
    ours: EngineRope | None
    why: str = ""
    freeze: int | None = None
    ids: list[list[int]] | None = None
    ours_lp: list[list[float]] | None = None
    ours_layers: dict[str, EngineRope] | None = None

    @property
    def slug(self) -> str:
        """A file name for the strategy display and length: readable, unique (a hash when cut short)."""
        text = "".join(c if c.isalnum() or c in "._=-" else "_" for c in self.display)
        if len(text) > 48:
            text = text[:40] + "-" + hashlib.sha1(self.display.encode()).hexdigest()[:8]
        return f"{text}@{self.length}"

    @property
    def context(self) -> dict[str, Any]:
        """The patched layers' rotary context (``dim``, ``rope_theta``, ``original_max_position_embeddings``)."""
        return dict(self.handle.contexts.get(None, self.handle.context))


@dataclass
class Run:
    """What every driver of one parity run shares: the unpatched-then-patched ``model`` and its
    ``tokenizer``, the model's folder ``src``, the ``output`` folder (exports under ``exports/``,
    engine logs under ``logs/``), ``say`` (progress lines), ``end_to_end``, ``windows`` per length,
    and ``gguf``: the base GGUF to rewrite (None: made by llama.cpp's converter when needed)."""

    model: Any
    tokenizer: Any
    src: Path
    output: Path
    say: Callable[[str], None]
    end_to_end: bool = False
    windows: int = 1
    gguf: Path | None = None
    data: dict = field(default_factory=dict)  # drivers' shared scratch (one converted base GGUF, …)

    @property
    def exports(self) -> Path:
        """The folder the run's exports are written to."""
        return self.output / "exports"

    @property
    def logs(self) -> Path:
        """The folder the engines' logs are written to."""
        return self.output / "logs"


DENSE = 4096  # served lengths up to this many tokens have every position measured [tokens]


def sampled_positions(length: int) -> list[int] | None:
    """The positions an engine's rotary module is measured at for a served length L = ``length``:
    None (every one of 0 … L−1) up to ``DENSE`` tokens; past it 0 … 1023, 64 geometrically spaced
    positions above and L − 1 — θ comes from the angle at position 1 and the largest angle
    error is reached at the last position, so a table of L rows (L × d/2 floats through JSON)
    adds nothing at 128k tokens."""
    if length <= DENSE:
        return None
    far = torch.logspace(math.log10(1024), math.log10(length - 1), 64, dtype=torch.float64).round().long()
    return sorted(set(range(1024)) | set(far.tolist()) | {length - 1})


def angle_table_diff(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor,
                     positions: list[int] | None = None) -> float:
    """Largest |wrap(φ_engine(m, i) − m·θ_i)| [radians] over positions m and pairs i, where
    φ_engine = atan2(sin, cos) from an engine's ``[n, d/2]`` cos/sin table (magnitude-scaled is
    fine) at ``positions`` (n of them; default 0 … n−1) and θ = ``inv_freq`` ``[d/2]``; NaN anywhere, or
    a table of another number of pairs → inf. The wrap maps to (−π, π]."""
    if cos.numel() == 0:
        return 0.0
    if torch.isnan(cos).any() or torch.isnan(sin).any() or cos.shape[-1] != inv_freq.numel():
        return math.inf  # NaN, or another number of rotary pairs (``compare`` says which)
    m = (torch.arange(cos.shape[0]) if positions is None else torch.tensor(positions)).to(torch.float64)[:, None]
    ours = m * inv_freq.to(torch.float64)[None, :]
    theirs = torch.atan2(sin.double(), cos.double())
    d = torch.remainder(theirs - ours + math.pi, 2 * math.pi) - math.pi
    return float(d.abs().max())


def e2e_numbers(ours: list[list[float]], theirs: list[list[float]]) -> dict[str, float | int]:
    """max and mean |Δ log p| [nats] over every position of every window, NaN positions on the engine's
    side (counted, and making both inf), perplexities exp(−mean log p) of both sides, token count."""
    a = torch.tensor([x for row in ours for x in row], dtype=torch.float64)
    b = torch.tensor([x for row in theirs for x in row], dtype=torch.float64)
    if a.shape != b.shape:
        raise InvalidInput(f"log-prob counts differ: ropescale {a.numel()} vs engine {b.numel()}")
    nan = int(torch.isnan(b).sum())
    diff = (a - b).abs()
    return {"max_abs_dlogp": math.inf if nan else float(diff.max()),
            "mean_abs_dlogp": math.inf if nan else float(diff.mean()),
            "ppl_ropescale": float(torch.exp(-a.mean())),
            "ppl_engine": math.nan if nan else float(torch.exp(-b.mean())),
            "nan_positions": nan, "tokens": int(a.numel())}


@torch.no_grad()
def our_logprobs(model, windows: list[list[int]]) -> list[list[float]]:
    """log p(ids[j+1] | ids[:j+1]) [nats] of ``model`` on each window of token ids, float64 log-softmax."""
    out = []
    for ids in windows:
        x = torch.tensor([ids], device=model.device)
        logits = model(x).logits[0].double()
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, x[0, 1:, None])[:, 0]
        out.append(logp.tolist())
    return out


def link_model(src: Path, dst: Path, config: dict, generation: dict | None = None) -> Path:
    """A model folder for an engine: ``config`` as config.json, the weights and tokenizer linked, and
    generation_config.json linked too — or written with ``generation``'s keys set where there are any."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        if name == "generation_config.json" and generation:
            continue
        if (src / name).is_file() and not (dst / name).exists():
            os.symlink((src / name).resolve(), dst / name)
    (dst / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    write_generation(src, dst, generation)
    return dst


def standardized(folder: Path) -> dict[str, Any]:
    """``folder``'s config.json as transformers reads it (``AutoConfig.from_pretrained(...).to_dict()``:
    transformers 4 keys such as ``rope_scaling`` standardized into ``rope_parameters``, per layer type
    where the model has several) — what an engine that reads configs through transformers (vLLM,
    SGLang) is given."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).to_dict()


def fill(row, ours: EngineRope | dict[str, EngineRope], theirs: EngineRope | dict[str, EngineRope], length: int,
         source: str, angle: float | None = None) -> None:
    """``row``'s verdict and numbers from ``compare(ours, theirs, length)`` — or, for a per-layer-type
    model (both dicts: layer type → ``EngineRope``), ``compare_layers`` over every type, the
    magnitudes being the first type's (the first patched one); ``angle``: the largest angle
    difference measured over an engine's own cos/sin table (default: ``compare``'s)."""
    if isinstance(theirs, dict) or isinstance(ours, dict):
        if not (isinstance(theirs, dict) and isinstance(ours, dict)):
            raise InvalidInput("per-layer-type rotations compare only with per-layer-type rotations")
        v = compare_layers(ours, theirs, length)
        theirs = theirs.get(next(iter(ours)), next(iter(theirs.values())))
    else:
        v = compare(ours, theirs, length)
    row.source, row.verdict, row.same = source, v.verdict, v.same
    row.max_rel_freq_diff = v.max_rel_freq_diff
    row.magnitude_engine, row.softmax_scale_engine = theirs.magnitude, theirs.softmax_scale
    row.max_angle_diff = v.max_angle_diff if angle is None else angle


class EngineDriver:
    """The parity driver of the engine ``name`` (see the module docstring).

    environment: the engine's own Python and scripts (``eval.engines.process.Environment``; None: nothing runs in a
    subprocess); as_written: what ``--baseline`` rows of this engine were exported by (None: none);
    shipped_reader: how the engine reads a config.json as shipped, where not through its Python code
    (``ropescale conformance`` names it when the engine is absent); e2e_setting: how its end-to-end scoring runs
    beyond float32 (named under the parity table), or None.
    """

    name: ClassVar[str] = ""
    environment: ClassVar[Environment | None] = None
    as_written: ClassVar[str | None] = None
    shipped_reader: ClassVar[str] = "its own code"
    e2e_setting: ClassVar[str | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        add_role(cls, "driver")

    def __init__(self, engine: Engine, run: Run):
        self.engine, self.run = engine, run
        self.installed = self.environment is None or self.environment.python() is not None
        self.version: str | None = None  # the real engine's, once it ran
        self.jobs: list[tuple[Any, dict]] = []  # end to end: (row, job)

    @classmethod
    def not_ready(cls) -> str | None:
        """What this driver needs besides its engine's Python and does not find (one clause), checked before
        anything is written; None when nothing is missing."""
        return None

    @property
    def label(self) -> str:
        """How rows and messages name the engine (``"vLLM"``)."""
        return self.engine.label

    def require(self) -> None:
        """``EngineAbsent`` (one line) when the real engine is needed (end to end) and not installed."""
        if self.environment is not None:
            self.environment.require()

    def add(self, row, case: Case) -> None:
        """Fill ``row`` for ``case``: the export's refusal, or its settings and what the engine computes."""
        try:
            translation = self.engine.translate(case.handle, case.length, freeze_dynamic_at=case.freeze)
        except ExportRefused as e:
            row.verdict, row.source, row.same = f"refused: {e}", "ropescale export", False
            return
        if case.ours is None:  # exported something for a rule without inv_freq: should not happen
            row.verdict = f"n/a: {case.why}"
            return
        row.notes = "; ".join(translation.notes)
        row.export = self.engine.describe(translation)
        self.serve(row, case, translation)

    def serve(self, row, case: Case, translation) -> None:
        """What the engine computes from ``translation``: here its library re-implementation."""
        self.reimplemented(row, case, translation)

    def reimplemented(self, row, case: Case, translation) -> None:
        """Fill ``row`` from the engine's re-implemented rope (``Engine.rope``), for an engine that is not
        run (not installed, or compared through its formulas alone).

        Args:
            row: the parity row to fill.
            case: the case: our rotation per layer and the length.
            translation: what the engine's ``translate`` returned.
        """
        absent = f"; {self.label} not installed" if self.environment is not None else ""
        theirs = self.engine.rope(translation, case.length, case.context)
        fill(row, case.ours_layers if isinstance(theirs, dict) else case.ours, theirs, case.length,
             f"re-implementation ({self.engine.rope_source or self.engine.name}{absent})")

    def baseline_ready(self, shipped: bool = False) -> bool:
        """Whether this engine has ``--baseline`` rows here (``as_written`` set and what they need present);
        ``shipped``: the rows of a config as shipped (``native``), not of save_patched's folder."""
        return self.as_written is not None

    def add_baseline(self, row, case: Case, folder: Path, config: dict) -> None:
        """Fill a ``--baseline`` row: ``folder`` holds save_patched's ``config`` as written (weights linked)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Run what was gathered while adding the cases (real-engine rope, end to end)."""
        self.end_to_end()

    def end_to_end(self) -> None:
        """The gathered ``jobs`` (held-out windows through the real engine) in one driver run; each
        row gets max |Δ log p|, both perplexities, NaN count. A failed run leaves the rotation rows
        standing, each end-to-end cell empty with the reason in its notes."""
        if not self.jobs:
            return
        say = self.run.say
        say(f"{self.label}: end to end, {len(self.jobs)} exports × {self.run.windows} window(s) of held-out text")
        start = time.perf_counter()
        try:
            res = process.run_engine(self.engine.name, {"mode": "logprobs", "jobs": [
                {k: v for k, v in j.items() if k != "ours"} for _, j in self.jobs]}, log_dir=self.run.logs)
            answers = self.answers(res, "jobs", [case_name(r) for r, _ in self.jobs], ("error", "logprobs"))
        except EngineFailed as e:  # the rotation rows stand; the end-to-end cells say why they are empty
            say(str(e))
            for row, _ in self.jobs:
                row.notes = "; ".join(x for x in (row.notes, f"end to end failed: {e}") if x)
            return
        for (row, job), got in zip(self.jobs, answers):
            row.engine_seconds = round(got.get("seconds", 0.0), 2)
            if "error" in got:  # the engine refused to load it
                row.notes = "; ".join(x for x in (row.notes, f"the engine refused to serve it: {got['error']}") if x)
                continue
            for k, v in e2e_numbers(job["ours"], got["logprobs"]).items():
                setattr(row, k, v)
        say(f"{self.label}: done in {time.perf_counter() - start:.0f} s")

    def answers(self, result: dict, key: str, asked: list[str], needs: tuple[str, ...]) -> list[dict]:
        """The driver's ``result[key]``: one answer per case asked (``asked``: their names, in order),
        each a dict holding one of ``needs`` (the first an alternative to the others when it is
        ``"error"``). ``EngineFailed`` (one line naming the driver and the cases without an answer)
        otherwise: a short answer would leave rows without a verdict."""
        label = f"{self.label} driver ({self.environment.script if self.environment else self.name})"
        got = result.get(key)
        if not isinstance(got, list):
            raise EngineFailed(f"{label} answered no {key!r} list; asked for {len(asked)}: {', '.join(asked)}")
        if len(got) != len(asked):
            missing = asked[len(got):]
            raise EngineFailed(f"{label} answered {len(got)} of the {len(asked)} {key} asked"
                               + (f"; no answer for {', '.join(missing)}" if missing else " (more than asked)"))
        alternatives = needs[:1] if needs[0] == "error" else ()
        required = needs[1:] if alternatives else needs
        for name, answer in zip(asked, got):
            if not isinstance(answer, dict) or not (any(k in answer for k in alternatives)
                                                    or all(k in answer for k in required)):
                raise EngineFailed(f"{label} answered {name} without {' and '.join(required)}: {str(answer)[:120]}")
        return got

    def line(self) -> str:
        """One line for the report: the engine's version and where it ran, or that it was absent."""
        if not self.installed:
            return f"{self.label} not installed: re-implementation"
        if self.environment is None:
            return f"{self.label} (in process)"
        return f"{self.version or self.label} ({self.environment.python()})"


def case_name(row) -> str:
    """A case's name in messages: strategy@L, and how it was exported when not by ropescale."""
    return f"{row.strategy}@{row.length}" + ("" if row.exported_by == "ropescale" else f" ({row.exported_by})")

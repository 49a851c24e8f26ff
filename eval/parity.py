"""``ropescale parity``: does a serving engine rotate (and score text) as ropescale's patched model does?

For a model, strategies and served lengths L, per engine (transformers, vLLM, llama.cpp, MLX, SGLang, a plugin's)
× strategy × L — each engine through its driver (``eval.engines``: ``EngineDriver``; this module names
no engine):

1. **export** the patch for the engine (its ``ropescale.serving.engines`` entry: ``translate``), or
   record the engine's refusal and its reason;
2. **rope**: the per-pair frequencies θ_i, the cos/sin magnitude and the softmax scale the engine
   computes from that export, against ``ropescale_rope`` (``compare``: largest relative
   frequency difference, magnitude difference, largest angle difference up to L, verdict
   ``same`` / ``differs: why``). *Source* says where the engine's numbers come from:
   - ``vLLM 0.32.0 get_rope``: vLLM's own config reader (``ModelConfig``) and rotary class,
     applied by its ``forward_native`` to unit vectors at positions 0 … L−1 — every angle
     measured, so the angle difference is the largest over all positions and pairs, and
     positions past its cos/sin cache are a failure;
   - ``llama.cpp 0.3.36 runtime metadata``: the GGUF keys as the llama.cpp runtime read them,
     through ``llama_cpp_rope`` (the rotation itself runs inside ggml's graph, which
     llama-cpp-python does not expose; the end-to-end log-probabilities check it);
   - ``transformers 5.x from_pretrained + its rotary module``: the export loaded back by plain
     transformers, in process;
   - ``re-implementation``: the engine's ``rope`` (``vllm_rope`` / ``llama_cpp_rope`` of
     ``ropescale.serving``) when the engine is not installed (``ropescale_eval.engines`` says how to
     install it), and for an engine without a driver of its own;
3. with ``end_to_end``: held-out text through the **real engine** (subprocess in its own
   environment) against the patched ropescale model on the same token ids: max |Δ log p| over
   every scored position, both perplexities, NaN count.

Writes ``parity.csv``, ``parity.md`` (one table, under a line naming the model, data and
settings), ``parity.png`` and ``parity.json`` to the output folder, the exported configs/GGUFs under
``exports/`` and the engines' logs under ``logs/``.

Errors (one line each): ``InvalidInput`` for bad lengths/engines/options, ``EngineAbsent`` when
``end_to_end`` names an engine that is not installed, ``EngineFailed`` when an engine's driver dies.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import InvalidInput, UnknownNameError
from ropescale.serving.engines import engine_names, get_engine
from ropescale.serving.output import check_output
from ropescale.serving.rope import MAX_LENGTH

from .engines import driver_class
from .engines.base import Case, EngineDriver, Run, angle_table_diff, e2e_numbers, link_model, our_logprobs

AS_SHIPPED = "the config as shipped"  # exported_by of a --baseline row of a strategy that keeps the model

__all__ = ["AS_SHIPPED", "ParityRow", "angle_table_diff", "e2e_numbers", "markdown", "plot_parity", "run_parity",
           "write_parity"]


@dataclass
class ParityRow:
    """One engine × strategy × length. Frequencies in rad/token, angles in radians, log p in nats.

    verdict: ``same`` / ``differs: …`` / ``refused: …`` (the export's reason) / ``n/a: …``;
    source: where the engine's numbers came from (see the module docstring).
    exported_by: ``ropescale`` (this project's export for the engine) or, with ``baseline``, what a
    user got before it (the driver's ``as_written``: save_patched's config.json as vLLM's config;
    llama.cpp's converter on that folder).
    max_abs_dlogp, mean_abs_dlogp, ppl_ropescale, ppl_engine, nan_positions, tokens: end-to-end only
    (None otherwise); the mean |Δ log p| is the robust one where an engine's kernels differ per token
    (llama.cpp's quantized matmuls), the max the one that catches a single wrong position.
    """

    engine: str
    strategy: str
    length: int
    source: str
    verdict: str
    same: bool | None = None
    max_rel_freq_diff: float | None = None
    magnitude_ropescale: float | None = None
    magnitude_engine: float | None = None
    softmax_scale_ropescale: float | None = None
    softmax_scale_engine: float | None = None
    max_angle_diff: float | None = None
    export: str = ""
    notes: str = ""
    max_abs_dlogp: float | None = None
    mean_abs_dlogp: float | None = None
    ppl_ropescale: float | None = None
    ppl_engine: float | None = None
    nan_positions: int | None = None
    tokens: int | None = None
    engine_seconds: float | None = None
    exported_by: str = "ropescale"
    extra: dict[str, Any] = field(default_factory=dict)



def _windows(tokenizer, data: str, lengths: list[int], windows: int) -> dict[int, list[list[int]]]:
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    stream = torch.cat(tokenize_documents(tokenizer, load_documents(DataSpec(data))))
    out = {}
    for length in lengths:
        if stream.numel() < length * windows:
            raise InvalidInput(f"--data {data} has {stream.numel()} tokens, fewer than {windows} windows of {length}")
        out[length] = [stream[k * length:(k + 1) * length].tolist() for k in range(windows)]
    return out



def run_parity(model: str, specs: list, lengths: list[int], *, engines: list[str], end_to_end: bool = False,
               data: str = "kjv-heldout", windows: int = 1, output: str | Path,
               freeze_dynamic: bool = True, gguf: str | None = None, baseline: bool = False,
               say: Callable[[str], None] | None = None, device: str = "cpu") -> tuple[list[ParityRow], dict]:
    """``(rows, meta)``: the parity rows of ``specs`` (``StrategySpec``) × ``lengths`` [tokens] × ``engines``
    (registered engine names; see the module docstring); writes nothing but the exports and logs
    (``write_parity`` writes the report). ``freeze_dynamic``: dynamic NTK is exported frozen at each L
    (the static engines serve one rotation); otherwise refused. ``gguf``: the base GGUF to rewrite
    (default: llama.cpp's converter run on the model, needs the llama.cpp environment). ``windows``:
    held-out windows of L tokens per length for ``end_to_end``. ``baseline``: also rows for what a
    user served before this export existed (each driver's ``as_written``; the issue's known
    non-parities), for strategies transformers expresses; the llama.cpp ones need llama.cpp
    installed (its converter). ``say``: progress lines (None: quiet). ``device``: where the
    in-process transformers model runs. ``meta``: model, data, windows, T, d, lengths, one line per
    engine (version and where it ran, or that it was absent).

    Raises ``InvalidInput`` (one line, before anything is loaded or written) for an unknown engine,
    bad lengths, windows or GGUF; ``EngineAbsent`` when ``end_to_end`` needs an engine that is not
    installed; ``EngineFailed`` when an engine's driver dies; ``OutputError`` for an unusable output.
    """
    from ropescale import load_model, unpatch
    from ropescale.models import model_rope_config, resolve_model

    names = _check_inputs(engines, lengths, windows, gguf)
    if end_to_end:
        for name in names:
            env = (driver_class(name) or EngineDriver).environment
            if env is not None:
                env.require()  # EngineAbsent: one line naming how to install it
    output = check_output(output)
    rope_cfg = model_rope_config(model)
    train = rope_cfg.original_max_position_embeddings
    m, tok = load_model(model, device=device)
    unpatch(m)
    run = Run(m, tok, Path(resolve_model(model)), output, say or (lambda _m: None), end_to_end, windows,
              Path(gguf) if gguf else None)
    drivers = {name: (driver_class(name) or EngineDriver)(get_engine(name), run) for name in names}
    for driver in drivers.values():
        if driver.environment is not None:
            run.say(driver.environment.status())  # where the real engine runs from, or how to install it
    ids = _windows(tok, data, lengths, windows) if end_to_end else {}
    rows: list[ParityRow] = []
    for spec in specs:
        for length in lengths:
            rows += _case_rows(run, drivers, spec, length, train, ids.get(length), freeze_dynamic, baseline)
    unpatch(m)
    for driver in drivers.values():
        driver.finish()
    meta = {"model": model, "data": data, "windows": windows, "train_length": train, "dim": rope_cfg.dim,
            "lengths": list(lengths), "freeze_dynamic": freeze_dynamic, "end_to_end": end_to_end,
            "baseline": baseline, "engines": [d.line() for d in drivers.values()]}
    return rows, meta


def _check_inputs(engines: list[str], lengths: list[int], windows, gguf) -> list[str]:
    """The engines by their one name (an old name warns), once each; ``InvalidInput`` (one line) for
    an unknown engine, no engine, lengths that are not whole numbers in [2, 2^24], windows < 1 or a
    missing GGUF."""
    known = engine_names()
    names = []
    for e in engines:
        try:
            names.append(get_engine(e, stacklevel=4).name)  # an old name's warning names run_parity's caller
        except UnknownNameError:
            names.append(None)
    bad = [e for e, n in zip(engines, names) if n is None]
    if bad or not engines:
        raise InvalidInput(f"--engines {','.join(bad) or '(none)'}: choose from {', '.join(known)}")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in lengths):
        raise InvalidInput(f"--lengths {', '.join(map(str, lengths)) or '(none)'}: lengths must be whole numbers "
                           "of tokens >= 2")
    big = [n for n in lengths if n > MAX_LENGTH]
    if big:  # before the transformers row allocates cos/sin for every position
        raise InvalidInput(f"--lengths {big[0]}: beyond any model: RoPE angles come from float32 positions, exact only "
                           f"up to 2^24 = {MAX_LENGTH} tokens; use lengths of at most {MAX_LENGTH}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise InvalidInput(f"--windows {windows}: must be a whole number >= 1")
    if gguf is not None and not Path(gguf).is_file():
        raise InvalidInput(f"--gguf {gguf}: no such GGUF file")
    return list(dict.fromkeys(names))


def _case_rows(run: Run, drivers: dict[str, EngineDriver], spec, length: int, train: int, ids, freeze_dynamic: bool,
               baseline: bool) -> list[ParityRow]:
    """One strategy × length: the model patched, ropescale's own rotation (and log-probabilities on
    ``ids``), then one row per engine filled by its driver, and the ``baseline`` rows."""
    from ropescale import patch
    from ropescale.serving.rope import ropescale_layer_ropes, ropescale_rope

    params = spec.resolve(length=length, train_length=train)
    with patch(run.model, spec.name, original_max_position_embeddings=train, logn=spec.logn,
               temperature=spec.temperature, **params) as handle:
        try:
            ours, why = ropescale_rope(handle, length), ""
        except InvalidInput as e:  # a relative-position rule: no single inv_freq
            ours, why = None, str(e)
        ours_lp = our_logprobs(run.model, ids) if ids is not None and ours is not None else None
        # only a freezable strategy (dynamic NTK) has a static form; the engines refuse the other dynamic rules
        freeze = length if (freeze_dynamic and handle.strategy_obj.served == "freeze") else None
        layers = ropescale_layer_ropes(handle, length) if ours is not None and handle.layer_types != [None] else None
        case = Case(spec.display, length, handle, ours, why, freeze, ids, ours_lp, layers)
        rows = []
        for name, driver in drivers.items():
            row = ParityRow(name, spec.display, length, "", "")
            if ours is not None:
                row.magnitude_ropescale, row.softmax_scale_ropescale = ours.magnitude, ours.softmax_scale
            rows.append(row)
            driver.add(row, case)
        if baseline and ours is not None:
            rows += _baseline_rows(run, drivers, case)
    return rows


def _baseline_rows(run: Run, drivers: dict[str, EngineDriver], case: Case) -> list[ParityRow]:
    """What a user served before ropescale's export: save_patched's config.json as written (a
    model folder under ``exports/as-written/``), one row per engine whose driver has such rows;
    none for a strategy transformers cannot express. For a strategy that keeps the model
    (``native``) the model folder's own config.json, every key as it is: the config as shipped
    (``exported_by`` = ``AS_SHIPPED``), which each engine reads with its own code — the
    conformance of a shipped config (``eval.conformance``)."""
    from ropescale.models import exported_config

    if case.handle.strategy_obj.keeps_model and (run.src / "config.json").is_file():
        config, shipped = json.loads((run.src / "config.json").read_text(encoding="utf-8")), True
    else:
        written, native = exported_config(run.model, case.handle)
        if not native:
            return []
        config, shipped = written.to_dict(), False
    folder = link_model(run.src, run.exports / "as-written" / case.slug, config)
    rows = []
    for name, driver in drivers.items():
        if not driver.baseline_ready(shipped):
            continue
        row = ParityRow(name, case.display, case.length, "", "",
                        exported_by=AS_SHIPPED if shipped else driver.as_written,
                        magnitude_ropescale=case.ours.magnitude, softmax_scale_ropescale=case.ours.softmax_scale)
        rows.append(row)
        driver.add_baseline(row, case, folder, config)
    return rows


_COLUMNS = ["engine", "exported_by", "strategy", "length", "verdict", "same", "max_abs_dlogp", "ppl_ropescale",
            "ppl_engine",
            "nan_positions", "tokens", "max_rel_freq_diff", "max_angle_diff", "magnitude_ropescale",
            "magnitude_engine", "softmax_scale_ropescale", "softmax_scale_engine", "source", "export", "notes",
            "engine_seconds", "model", "data", "windows", "train_length", "mean_abs_dlogp"]


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "∞"
        return format(x, spec)
    return str(x)


def _e2e_settings(rows: list[ParityRow]) -> str:
    """How the engines of ``rows`` score end to end beyond float32 (``EngineDriver.e2e_setting``), as the table's
    heading says it: ``, llama.cpp with an f32 KV cache``."""
    out = ""
    for name in dict.fromkeys(r.engine for r in rows):
        cls = driver_class(name)
        if cls is not None and cls.e2e_setting:
            out += f", {get_engine(name).label} with {cls.e2e_setting}"
    return out


def markdown(rows: list[ParityRow], meta: dict) -> str:
    """One table (engine, strategy, L, verdict, max |Δ log p|, PPL both sides, frequency and angle
    differences, magnitudes, source) under a line naming the model, data and settings."""
    e2e = any(r.max_abs_dlogp is not None or r.tokens is not None for r in rows)
    head = (f"Parity — model `{meta['model']}` (T = {meta['train_length']}, d = {meta['dim']}), "
            f"lengths {', '.join(map(str, meta['lengths']))}, engines: "
            + "; ".join(meta["engines"])
            + (f"; end to end on `{meta['data']}`, {meta['windows']} window(s) per length, "
               "float32 both sides" + _e2e_settings(rows) if e2e else "")
            + f"; dynamic NTK {'frozen at L' if meta.get('freeze_dynamic', True) else 'not frozen'}.")
    by = any(r.exported_by != "ropescale" for r in rows)
    cols = ["engine"] + (["exported by"] if by else []) + ["strategy", "L", "verdict"]
    cols += ["max \\|Δ log p\\|", "mean \\|Δ log p\\|", "PPL ropescale", "PPL engine"] if e2e else []
    cols += ["max rel Δθ", "max Δangle (rad)", "magnitude (ours / engine)", "source"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.engine] + ([r.exported_by] if by else []) + \
            [f"`{r.strategy}`", str(r.length), r.verdict.replace("|", "\\|")]
        if e2e:
            cells += [_fmt(r.max_abs_dlogp, ".2g") + (f" ({r.nan_positions} NaN)" if r.nan_positions else ""),
                      _fmt(r.mean_abs_dlogp, ".2g"), _fmt(r.ppl_ropescale, ".5g"), _fmt(r.ppl_engine, ".5g")]
        mag = "—" if r.magnitude_engine is None else \
            f"{_fmt(r.magnitude_ropescale, '.6g')} / {_fmt(r.magnitude_engine, '.6g')}"
        cells += [_fmt(r.max_rel_freq_diff, ".2g"), _fmt(r.max_angle_diff, ".2g"), mag, r.source]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _label(engine: str) -> str:
    """How the engine's name is shown (its library ``label``: ``vLLM``), the name itself when unknown."""
    try:
        return get_engine(engine).label
    except UnknownNameError:
        return engine


def _short(strategy: str, width: int = 26) -> str:
    """A tick label: the strategy display, cut to ``width`` characters with an ellipsis."""
    return strategy if len(strategy) <= width else strategy[: width - 1] + "…"


def plot_parity(rows: list[ParityRow], path: Path, meta: dict) -> Path:
    """max |Δ log p| (end to end; else the largest angle difference) per strategy, log scale: one
    colour per engine, one marker per length, side by side; exactly 0 hollow at the floor, refused
    cases below it as ×, NaN/∞ at the top as ▲. Only ropescale's own exports (not ``--baseline`` rows)."""
    from ropescale.runs.plotting import pyplot, save_figure

    plt = pyplot()
    rows = [r for r in rows if r.exported_by == "ropescale"]
    e2e = any(r.tokens for r in rows)
    key, label = ("max_abs_dlogp", "max |Δ log p| (nats)") if e2e else ("max_angle_diff", "max angle difference (rad)")
    engines = list(dict.fromkeys(r.engine for r in rows))
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    lengths = sorted({r.length for r in rows})
    series = [(e, n) for e in engines for n in lengths]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(strategies) + 2.5), 4.8))
    finite = [getattr(r, key) for r in rows if getattr(r, key) is not None and math.isfinite(getattr(r, key))
              and getattr(r, key) > 0]
    lo = min(finite) / 10 if finite else 1e-8
    hi = max(finite) * 10 if finite else 1.0
    colors = plt.get_cmap("tab10").colors
    markers = "os^Dv"
    width = 0.8 / max(1, len(series))
    for k, (engine, length) in enumerate(series):
        color, marker = colors[engines.index(engine) % 10], markers[lengths.index(length) % len(markers)]
        xs, ys, xr, xn, xz = [], [], [], [], []
        for i, s in enumerate(strategies):
            r = next((r for r in rows if r.engine == engine and r.strategy == s and r.length == length), None)
            if r is None:
                continue
            x = i + (k - (len(series) - 1) / 2) * width
            v = getattr(r, key)
            if r.verdict.startswith("refused"):
                xr.append(x)
            elif v is None or not math.isfinite(v):
                xn.append(x)
            elif v <= 0:
                xz.append(x)
            else:
                xs.append(x)
                ys.append(max(v, lo))
        name = _label(engine)
        ax.scatter(xs, ys, color=color, marker=marker, s=26, label=f"{name}, L = {length} "
                   f"({length / meta['train_length']:g}T)")
        ax.scatter(xz, [lo] * len(xz), facecolors="none", edgecolors=color, marker=marker, s=26)
        ax.scatter(xr, [lo / 4] * len(xr), color=color, marker="x", s=30)
        ax.scatter(xn, [hi] * len(xn), color=color, marker="^", s=30)
    ax.set_yscale("log")
    ax.set_ylim(lo / 8, hi * 2)
    ax.set_xticks(range(len(strategies)))
    ax.set_xticklabels([_short(s) for s in strategies], rotation=50, ha="right", rotation_mode="anchor", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylabel(label)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(f"ropescale's export served by each engine vs the patched model\n{meta['model']} "
                 f"(T = {meta['train_length']}); hollow: exactly 0, × refused, ▲ NaN/∞", fontsize=9)
    save_figure(fig, path)
    return path


def write_parity(rows: list[ParityRow], output: str | Path, meta: dict) -> dict[str, Path]:
    """``parity.csv`` (one row per case, the columns of ``ParityRow``), ``parity.md``, ``parity.png``,
    ``parity.json`` (rows and ``meta``) in ``output``; returns their paths."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {"csv": output / "parity.csv", "markdown": output / "parity.md", "plot": output / "parity.png",
             "json": output / "parity.json"}
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:  # every row names its model, data and settings
            w.writerow({**asdict(r), "model": meta["model"], "data": meta["data"] if meta.get("end_to_end") else "",
                        "windows": meta["windows"] if meta.get("end_to_end") else "",
                        "train_length": meta["train_length"]})
    paths["markdown"].write_text(markdown(rows, meta), encoding="utf-8")
    paths["json"].write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1,
                                        default=str) + "\n", encoding="utf-8")
    plot_parity(rows, paths["plot"], meta)
    return paths

"""``ropescale parity``: does a serving engine rotate (and score text) as ropescale's patched model does?

For a model, strategies and served lengths L, per engine (vLLM, llama.cpp) × strategy × L:

1. **export** the patch for the engine (``ropescale.serving``: ``export_vllm``, ``gguf_rope`` +
   ``rewrite_gguf``), or record the engine's refusal and its reason;
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
   - ``re-implementation``: ``vllm_rope`` / ``llama_cpp_rope`` of ``ropescale.serving`` when the
     engine is not installed (``ropescale_eval.engines`` says how to install it);
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
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import InvalidInput
from ropescale.serving.output import check_output
from ropescale.serving.rope import MAX_LENGTH

from .engines import ENGINES, EngineFailed, engine_python, llama_cpp_source, require_engine, run_engine

__all__ = ["AS_WRITTEN", "ENGINE_NAMES", "ParityRow", "angle_table_diff", "e2e_numbers", "markdown", "plot_parity",
           "run_parity", "write_parity"]

ENGINE_NAMES = ("transformers", *ENGINES)  # transformers in-process; "vllm", "llama.cpp" as subprocesses
AS_WRITTEN = {"vllm": "save_patched config.json as written",
              "llama.cpp": "llama.cpp's converter on save_patched"}
_LINKED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "special_tokens_map.json", "tokenizer.model")


@dataclass
class ParityRow:
    """One engine × strategy × length. Frequencies in rad/token, angles in radians, log p in nats.

    verdict: ``same`` / ``differs: …`` / ``refused: …`` (the export's reason) / ``n/a: …``;
    source: where the engine's numbers came from (see the module docstring).
    exported_by: ``ropescale`` (this project's export for the engine) or, with ``baseline``, what a
    user got before it (``AS_WRITTEN``: save_patched's config.json as vLLM's config; llama.cpp's
    converter on that folder).
    max_abs_dlogp, ppl_ropescale, ppl_engine, nan_positions, tokens: end-to-end only (None otherwise).
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
    ppl_ropescale: float | None = None
    ppl_engine: float | None = None
    nan_positions: int | None = None
    tokens: int | None = None
    engine_seconds: float | None = None
    exported_by: str = "ropescale"
    extra: dict[str, Any] = field(default_factory=dict)


def angle_table_diff(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor) -> float:
    """Largest |wrap(φ_engine(m, i) − m·θ_i)| [radians] over positions m and pairs i, where
    φ_engine = atan2(sin, cos) from an engine's ``[n, d/2]`` cos/sin table (magnitude-scaled is
    fine) and θ = ``inv_freq`` ``[d/2]``; NaN anywhere → inf. The wrap maps to (−π, π]."""
    if cos.numel() == 0:
        return 0.0
    if torch.isnan(cos).any() or torch.isnan(sin).any():
        return math.inf
    m = torch.arange(cos.shape[0], dtype=torch.float64)[:, None]
    ours = m * inv_freq.to(torch.float64)[None, :]
    theirs = torch.atan2(sin.double(), cos.double())
    d = torch.remainder(theirs - ours + math.pi, 2 * math.pi) - math.pi
    return float(d.abs().max())


def e2e_numbers(ours: list[list[float]], theirs: list[list[float]]) -> dict[str, float | int]:
    """max |Δ log p| [nats] over every position of every window, NaN positions on the engine's side
    (counted, and making the max inf), perplexities exp(−mean log p) of both sides, token count."""
    a = torch.tensor([x for row in ours for x in row], dtype=torch.float64)
    b = torch.tensor([x for row in theirs for x in row], dtype=torch.float64)
    if a.shape != b.shape:
        raise InvalidInput(f"log-prob counts differ: ropescale {a.numel()} vs engine {b.numel()}")
    nan = int(torch.isnan(b).sum())
    diff = (a - b).abs()
    return {"max_abs_dlogp": math.inf if nan else float(diff.max()),
            "ppl_ropescale": float(torch.exp(-a.mean())),
            "ppl_engine": math.nan if nan else float(torch.exp(-b.mean())),
            "nan_positions": nan, "tokens": int(a.numel())}


def _json_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _link_model(src: Path, dst: Path, config: dict) -> Path:
    """A model folder for an engine: ``config`` as config.json, the weights and tokenizer linked."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        if (src / name).is_file() and not (dst / name).exists():
            os.symlink((src / name).resolve(), dst / name)
    (dst / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return dst


def _windows(tokenizer, data: str, lengths: list[int], windows: int) -> dict[int, list[list[int]]]:
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    stream = torch.cat(tokenize_documents(tokenizer, load_documents(DataSpec(data))))
    out = {}
    for length in lengths:
        if stream.numel() < length * windows:
            raise InvalidInput(f"--data {data} has {stream.numel()} tokens, fewer than {windows} windows of {length}")
        out[length] = [stream[k * length:(k + 1) * length].tolist() for k in range(windows)]
    return out


@torch.no_grad()
def _our_logprobs(model, windows: list[list[int]]) -> list[list[float]]:
    out = []
    for ids in windows:
        x = torch.tensor([ids])
        logits = model(x).logits[0].double()
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, x[0, 1:, None])[:, 0]
        out.append(logp.tolist())
    return out


def _slug(strategy: str, length: int) -> str:
    """A file name for a strategy display and length: readable, unique (a hash when cut short)."""
    import hashlib

    text = "".join(c if c.isalnum() or c in "._=-" else "_" for c in strategy)
    if len(text) > 48:
        text = text[:40] + "-" + hashlib.sha1(strategy.encode()).hexdigest()[:8]
    return f"{text}@{length}"


def run_parity(model: str, specs: list, lengths: list[int], *, engines: list[str], end_to_end: bool = False,
               data: str = "kjv-heldout", windows: int = 1, output: str | Path,
               freeze_dynamic: bool = True, gguf: str | None = None, baseline: bool = False,
               say: Callable[[str], None] | None = None) -> tuple[list[ParityRow], dict]:
    """``(rows, meta)``: the parity rows of ``specs`` (``StrategySpec``) × ``lengths`` [tokens] × ``engines`` (see
    the module docstring); writes nothing but the exports and logs (``write_parity`` writes the
    report). ``freeze_dynamic``: dynamic NTK is exported frozen at each L (both engines serve one
    static rotation); otherwise refused. ``gguf``: the base GGUF to rewrite (default: llama.cpp's
    converter run on the model, needs the llama.cpp environment). ``windows``: held-out windows of
    L tokens per length for ``end_to_end``. ``baseline``: also rows for what a user served before this
export existed (``AS_WRITTEN``; the issue's known non-parities), for strategies transformers
expresses; the llama.cpp ones need llama.cpp installed (its converter). ``say``: progress lines
(None: quiet). ``meta``: model,
data, windows, T, d, lengths, one line per engine (version and where it ran, or that it was absent)."""
    from ropescale import load_model, patch, unpatch
    from ropescale.models import model_rope_config, resolve_model
    from ropescale.serving.rope import ExportRefused, compare, ropescale_rope
    from ropescale.strategies import get_strategy

    say = say or (lambda _m: None)
    bad = [e for e in engines if e not in ENGINE_NAMES]
    if bad or not engines:
        raise InvalidInput(f"--engine {','.join(bad) or '(none)'}: choose from {', '.join(ENGINE_NAMES)}")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in lengths):
        raise InvalidInput(f"--length {', '.join(map(str, lengths)) or '(none)'}: lengths must be whole numbers "
                           "of tokens >= 2")
    big = [n for n in lengths if n > MAX_LENGTH]
    if big:  # before the transformers row allocates cos/sin for every position
        raise InvalidInput(f"--length {big[0]}: beyond any model: RoPE angles come from float32 positions, exact only "
                           f"up to 2^24 = {MAX_LENGTH} tokens; use lengths of at most {MAX_LENGTH}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise InvalidInput(f"--windows {windows}: must be a whole number >= 1")
    if gguf is not None and not Path(gguf).is_file():
        raise InvalidInput(f"--gguf {gguf}: no such GGUF file")
    if end_to_end:
        for e in engines:
            if e != "transformers":
                require_engine(e)  # EngineAbsent: one line naming how to install it
    output = check_output(output)
    exports, logs = output / "exports", output / "logs"
    rope_cfg = model_rope_config(model)
    train, dim = rope_cfg.original_max_position_embeddings, rope_cfg.dim
    src = Path(resolve_model(model))
    m, tok = load_model(model, device="cpu")
    unpatch(m)
    ids = _windows(tok, data, lengths, windows) if end_to_end else {}
    installed = {e: e == "transformers" or engine_python(e) is not None for e in engines}
    versions: dict[str, str] = {}

    rows: list[ParityRow] = []
    pending_vllm_rope: list[tuple[ParityRow, Any, Any, dict]] = []
    pending_llama_rope: list[tuple[ParityRow, Any, Path, Any]] = []
    vllm_jobs: list[tuple[ParityRow, dict]] = []
    llama_jobs: list[tuple[ParityRow, dict]] = []
    conversions: list[dict] = []  # baseline GGUFs to make with llama.cpp's converter
    base_gguf = Path(gguf) if gguf else None
    for spec in specs:
        strat = get_strategy(spec.name)
        for length in lengths:
            params = strat.resolve(spec.params, length=length, train_length=train)
            with patch(m, spec.name, original_max_position_embeddings=train, logn=spec.logn,
                       temperature=spec.temperature, **params) as handle:
                try:
                    ours = ropescale_rope(handle, length)
                except InvalidInput as e:  # a relative rule: no single inv_freq
                    ours, why = None, str(e)
                ours_lp = _our_logprobs(m, ids[length]) if end_to_end and ours is not None else None
                # only dynamic NTK has a static form; the engines refuse the other dynamic rules themselves
                freeze = length if (freeze_dynamic and spec.name == "dynamic_ntk") else None
                for engine in engines:
                    row = ParityRow(engine, spec.display, length, "", "")
                    rows.append(row)
                    if ours is not None:
                        row.magnitude_ropescale, row.softmax_scale_ropescale = ours.magnitude, ours.softmax_scale
                    if engine == "transformers":
                        folder = exports / "transformers" / _slug(spec.display, length)
                        _transformers_row(row, m, tok, ours, length, folder, ids.get(length), ours_lp, compare)
                        continue
                    try:
                        if engine == "vllm":
                            from ropescale.serving.vllm import export_vllm

                            exp = export_vllm(handle, length, freeze_dynamic_at=freeze)
                        else:
                            from ropescale.serving.gguf import gguf_rope

                            exp = gguf_rope(handle, length, freeze_dynamic_at=freeze)
                    except ExportRefused as e:
                        row.verdict, row.source, row.same = f"refused: {e}", "ropescale export", False
                        continue
                    if ours is None:  # exported something for a rule without inv_freq: should not happen
                        row.verdict = f"n/a: {why}"
                        continue
                    row.notes = "; ".join(exp.notes)
                    slug = _slug(spec.display, length)
                    if engine == "vllm":
                        folder = _link_model(src, exports / "vllm" / slug, exp.config)
                        row.export = f"max_model_len {exp.max_model_len}; hf_overrides {json.dumps(exp.hf_overrides)}"
                        if installed[engine]:
                            pending_vllm_rope.append((row, ours, exp, {"model": str(folder),
                                                                        "max_model_len": exp.max_model_len,
                                                                        "length": length}))
                        else:
                            from ropescale.serving.vllm import vllm_rope

                            _fill(row, ours, vllm_rope(exp.config, exp.max_model_len), length, compare,
                                  "re-implementation (ropescale.serving.vllm.vllm_rope; vLLM not installed)")
                        if end_to_end:
                            vllm_jobs.append((row, {"model": str(folder), "max_model_len": exp.max_model_len + 1,
                                                    "ids": ids[length], "ours": ours_lp}))
                    else:
                        row.export = ", ".join(f"{k.split('rope.')[-1]}={v[0] if isinstance(v, tuple) else v}"
                                               for k, v in exp.kv.items()) + \
                            "".join(f", {n}[{a.size}]" for n, a in exp.tensors.items())
                        if installed[engine] or base_gguf is not None:
                            if base_gguf is None:
                                base_gguf = _convert_base(src, exports / "gguf" / "base-f32.gguf", logs, say)
                            from ropescale.serving.gguf import rewrite_gguf

                            path = rewrite_gguf(base_gguf, exports / "gguf" / f"{slug}.gguf", exp)
                        else:
                            path = None
                        if installed[engine]:
                            pending_llama_rope.append((row, ours, path, length))
                        else:
                            from ropescale.serving.gguf import llama_cpp_rope

                            kv = {"general.architecture": "llama", "llama.context_length": train,
                                  "llama.rope.dimension_count": dim, **exp.kv}
                            _fill(row, ours, llama_cpp_rope(kv, exp.tensors, length, dim), length, compare,
                                  "re-implementation (ropescale.serving.gguf.llama_cpp_rope; llama.cpp not installed)")
                        if end_to_end:
                            llama_jobs.append((row, {"gguf": str(path), "n_ctx": length, "ids": ids[length],
                                                     "ours": ours_lp}))
                if baseline and ours is not None:
                    from ropescale.export import exported_config

                    written, native = exported_config(m, handle)
                    if not native:
                        continue
                    slug = _slug(spec.display, length)
                    folder = _link_model(src, exports / "as-written" / slug, written.to_dict())
                    for engine in engines:
                        if engine not in AS_WRITTEN or (engine == "llama.cpp" and not installed[engine]):
                            continue  # transformers: save_patched is its export; the converter needs llama.cpp
                        row = ParityRow(engine, spec.display, length, "", "", exported_by=AS_WRITTEN[engine],
                                        magnitude_ropescale=ours.magnitude, softmax_scale_ropescale=ours.softmax_scale)
                        rows.append(row)
                        if engine == "vllm":
                            row.export = f"max_model_len {length}; max_position_embeddings as saved"
                            if installed[engine]:
                                pending_vllm_rope.append((row, ours, None, {"model": str(folder),
                                                                            "max_model_len": length, "length": length}))
                            else:
                                from ropescale.serving.vllm import vllm_rope

                                _fill(row, ours, vllm_rope(written.to_dict(), length), length, compare,
                                      "re-implementation (ropescale.serving.vllm.vllm_rope; vLLM not installed)")
                            if end_to_end:
                                row.notes = "end to end with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
                                vllm_jobs.append((row, {"model": str(folder), "max_model_len": length + 1,
                                                        "ids": ids[length], "ours": ours_lp}))
                        else:
                            path = exports / "as-written" / f"{slug}.gguf"
                            row.export = "GGUF from convert_hf_to_gguf.py"
                            conversions.append({"model": str(folder), "out": str(path)})
                            pending_llama_rope.append((row, ours, path, length))
                            if end_to_end:
                                llama_jobs.append((row, {"gguf": str(path), "n_ctx": length, "ids": ids[length],
                                                         "ours": ours_lp}))
    unpatch(m)
    if conversions:
        source = llama_cpp_source()
        if source is None:
            raise InvalidInput("--baseline needs llama.cpp's converter (convert_hf_to_gguf.py): set "
                               "ROPESCALE_LLAMA_CPP_SOURCE or install with bench/engines/install.sh")
        say(f"llama.cpp: converting {len(conversions)} save_patched folders with llama.cpp's converter")
        run_engine("llama.cpp", {"mode": "convert", "source": str(source), "outtype": "f32", "jobs": conversions},
                   script="convert_gguf.py", log_dir=logs)
    if pending_vllm_rope:
        say(f"vLLM: rotary classes for {len(pending_vllm_rope)} exports")
        res = run_engine("vllm", {"mode": "rope", "cases": [c for *_, c in pending_vllm_rope]}, log_dir=logs)
        versions["vllm"] = f"vLLM {res.get('vllm', '?')}"
        for (row, ours, _exp, case), got in zip(pending_vllm_rope, _answers(res, "cases", "vllm", [
                _case(r) for r, *_ in pending_vllm_rope], ("error", "cos", "sin", "evaluated"))):
            _fill_vllm_real(row, ours, got, case["length"], compare, res.get("vllm", "?"))
    if pending_llama_rope:
        say(f"llama.cpp: runtime metadata of {len(pending_llama_rope)} GGUFs")
        res = run_engine("llama.cpp", {"mode": "rope", "cases": [{"gguf": str(p), "n_ctx": n}
                                                                 for _, _, p, n in pending_llama_rope]}, log_dir=logs)
        versions["llama.cpp"] = f"llama-cpp-python {res.get('llama_cpp', '?')}"
        from ropescale.serving.gguf import llama_cpp_rope, read_gguf_rope

        for (row, ours, path, length), got in zip(pending_llama_rope, _answers(res, "cases", "llama.cpp", [
                _case(r) for r, *_ in pending_llama_rope], ("meta",))):
            kv = {k: _json_value(v) for k, v in got["meta"].items()}
            _, tensors = read_gguf_rope(path)
            _fill(row, ours, llama_cpp_rope(kv, tensors, length, dim), length, compare,
                  f"llama.cpp {res.get('llama_cpp', '?')} runtime metadata + llama_cpp_rope")
    for engine, jobs in (("vllm", vllm_jobs), ("llama.cpp", llama_jobs)):
        if not jobs:
            continue
        say(f"{ENGINES[engine]['label']}: end to end, {len(jobs)} exports × {windows} window(s) of held-out text")
        start = time.perf_counter()
        try:
            res = run_engine(engine, {"mode": "logprobs", "jobs": [{k: v for k, v in j.items() if k != "ours"}
                                                                   for _, j in jobs]}, log_dir=logs)
            answers = _answers(res, "jobs", engine, [_case(r) for r, _ in jobs], ("error", "logprobs"))
        except EngineFailed as e:  # the rotation rows stand; the end-to-end cells say why they are empty
            say(str(e))
            for row, _ in jobs:
                row.notes = "; ".join(x for x in (row.notes, f"end to end failed: {e}") if x)
            continue
        for (row, job), got in zip(jobs, answers):
            row.engine_seconds = round(got.get("seconds", 0.0), 2)
            if "error" in got:  # the engine refused to load it
                row.notes = "; ".join(x for x in (row.notes, f"the engine refused to serve it: {got['error']}") if x)
                continue
            for k, v in e2e_numbers(job["ours"], got["logprobs"]).items():
                setattr(row, k, v)
        say(f"{ENGINES[engine]['label']}: done in {time.perf_counter() - start:.0f} s")
    meta = {"model": model, "data": data, "windows": windows, "train_length": train, "dim": dim,
            "lengths": list(lengths), "freeze_dynamic": freeze_dynamic, "end_to_end": end_to_end,
            "baseline": baseline,
            "engines": [_engine_line(e, installed[e], versions) for e in engines]}
    return rows, meta


def _case(row: ParityRow) -> str:
    """A case's name in messages: strategy@L, and how it was exported when not by ropescale."""
    return f"{row.strategy}@{row.length}" + ("" if row.exported_by == "ropescale" else f" ({row.exported_by})")


def _answers(result: dict, key: str, engine: str, asked: list[str], needs: tuple[str, ...]) -> list[dict]:
    """The driver's ``result[key]``: one answer per case asked (``asked``: their names, in order),
    each a dict holding one of ``needs`` (the first an alternative to the others when it is
    ``"error"``). ``EngineFailed`` (one line naming the driver and the cases without an answer)
    otherwise: a short answer would leave rows without a verdict."""
    label = f"{ENGINES[engine]['label']} driver ({ENGINES[engine]['driver']})"
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


def _engine_line(engine: str, installed: bool, versions: dict) -> str:
    if engine == "transformers":
        import transformers

        return f"transformers {transformers.__version__} (in process)"
    if not installed:
        return f"{ENGINES[engine]['label']} not installed: re-implementation"
    return f"{versions.get(engine, ENGINES[engine]['label'])} ({engine_python(engine)})"


def _transformers_row(row: ParityRow, model, tokenizer, ours, length: int, folder: Path, windows, ours_lp,
                      compare) -> None:
    """A row for plain transformers: ``export_for(..., "transformers")`` loaded back with
    ``AutoModelForCausalLM.from_pretrained`` (no ropescale), its own rotary module run at
    positions 0 … L−1 (a dynamic type updates as in generation's first forward), its log-probs."""
    import transformers
    from transformers import AutoModelForCausalLM

    from ropescale.serving.export import export_for
    from ropescale.serving.rope import EngineRope

    result = export_for(model, "transformers", length, folder, tokenizer=tokenizer)
    record = json.loads((folder / "ropescale.json").read_text(encoding="utf-8"))
    if not record.get("native"):
        row.source, row.same = "ropescale export", False
        row.verdict = (f"refused: transformers: {row.strategy} has no transformers rope type; plain from_pretrained "
                       "refuses the saved folder (load it with ropescale.load_model)")
        return
    source = f"transformers {transformers.__version__} from_pretrained + its rotary module"
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rotary = next(mod for mod in plain.modules() if hasattr(mod, "inv_freq"))
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, length, 1), torch.arange(length)[None])
    half = cos.shape[-1] // 2
    cos, sin = cos[0, :, :half].double(), sin[0, :, :half].double()
    theirs = EngineRope(torch.atan2(sin[1], cos[1]), float(torch.hypot(cos[0], sin[0]).mean()), 1.0, source)
    _fill(row, ours, theirs, length, compare, source, angle=angle_table_diff(cos, sin, ours.inv_freq))
    row.export = "; ".join(result.notes) or "config.json rope_parameters as saved"
    if windows is not None:
        start = time.perf_counter()
        for k, v in e2e_numbers(ours_lp, _our_logprobs(plain, windows)).items():
            setattr(row, k, v)
        row.engine_seconds = round(time.perf_counter() - start, 2)


def _fill(row: ParityRow, ours, theirs, length: int, compare, source: str, angle: float | None = None) -> None:
    v = compare(ours, theirs, length)
    row.source, row.verdict, row.same = source, v.verdict, v.same
    row.max_rel_freq_diff = v.max_rel_freq_diff
    row.magnitude_engine, row.softmax_scale_engine = theirs.magnitude, theirs.softmax_scale
    row.max_angle_diff = v.max_angle_diff if angle is None else angle


def _fill_vllm_real(row: ParityRow, ours, got: dict, length: int, compare, version: str) -> None:
    """A row from vLLM's rotary module: θ from the angle at position 1, magnitude from position 0,
    the angle difference over every evaluated position; a cache shorter than L is a failure."""
    from ropescale.serving.rope import EngineRope

    source = f"vLLM {version} ModelConfig + get_rope ({got.get('class', '?')}.forward_native)"
    if "error" in got:
        error = got["error"]
        if "Value error, " in error:  # pydantic's wrapping of vLLM's own sentence
            error = error.split("Value error, ", 1)[1].split(" To allow", 1)[0]
        row.source, row.verdict, row.same = source, f"differs: vLLM refuses it: {error}", False
        return
    cos, sin = torch.tensor(got["cos"], dtype=torch.float64), torch.tensor(got["sin"], dtype=torch.float64)
    if cos.shape[0] < 2:
        row.source, row.verdict, row.same = source, "differs: vLLM's rotary module computed no angles", False
        return
    inv = torch.atan2(sin[1], cos[1])
    magnitude = float(torch.hypot(cos[0], sin[0]).mean())
    failure = None
    if got["evaluated"] < length:
        failure = (f"vLLM's cos/sin cache holds {got['cache_length']} positions (NaN past it), fewer than the "
                   f"served {length}")
    theirs = EngineRope(inv, magnitude, 1.0, source, failure)
    _fill(row, ours, theirs, length, compare, source,
          angle=angle_table_diff(cos, sin, ours.inv_freq) if failure is None else math.inf)
    row.extra = {"vllm_class": got.get("class"), "cache_length": got.get("cache_length"),
                 "max_position": got.get("max_position")}


def _convert_base(src: Path, dst: Path, logs: Path, say) -> Path:
    """llama.cpp's converter on the model folder (f32), once per output folder."""
    if dst.is_file():
        return dst
    source = llama_cpp_source()
    if source is None:
        raise InvalidInput("no llama.cpp source with convert_hf_to_gguf.py (bench/engines/install.sh puts it in "
                           "<prefix>/llama/src/llama.cpp; or set ROPESCALE_LLAMA_CPP_SOURCE, or give --gguf BASE.gguf)")
    say(f"llama.cpp: converting {src.name} to GGUF (f32) with llama.cpp's converter")
    dst.parent.mkdir(parents=True, exist_ok=True)
    run_engine("llama.cpp", {"mode": "convert", "model": str(src), "out": str(dst), "source": str(source),
                             "outtype": "f32"}, script="convert_gguf.py", log_dir=logs)
    return dst


_COLUMNS = ["engine", "exported_by", "strategy", "length", "verdict", "same", "max_abs_dlogp", "ppl_ropescale",
            "ppl_engine",
            "nan_positions", "tokens", "max_rel_freq_diff", "max_angle_diff", "magnitude_ropescale",
            "magnitude_engine", "softmax_scale_ropescale", "softmax_scale_engine", "source", "export", "notes",
            "engine_seconds", "model", "data", "windows", "train_length"]


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


def markdown(rows: list[ParityRow], meta: dict) -> str:
    """One table (engine, strategy, L, verdict, max |Δ log p|, PPL both sides, frequency and angle
    differences, magnitudes, source) under a line naming the model, data and settings."""
    e2e = any(r.max_abs_dlogp is not None or r.tokens is not None for r in rows)
    head = (f"Parity — model `{meta['model']}` (T = {meta['train_length']}, d = {meta['dim']}), "
            f"lengths {', '.join(map(str, meta['lengths']))}, engines: "
            + "; ".join(meta["engines"])
            + (f"; end to end on `{meta['data']}`, {meta['windows']} window(s) per length, "
               "float32 both sides, llama.cpp with an f32 KV cache" if e2e else "")
            + f"; dynamic NTK {'frozen at L' if meta.get('freeze_dynamic', True) else 'not frozen'}.")
    by = any(r.exported_by != "ropescale" for r in rows)
    cols = ["engine"] + (["exported by"] if by else []) + ["strategy", "L", "verdict"]
    cols += ["max \\|Δ log p\\|", "PPL ropescale", "PPL engine"] if e2e else []
    cols += ["max rel Δθ", "max Δangle (rad)", "magnitude (ours / engine)", "source"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.engine] + ([r.exported_by] if by else []) + \
            [f"`{r.strategy}`", str(r.length), r.verdict.replace("|", "\\|")]
        if e2e:
            cells += [_fmt(r.max_abs_dlogp, ".2g") + (f" ({r.nan_positions} NaN)" if r.nan_positions else ""),
                      _fmt(r.ppl_ropescale, ".5g"), _fmt(r.ppl_engine, ".5g")]
        mag = "—" if r.magnitude_engine is None else \
            f"{_fmt(r.magnitude_ropescale, '.6g')} / {_fmt(r.magnitude_engine, '.6g')}"
        cells += [_fmt(r.max_rel_freq_diff, ".2g"), _fmt(r.max_angle_diff, ".2g"), mag, r.source]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
        name = ENGINES[engine]["label"] if engine in ENGINES else engine
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

"""The MLX engine (mlx-lm): a patched model exported for ``mlx_lm``, and its rotary code re-implemented.

mlx-lm's model modules read the rope keys of transformers 4 — a top-level ``rope_theta`` and
``rope_scaling`` (``{"type": ..., ...}``), handed to ``initialize_rope`` (``mlx_lm/models/rope_utils.py``) —
and take their dataclass defaults for keys that are missing. A folder transformers 5 saved keeps them
under ``rope_parameters`` instead, so mlx-lm 0.32.2's Llama serves it at base 10 000, unscaled, whatever
it says (``mlx_rope`` shows it on ``save_patched``'s config.json). The export therefore writes those
keys explicitly, per rope type (T = training window, s = ``factor``, A = attention factor, L = served length):

=========  ========================================================================================
default    ``rope_theta`` (vanilla, NTK's raised base, dynamic NTK frozen at a length); no ``rope_scaling``
linear     ``{"type": "linear", "factor": s}`` (``nn.RoPE(scale=1/s)``)
yarn       ``{"type": "yarn", factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
           mscale_all_dim: 0, attention_factor}`` with mscale m = (A − 1)/(0.1·ln s): ``YarnRoPE``
           multiplies q and k by (0.1·m·ln s + 1)/(0.1·0·ln s + 1) = A and never reads
           ``attention_factor`` (written for plain transformers, which reads ``rope_scaling`` too); its
           correction range is always rounded (floor/ceil), so ``truncate: false`` (gpt-oss) is refused
llama3     ``{"type": "llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}``
           (mlx-lm's window default is 8192, so T is always written)
longrope   ``{"type": "longrope", short_factor, long_factor, original_max_position_embeddings}`` with both
           factor lists = the set ropescale uses at L (``SuScaledRoPE`` uses ``long_factor`` for every
           sequence), ``max_position_embeddings`` = round(T^(A²)) (its magnitude is
           √(1 + ln(mpe/T)/ln T); ``factor`` and ``attention_factor`` are written for transformers only)
=========  ========================================================================================

Gemma 3 (``gemma3_text``) is per layer type in transformers but not in mlx-lm: a layer is sliding when
(i + 1) mod ``sliding_window_pattern`` ≠ 0, at ``rope_local_base_freq`` and never scaled; the others take
``rope_theta`` and ``rope_scaling``. Its export writes those four keys (the pattern read from
``layer_types``); a scaled sliding type, or layer types off one period, are refused. Any other model type
is refused in one line: only the modules whose rope keys were read here are exported (``MODEL_TYPES``).

Source: mlx-lm 0.32.2 (``mlx_lm/models/rope_utils.py``, ``llama.py``, ``qwen2.py``, ``qwen3.py``,
``olmo2.py``, ``gemma3_text.py``, ``utils.py`` ``MODEL_REMAPPING``) with mlx 0.32.4 (``mx.fast.rope``).
Checked against MLX itself (``tests/serving/test_real_engines.py``, marked ``engines``).

What mlx-lm reads is declared in two tables: ``ROPE_TYPES`` (rope type → ``ropescale.serving.tables.RopeRow``:
the function computing mlx-lm's rotation, the one writing transformers' rope parameters as mlx-lm's keys, the
source) and ``FAMILIES`` (the model types exported and how mlx-lm reads them). A rope type or family is one row.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropescale.serving.engines import Engine, write_model_folder
from ropescale.serving.plan import served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused, check_length, patch_handle
from ropescale.serving.tables import Family, RopeRow, families, rope_types

__all__ = ["ENGINE", "FAMILIES", "GEMMA3", "MLX_FILE", "MODEL_TYPES", "REMAP", "ROPE_TYPES", "VERSION", "MlxEngine",
           "MlxExport", "export_mlx", "mlx_layer_ropes", "mlx_model_type", "mlx_rope"]

ENGINE = "MLX"
VERSION = "mlx-lm 0.32.2"  # the release whose sources the rules and the re-implementation here were read from
MLX_FILE = "mlx.json"  # beside the exported config.json: the keys written, notes
# model type (after mlx_lm.utils.MODEL_REMAPPING) → its ModelArgs' rope_theta default; each module hands
# the top-level rope_theta and rope_scaling to initialize_rope for every layer
MODEL_TYPES = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": None, "olmo2": 10000.0}
_M = "mlx_lm/models/"
FAMILIES = families(
    Family("top_level", tuple(MODEL_TYPES), "model_type", "the top-level rope_theta (default: MODEL_TYPES) and "
           "rope_scaling handed to initialize_rope for every layer", _M + "llama.py, qwen2.py, qwen3.py, olmo2.py"),
    Family("qwen3_fallback", ("qwen3",), "model_type", "rope_parameters read where rope_theta / rope_scaling are "
           "missing (ModelArgs.__post_init__)", _M + "qwen3.py"),
    Family("gemma3_text", ("gemma3_text",), "model_type", "sliding layers ((i + 1) mod sliding_window_pattern ≠ 0) at "
           "rope_local_base_freq, never scaled; the others rope_theta (default 1 000 000) and rope_scaling, "
           "max_position_embeddings default 32768", _M + "gemma3_text.py"),
    Family("remap", ("mistral", "iquestcoder", "xverse"), "model_type", "loaded by the llama module",
           "mlx_lm/utils.py MODEL_REMAPPING (its part here)", target="llama"),
)
REMAP = {m: FAMILIES["remap"].target for m in FAMILIES["remap"].members}  # mlx_lm.utils.MODEL_REMAPPING (its part)
GEMMA3 = FAMILIES["gemma3_text"].members[0]


@dataclass
class MlxExport:
    """What to give mlx-lm.

    config: the full config.json dict to write; keys: the rope keys mlx-lm reads, as written (also in
    ``config``); serve_length: L [tokens]; notes: what the export decided and why.
    """

    config: dict[str, Any]
    keys: dict[str, Any]
    serve_length: int
    notes: list[str] = field(default_factory=list)


def export_mlx(model_or_handle, serve_length: int, *, freeze_dynamic_at: int | None = None) -> MlxExport:
    """The config.json with which mlx-lm 0.32.2 serves the patched model at ``serve_length`` = L [tokens].

    ``freeze_dynamic_at``: dynamic NTK is served static at this length F (default L).
    Raises ``ExportRefused`` ("MLX: ...", one line) for a model type outside ``MODEL_TYPES`` and
    ``gemma3_text``, relative-position rules, log-n and what the module docstring's table cannot express
    (YaRN ``truncate: false``, an attention factor below the rope type's floor, a scaled sliding
    layer of Gemma 3); ``InvalidInput`` for an unpatched model or bad lengths.
    """
    handle = patch_handle(model_or_handle)
    config = handle.model.config.to_dict()
    model_type = mlx_model_type(config)
    if model_type not in MODEL_TYPES and model_type != GEMMA3:
        raise ExportRefused(f"MLX: {VERSION}'s {model_type} model is not one whose rope keys ropescale has read "
                            f"(exported: {', '.join([*MODEL_TYPES, GEMMA3])})")
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    per_layer_type=True)
    length = served.serve_length
    notes = list(served.notes)
    if served.layer_types is None:
        if model_type == GEMMA3:
            raise ExportRefused("MLX: a gemma3_text config without rope parameters per layer type")
        keys = _translate(dict(served.rope_parameters), served.context, length, notes)
    else:
        if model_type != GEMMA3:
            raise ExportRefused(f"MLX: {VERSION}'s {model_type} model reads one set of rope parameters for every "
                                f"layer; per-layer-type patches ({handle.layer_types}) are exported for {GEMMA3}")
        keys = _gemma3(config, served, length, notes)
    # for plain transformers (NoPE layer types kept as None)
    config["rope_parameters"] = served.keyed(served.layer_types) if served.layer_types else served.rope_parameters
    config.pop("rope_scaling", None)
    config.update(keys)
    return MlxExport(config, keys, length, notes)


def mlx_model_type(config: dict[str, Any]) -> str:
    """The model module mlx-lm loads for a config.json dict (its ``MODEL_REMAPPING`` applied)."""
    model_type = str(config.get("model_type", ""))
    return REMAP.get(model_type, model_type)


def _translate(rp: dict[str, Any], ctx: dict[str, Any], length: int, notes: list[str]) -> dict[str, Any]:
    """One set of transformers rope parameters → mlx-lm's ``rope_theta``, ``rope_scaling`` and
    ``max_position_embeddings`` (the module docstring's table). ``ExportRefused`` for what it cannot say."""
    t = int(ctx["original_max_position_embeddings"])
    kind = rp["rope_type"]
    keys: dict[str, Any] = {"rope_theta": float(rp["rope_theta"]), "rope_scaling": None,
                            "max_position_embeddings": length}
    row = ROPE_TYPES.get(kind)
    if row is None or row.translate is None:  # a rope type a newer hook may write
        raise ExportRefused(f"MLX: no translation for transformers rope type {kind!r}")
    row.translate(rp, t, length, notes, keys)
    return keys


# --- translations: (rp, T, L, notes, keys) → None, mlx-lm's keys set in ``keys``, notes appended --------------

def _keep_export(rp: dict[str, Any], t: int, length: int, notes: list[str], keys: dict[str, Any]) -> None:
    """default (vanilla, NTK's raised base, frozen dynamic NTK): ``rope_theta`` only, no ``rope_scaling``."""


def _linear_export(rp: dict[str, Any], t: int, length: int, notes: list[str], keys: dict[str, Any]) -> None:
    """linear: ``{"type": "linear", "factor": s}`` (``nn.RoPE(scale=1/s)``)."""
    keys["rope_scaling"] = {"type": "linear", "factor": float(rp["factor"])}


def _yarn_export(rp: dict[str, Any], t: int, length: int, notes: list[str], keys: dict[str, Any]) -> None:
    """yarn: mscale m = (A − 1)/(0.1·ln s), ``mscale_all_dim`` 0 (the module docstring's table);
    ``ExportRefused`` for ``truncate: false`` and A ≠ 1 at s ≤ 1."""
    s = float(rp["factor"])
    if rp.get("truncate", True) is False:
        raise ExportRefused("MLX: mlx-lm's YarnRoPE always rounds YaRN's correction range (floor/ceil); "
                            "truncate: false has no setting")
    a = rp.get("attention_factor")
    a = float(a) if a is not None else 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    if s <= 1 and a != 1.0:
        raise ExportRefused(f"MLX: YarnRoPE's magnitude is 1 at factor {s:g}; attention_factor {a:g} "
                            "has no setting")
    mscale = (a - 1.0) / (0.1 * math.log(s)) if s > 1 else 1.0
    keys["rope_scaling"] = {"type": "yarn", "factor": s, "original_max_position_embeddings": t,
                            "beta_fast": float(rp.get("beta_fast", 32)), "beta_slow": float(rp.get("beta_slow", 1)),
                            "mscale": mscale, "mscale_all_dim": 0.0, "attention_factor": a}
    notes.append(f"yarn: mlx-lm reads no attention_factor; mscale {mscale:.6g} gives its magnitude {a:.6g}")


def _llama3_export(rp: dict[str, Any], t: int, length: int, notes: list[str], keys: dict[str, Any]) -> None:
    """llama3: factor, low/high_freq_factor and T always written (mlx-lm's window default is 8192)."""
    keys["rope_scaling"] = {"type": "llama3", "factor": float(rp["factor"]),
                            "low_freq_factor": float(rp["low_freq_factor"]),
                            "high_freq_factor": float(rp["high_freq_factor"]), "original_max_position_embeddings": t}


def _longrope_export(rp: dict[str, Any], t: int, length: int, notes: list[str], keys: dict[str, Any]) -> None:
    """longrope: both factor lists = the set ropescale uses at L, ``max_position_embeddings`` = round(T^(A²));
    ``ExportRefused`` for A < 1."""
    s = float(rp["factor"])
    factors = rp["long_factor"] if length > t else rp["short_factor"]
    a = float(rp["attention_factor"])
    if a < 1.0:
        raise ExportRefused(f"MLX: SuScaledRoPE's magnitude is at least 1; attention_factor {a:g} has no setting")
    keys["rope_scaling"] = {"type": "longrope", "short_factor": list(factors), "long_factor": list(factors),
                            "original_max_position_embeddings": t, "factor": s, "attention_factor": a}
    keys["max_position_embeddings"] = round(t ** (a * a))
    notes.append(f"longrope: mlx-lm uses long_factor for every sequence; both lists are the "
                 f"{'long' if length > t else 'short'} factors ropescale uses at L = {length} (T = {t})")
    notes.append(f"longrope: magnitude from max_position_embeddings = round(T^(A²)) = "
                 f"{keys['max_position_embeddings']} (A = {a:.6g}; attention_factor is not read)")


def _gemma3(config: dict[str, Any], served, length: int, notes: list[str]) -> dict[str, Any]:
    """mlx-lm's gemma3_text keys: the sliding base, the pattern, the global layers' translation."""
    types = list(config.get("layer_types") or [])
    globals_ = [i for i, lt in enumerate(types) if lt != "sliding_attention"]
    period = globals_[0] + 1 if globals_ else 0
    if not period or any((lt == "sliding_attention") != ((i + 1) % period != 0) for i, lt in enumerate(types)):
        raise ExportRefused("MLX: mlx-lm's gemma3_text makes every sliding_window_pattern-th layer global; this "
                            "model's layer_types follow no such period")
    sliding = served.layer_types.get("sliding_attention", {"rope_type": "default", "rope_theta": 10000.0})
    if sliding.get("rope_type", "default") != "default":
        raise ExportRefused(f"MLX: mlx-lm's gemma3_text gives sliding-window layers a base only "
                            f"(rope_local_base_freq); their {sliding['rope_type']!r} scaling has no setting")
    full_type = next(lt for lt in served.layer_types if lt != "sliding_attention")
    keys = _translate(dict(served.layer_types[full_type]), served.layer_contexts[full_type], length, notes)
    keys |= {"rope_local_base_freq": float(sliding["rope_theta"]), "sliding_window_pattern": period}
    notes.append(f"gemma3_text: mlx-lm reads rope_local_base_freq for the sliding layers and rope_theta/rope_scaling "
                 f"for every {period}th layer ({full_type})")
    return keys


def _inv_freq(base: float, d: int) -> torch.Tensor:
    """``mx.fast.rope`` with ``base``: θ_i = b^(−2i/d), float32."""
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def mlx_layer_ropes(config: dict[str, Any], length: int) -> dict[str | None, EngineRope]:
    """``mlx_rope`` per layer type: ``{sliding_attention, full_attention}`` for gemma3_text, else ``{None: ...}``."""
    if mlx_model_type(config) == GEMMA3:
        return {lt: mlx_rope(config, length, layer_type=lt) for lt in ("full_attention", "sliding_attention")}
    return {None: mlx_rope(config, length)}


def mlx_rope(config: dict[str, Any], length: int, *, layer_type: str | None = None) -> EngineRope:
    """What mlx-lm 0.32.2 computes for ``config`` (a config.json dict, read as mlx-lm reads it: the
    top-level ``rope_theta``/``rope_scaling``, else its dataclass defaults) over ``length`` [tokens].

    ``layer_type``: gemma3_text's ``sliding_attention`` (``rope_local_base_freq``, never scaled) or
    any other (``rope_theta``, ``rope_scaling``). Formulas (``initialize_rope``), float32:

    - default / linear: ``nn.RoPE(base, scale=1/s)``: θ_i = b^(−2i/d)/s.
    - dynamic: b' = b·(s·max(L, mpe)/mpe − (s − 1))^(d/(d−2)) recomputed per call (L: the sequence).
    - llama3: Llama 3.1 wavelength bands over ``original_max_position_embeddings`` (default 8192),
      band edges excluded.
    - yarn: the NTK-by-parts ramp over floor/ceil correction dims from ``original_max_position_embeddings``
      (default 4096), magnitude (0.1·m·ln s + 1)/(0.1·m_all·ln s + 1) (``mscale`` m default 1,
      ``mscale_all_dim`` m_all default 0); ``attention_factor`` and ``truncate`` are not read.
    - longrope: θ_i = b^(−2i/d)/``long_factor``_i for every sequence, magnitude √(1 + ln(mpe/T)/ln T) (1 if mpe ≤ T).

    ``failure`` names a model type or rope type mlx-lm does not serve this way. Raises ``InvalidInput``
    for a bad length.
    """
    length = check_length(length)
    model_type = mlx_model_type(config)
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    d = int(head)
    note = f"{VERSION} {model_type}"
    if model_type == GEMMA3:
        if layer_type == "sliding_attention":
            return EngineRope(_inv_freq(float(config.get("rope_local_base_freq", 10000.0)), d).double(), 1.0, 1.0,
                              note + " (sliding layers: rope_local_base_freq)")
        base, scaling, mpe = float(config.get("rope_theta", 1000000.0)), config.get("rope_scaling"), 32768
        note += f" ({layer_type or 'global'} layers)"
    elif model_type in MODEL_TYPES:
        base, scaling, mpe = config.get("rope_theta", MODEL_TYPES[model_type]), config.get("rope_scaling"), None
        if model_type in FAMILIES["qwen3_fallback"].members and config.get("rope_parameters"):
            base = config["rope_parameters"].get("rope_theta") if base is None else base
            scaling = config["rope_parameters"] if scaling is None else scaling
        base = float(base)
    else:
        return EngineRope(torch.full((d // 2,), math.nan, dtype=torch.float64), math.nan, 1.0, note,
                          f"MLX: no re-implementation of {VERSION}'s {model_type} model")
    mpe = config.get("max_position_embeddings", mpe)
    kind = (scaling or {}).get("type") or (scaling or {}).get("rope_type", "default")
    row = ROPE_TYPES.get(kind)
    if row is None:
        return EngineRope(_inv_freq(base, d).double() * math.nan, math.nan, 1.0, note,
                          f"MLX: rope type {kind!r} is not a frequency scaling here")
    inv, magnitude, more = row.compute(scaling, base, d, mpe, length)
    return EngineRope(inv.double(), float(magnitude), 1.0, note + more + f", rope type {kind!r}")


# --- rotations: (rope_scaling, b, d, mpe, L) → (θ float32 [d/2], magnitude, note added) ---------------------------

def _default(sc: dict[str, Any] | None, base: float, d: int, mpe: int | None, length: int
             ) -> tuple[torch.Tensor, float, str]:
    """``nn.RoPE(base)``: θ_i = b^(−2i/d)."""
    return _inv_freq(base, d) / 1.0, 1.0, ""


def _linear(sc: dict[str, Any], base: float, d: int, mpe: int | None, length: int) -> tuple[torch.Tensor, float, str]:
    """``nn.RoPE(base, scale=1/s)``: θ_i = b^(−2i/d)/s."""
    return _inv_freq(base, d) / float(sc["factor"]), 1.0, ""


def _dynamic(sc: dict[str, Any], base: float, d: int, mpe: int | None, length: int) -> tuple[torch.Tensor, float, str]:
    """``DynamicNTKScalingRoPE``: b' = b·(s·max(L, mpe)/mpe − (s − 1))^(d/(d−2)), recomputed per call."""
    s, mpe = float(sc["factor"]), int(mpe or length)
    seq = max(length, mpe)
    return _inv_freq(base * (s * seq / mpe - (s - 1)) ** (d / (d - 2)), d), 1.0, f" (dynamic: the base of {seq} tokens)"


def _llama3_row(sc: dict[str, Any], base: float, d: int, mpe: int | None, length: int
                ) -> tuple[torch.Tensor, float, str]:
    """``Llama3RoPE`` (``_llama3``)."""
    return _llama3(sc, base, d), 1.0, ""


def _yarn_row(sc: dict[str, Any], base: float, d: int, mpe: int | None, length: int) -> tuple[torch.Tensor, float, str]:
    """``YarnRoPE`` (``_yarn``)."""
    inv, magnitude = _yarn(sc, base, d)
    return inv, magnitude, ""


def _longrope(sc: dict[str, Any], base: float, d: int, mpe: int | None, length: int) -> tuple[torch.Tensor, float, str]:
    """``SuScaledRoPE``: θ_i/``long_factor``_i for every sequence, magnitude √(1 + ln(mpe/T)/ln T) (1 if mpe ≤ T)."""
    t = int(sc["original_max_position_embeddings"])
    inv = _inv_freq(base, d) / torch.tensor(sc["long_factor"], dtype=torch.float32)
    f = mpe / t
    return inv, 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(t)), ""


def _llama3(sc: dict[str, Any], base: float, d: int) -> torch.Tensor:
    """mlx-lm ``Llama3RoPE``: in periods 1/θ, medium band strictly between the edges."""
    s, low_f, high_f = float(sc["factor"]), sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    t = sc.get("original_max_position_embeddings", 8192)
    period = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    wl = 2 * math.pi * period
    period = torch.where(wl > t / low_f, period * s, period)
    medium = (wl > t / high_f) & (wl < t / low_f)
    smooth = (t / wl - low_f) / (high_f - low_f)
    return 1.0 / torch.where(medium, period / ((1 - smooth) / s + smooth), period)


def _yarn(sc: dict[str, Any], base: float, d: int) -> tuple[torch.Tensor, float]:
    """mlx-lm ``YarnRoPE``: ``(θ, magnitude)``."""
    s, t = float(sc["factor"]), sc.get("original_max_position_embeddings", 4096)
    fast, slow = sc.get("beta_fast", 32), sc.get("beta_slow", 1)

    def corr(rot: float) -> float:
        return d * math.log(t / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), d - 1)
    if low == high:
        high += 0.001

    def mscale(m: float) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    magnitude = mscale(sc.get("mscale", 1)) / mscale(sc.get("mscale_all_dim", 0))
    extra = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    inter = s * extra
    mask = 1.0 - ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / ((inter * extra) / (inter * mask + extra * (1 - mask))), magnitude


class MlxEngine(Engine):
    """MLX (mlx-lm): a model folder (``save_patched``) whose config.json carries the rope keys mlx-lm
    reads (``export_mlx``), and ``mlx.json`` (the keys, notes)."""

    name = "mlx"
    label = ENGINE
    rope_source = "ropescale.serving.mlx_rope"

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None) -> MlxExport:
        return export_mlx(handle, serve_length, freeze_dynamic_at=freeze_dynamic_at)

    def write(self, model, tokenizer, translation: MlxExport, output: Path, *, gguf=None) -> tuple[Path, list[str]]:
        record = {"serve_length": translation.serve_length, "keys": translation.keys, "notes": translation.notes}
        return write_model_folder(model, tokenizer, output, translation.config, MLX_FILE, record), []

    def rope(self, translation: MlxExport, length: int, context: dict[str, Any]) -> EngineRope | dict[str, EngineRope]:
        """``mlx_rope`` of the exported config; per layer type for gemma3_text."""
        ropes = mlx_layer_ropes(translation.config, length)
        return ropes.get(None, ropes)

    def serve_command(self, translation: MlxExport, path: Path, serve_length: int | None) -> str:
        return f"mlx_lm.server --model {path}"

    def describe(self, translation: MlxExport) -> str:
        return json.dumps({k: v for k, v in translation.keys.items() if v is not None}, default=str)


# rope type → what mlx-lm 0.32.2 computes for it (``mlx_rope``: ``initialize_rope``'s classes) and how an export
# writes it (``_translate``; None: refused)
_RU = _M + "rope_utils.py"
ROPE_TYPES = rope_types(
    RopeRow(("default",), _default, _keep_export, _RU + " (initialize_rope: nn.RoPE); mlx mx.fast.rope"),
    RopeRow(("linear",), _linear, _linear_export, _RU + " (initialize_rope: nn.RoPE, scale 1/s); mlx mx.fast.rope"),
    RopeRow(("dynamic",), _dynamic, None, _RU + " (DynamicNTKScalingRoPE)"),
    RopeRow(("llama3",), _llama3_row, _llama3_export, _RU + " (Llama3RoPE)"),
    RopeRow(("yarn",), _yarn_row, _yarn_export, _RU + " (YarnRoPE)"),
    RopeRow(("deepseek_yarn",), _yarn_row, None, _RU + " (YarnRoPE, deepseek_yarn's name)"),
    RopeRow(("longrope",), _longrope, _longrope_export, _RU + " (SuScaledRoPE)"),
)

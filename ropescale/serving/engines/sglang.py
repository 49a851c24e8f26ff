"""The SGLang engine: a patched model exported for SGLang, and SGLang's rotary code re-implemented.

SGLang 0.5.23 reads a model folder through transformers 5.19 (its pinned version), so its Llama
(``models/llama.py``) passes ``get_rope`` the standardized ``rope_parameters`` (``rope_theta``
inside) as ``rope_scaling``, the top-level ``original_max_position_embeddings`` copied into it, and
``max_position_embeddings`` (default 8192). ``get_rope`` (``layers/rotary_embedding/factory.py``)
then builds, per ``rope_type`` (T = training window, s = ``factor``, A = attention factor, L =
served length, mpe = ``max_position_embeddings``):

=========  ========================================================================================
default    ``RotaryEmbedding(base)``: vanilla, NTK (``rope_theta`` = b·s^(d/(d−2))), dynamic NTK
           frozen at a length; mpe = L
linear     ``LinearScalingRotaryEmbedding`` (θ/s); mpe = max(T, ⌈L/s⌉) (its context is mpe·s)
yarn       ``YaRNScalingRotaryEmbedding`` over ``original_max_position_embeddings``, betas and
           ``truncate`` read; its magnitude is (0.1·ln s + 1)·``attn_factor`` (the mscale ratio where
           ``mscale`` and ``mscale_all_dim`` are both set) and ``attention_factor`` is never read, so
           ``attn_factor`` = A/(0.1·ln s + 1) is written; mpe = max(⌈T·s⌉, L) (its cache grows past it)
llama3     ``Llama3RotaryEmbedding``; mpe = L
longrope   ``Phi3LongRoPEScaledRotaryEmbedding``: the long factors for a batch with any position past
           T, magnitude ``long_mscale``/``short_mscale`` (default √(1 + ln(mpe/T)/ln T), ``factor`` and
           ``attention_factor`` not read): both written as A; mpe = max(⌈T·s⌉, L); no top-level
           ``original_max_position_embeddings`` (llama.py would copy it over the rope's)
=========  ========================================================================================

Gemma 3 (``models/gemma3_causal.py``) reads each layer type's ``rope_theta`` but sets its rope
scaling to ``{"rope_type": "default"}`` on every layer — sliding and global: a scaled layer type,
whether patched or shipped (the 4B+ checkpoints' linear ×8), is not expressible, and only a raised
base (NTK, frozen dynamic NTK) is exported. ``sglang_rope`` shows what SGLang serves for a shipped
config (``--baseline``, the conformance check).

SGLang is not runnable on this project's CPU machine (its 0.5.23 wheel requires CUDA 13 packages;
its CPU backend is built from source for Intel Xeon with AMX): ``ropescale parity`` compares
through ``sglang_rope`` only, read from the wheel's sources (``sglang/srt/layers/rotary_embedding/
factory.py``, ``base.py``, ``yarn.py``, ``rope_variant.py``; ``sglang/srt/models/llama.py``,
``gemma3_causal.py``; ``sglang/srt/utils/hf_transformers/common.py`` ``get_context_length``).

What SGLang reads is declared in two tables: ``ROPE_TYPES`` (rope type → ``ropescale.serving.tables.RopeRow``:
the function computing SGLang's rotation, the one translating transformers' rope parameters, the source)
and ``FAMILIES`` (the model types and architectures SGLang treats apart: Gemma 3, DeepSeek's MLA, Ministral
3's query temperature). A rope type or family is one row.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import InvalidInput
from ropescale.rope_config import per_layer_type, text_config
from ropescale.serving.engines import Engine, write_model_folder
from ropescale.serving.plan import check_deepseek_yarn, served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused, check_length, patch_handle
from ropescale.serving.tables import DEEPSEEK_ARCHS, Family, RopeRow, families, rope_types

__all__ = ["ENGINE", "FAMILIES", "GEMMA3", "MLA_ROPE", "ROPE_TYPES", "SGLANG_FILE", "VERSION", "SglangEngine",
           "SglangExport", "export_sglang", "sglang_layer_ropes", "sglang_rope"]

ENGINE = "SGLang"
VERSION = "0.5.23"  # the release whose sources the rules and the re-implementation here were read from
SGLANG_FILE = "sglang.json"  # beside the exported config.json: context_length, notes
_ROT = "sglang/srt/layers/rotary_embedding/"

FAMILIES = families(
    Family("gemma3", ("gemma3", "gemma3_text"), "model_type",
           "each layer type's rope_theta, with rope scaling overwritten to rope_type default on every layer (an "
           "export keys rope_parameters by layer type and refuses a scaled type)",
           "sglang/srt/models/gemma3_causal.py"),
    Family("deepseek", DEEPSEEK_ARCHS, "architectures",
           "MLA attention: every scaled rope type becomes deepseek_yarn (DeepseekScalingRotaryEmbedding, ``MLA_ROPE``: "
           "the YaRN ramp always rounded) and the softmax scale is multiplied by mscale(s, mscale_all_dim)²",
           "sglang/srt/models/deepseek_v2.py; sglang/srt/configs/model_config.py compute_mla_mscale_scaling"),
    Family("ministral3", ("ministral3",), "model_type",
           "queries × 1 + β·ln(1 + ⌊p / max_position_embeddings⌋), β = rope_parameters.llama_4_scaling_beta",
           "sglang/srt/models/ministral3.py"),
)
GEMMA3 = FAMILIES["gemma3"].members


@dataclass
class SglangExport:
    """What to give SGLang: ``config`` (the config.json dict), ``context_length`` (L, its
    ``--context-length``), ``notes``."""

    config: dict[str, Any]
    context_length: int
    notes: list[str] = field(default_factory=list)

    def serve_command(self, folder: str) -> str:
        """The command serving ``folder`` at the exported context length.

        Args:
            folder: the exported model folder.

        Returns:
            ``python -m sglang.launch_server ...``.
        """
        return f"python -m sglang.launch_server --model-path {folder} --context-length {self.context_length}"


def export_sglang(model_or_handle, serve_length: int, *, freeze_dynamic_at: int | None = None) -> SglangExport:
    """The config.json with which SGLang 0.5.23 serves the patched model at ``serve_length`` = L [tokens].

    ``freeze_dynamic_at``: dynamic NTK is served static at this length F (default L).
    Raises ``ExportRefused`` ("SGLang: ...", one line) for relative-position rules, log-n, rope types without a
    translation, and Gemma 3 layer types with a scaling (see the module docstring); ``InvalidInput``
    for an unpatched model or bad lengths."""
    handle = patch_handle(model_or_handle)
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    per_layer_type=True)
    length, notes = served.serve_length, list(served.notes)
    config = handle.model.config.to_dict()
    # the class an engine builds (save_pretrained writes it; a model built from a config has none yet)
    config["architectures"] = config.get("architectures") or [type(handle.model).__name__]
    model_type = str(config.get("model_type", ""))
    # a multimodal config keeps its language model's keys under text_config, which SGLang's text model reads
    text = config["text_config"] if text_config(handle.model.config) is not handle.model.config else config
    if served.layer_types is None:
        rp = dict(served.rope_parameters)
        row = ROPE_TYPES.get(rp["rope_type"])
        if FAMILIES["deepseek"].has(config) and (row is None or not row.unscaled):
            check_deepseek_yarn(ENGINE, VERSION, rp)
        rp, mpe = _translate(rp, served.context, length, notes)
        text["rope_parameters"] = rp
        text.pop("original_max_position_embeddings", None)
    else:
        if not FAMILIES["gemma3"].has(config):
            raise ExportRefused(f"SGLang: SGLang {VERSION}'s {model_type} model reads one set of rope parameters; "
                                f"per-layer-type patches ({handle.layer_types}) are exported for Gemma 3")
        for lt, rp in served.layer_types.items():
            if rp.get("rope_type", "default") != "default":
                raise ExportRefused(f"SGLang: SGLang {VERSION}'s gemma3_causal.py rotates every layer with rope_type "
                                    f"default (its rope scaling is overwritten); the {lt} layers' "
                                    f"{rp['rope_type']!r} has no setting (a raised base, e.g. ntk, is exported)")
        text["rope_parameters"] = copy.deepcopy(served.keyed(served.layer_types))
        mpe = max(length, text.get("max_position_embeddings") or 0)
    text["max_position_embeddings"] = int(mpe)
    return SglangExport(config, length, notes)


def _translate(rp: dict[str, Any], ctx: dict[str, Any], length: int, notes: list[str]) -> tuple[dict[str, Any], int]:
    """One set of transformers rope parameters → ``(SGLang's rope parameters, max_position_embeddings)``: the
    row of ``ROPE_TYPES`` (its ``translate``; the module docstring's table)."""
    kind = rp["rope_type"]
    row = ROPE_TYPES.get(kind)
    if row is None or row.translate is None:
        raise ExportRefused(f"SGLang: no translation for transformers rope type {kind!r}")
    return rp, row.translate(rp, int(ctx["original_max_position_embeddings"]), length, notes)


# --- translations: (rp, T, L, notes) → max_position_embeddings; ``rp`` changed in place, notes appended ---------

def _keep_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> int:
    """default (vanilla, NTK's raised base, frozen dynamic NTK): as it is; mpe = L."""
    return length


def _llama3_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> int:
    """llama3: T written into the rope parameters (unless there); mpe = L."""
    rp.setdefault("original_max_position_embeddings", t)
    return length


def _linear_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> int:
    """linear: mpe = max(T, ⌈L/s⌉) (its context is mpe·s)."""
    return max(t, math.ceil(length / float(rp["factor"])))


def _yarn_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> int:
    """yarn: ``attn_factor`` = A/(0.1·ln s + 1) (the mscale ratio where ``mscale`` and ``mscale_all_dim`` are
    both set; ``attention_factor`` is never read); mpe = max(⌈T·s⌉, L)."""
    s = float(rp["factor"])
    rp.setdefault("original_max_position_embeddings", t)
    both = rp.get("mscale") is not None and rp.get("mscale_all_dim") is not None
    default = (_mscale(s, rp["mscale"]) / _mscale(s, rp["mscale_all_dim"])) if both else _mscale(s)
    a = rp.get("attention_factor")
    a = default if a is None else float(a)
    rp["attn_factor"] = a / default
    notes.append(f"yarn: SGLang reads attn_factor, not attention_factor: attn_factor = {rp['attn_factor']:.6g}")
    return max(math.ceil(t * s), length)


def _longrope_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> int:
    """longrope: ``short_mscale``/``long_mscale`` = A (``attention_factor`` is not read); mpe = max(⌈T·s⌉, L)."""
    s = float(rp["factor"])
    rp["short_mscale"] = rp["long_mscale"] = float(rp["attention_factor"])
    rp.setdefault("original_max_position_embeddings", t)
    notes.append("longrope: SGLang reads short_mscale/long_mscale, not attention_factor; the long factors "
                 f"for a batch with any position past T = {t}")
    return max(math.ceil(t * s), length)


def _mscale(s: float, m: float = 1.0) -> float:
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def _inv_freq(base: float, d: int) -> torch.Tensor:
    """``RotaryEmbedding._compute_inv_freq``: 1/b^(arange(0, d, 2)/d), float32."""
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict's language-model part (``text_config`` of a multimodal one)."""
    return config.get("text_config", config) if "num_attention_heads" not in config else config


def sglang_layer_ropes(config: dict[str, Any], length: int) -> dict[str | None, EngineRope]:
    """``sglang_rope`` per layer type where ``rope_parameters`` is keyed by layer type (each type that rotates: one
    whose parameters are None runs without position encoding, NoPE), else ``{None: ...}``."""
    sets = per_layer_type(_text(config).get("rope_parameters"))
    if sets is not None:
        return {lt: sglang_rope(config, length, layer_type=lt) for lt, rp in sets.items() if rp is not None}
    return {None: sglang_rope(config, length)}


def sglang_rope(config: dict[str, Any], length: int, *, layer_type: str | None = None) -> EngineRope:
    """What SGLang 0.5.23 computes for ``config`` (a config.json dict as transformers 5 standardizes
    it: ``rope_parameters``, else a transformers 4 ``rope_theta``/``rope_scaling``) over ``length``.

    Llama's path (the module docstring's table); Gemma 3 (``layer_type``): that type's ``rope_theta``
    with rope type ``default`` whatever the config says. ``dynamic`` is static in SGLang: the base of
    mpe·s tokens for every sequence. ``failure``: an unknown rope type, or a length past
    ``get_context_length`` (mpe, times ``factor`` unless the rope parameters name
    ``original_max_position_embeddings`` or are llama3). ``InvalidInput`` for a bad length, or a
    ``layer_type`` whose rope parameters are None (NoPE)."""
    length = check_length(length)
    model_type = str(config.get("model_type", ""))
    config_in, config = config, _text(config)
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    d = int(head * ((config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) or 1.0))
    mpe = int(config.get("max_position_embeddings", 8192))
    rp = config.get("rope_parameters")
    if not rp:
        rp = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000)}
        rp.setdefault("rope_type", rp.pop("type", "default"))
    note = f"SGLang {VERSION}"
    if FAMILIES["gemma3"].has(config_in):
        one = rp.get(layer_type or "full_attention", rp) if all(isinstance(v, dict) for v in rp.values()) else rp
        kept = one.get("rope_type", "default")
        note += f" gemma3 ({layer_type or 'global'} layers: rope_type default" + \
            (f"; the config's {kept!r} is not applied)" if kept != "default" else ")")
        return EngineRope(_inv_freq(float(one.get("rope_theta", 10000.0)), d).double(), 1.0, 1.0, note)
    if layer_type is not None and layer_type in (per_layer_type(rp) or {}) and rp[layer_type] is None:
        raise InvalidInput(f"layer_type={layer_type!r}: its rope parameters are None: those layers run without "
                           "position encoding (NoPE), nothing to rotate")
    if layer_type is not None and isinstance(rp.get(layer_type), dict):  # another per-layer-type family's type
        rp = rp[layer_type]
        d = int(head * (rp.get("partial_rotary_factor", 1.0) or 1.0))
        note += f" ({layer_type} layers)"
    rp = dict(rp)
    if config.get("original_max_position_embeddings"):
        rp["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    base = float(rp.get("rope_theta", 10000))
    row = ROPE_TYPES.get(kind)
    if FAMILIES["deepseek"].has(config_in) and (row is None or row.mla):  # DeepSeek's attention: every scaled type
        row = MLA_ROPE
    if row is None:
        return EngineRope(_inv_freq(base, d).double() * math.nan, math.nan, 1.0, note,
                          f"SGLang: rope type {kind!r} is not re-implemented here")
    out = row.compute(_Site(rp, base, d, mpe, length))
    kind = out.kind or kind
    factor = 1 if "original_max_position_embeddings" in rp or not out.scales_context else rp.get("factor", 1) or 1
    context = int(factor * mpe)
    failure = None if length <= context else (f"SGLang refuses a context length {length} > {context} derived from the "
                                              "config (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 runs it)")
    return EngineRope(out.inv.double(), float(out.magnitude), float(out.softmax), note + out.more
                      + f", rope type {kind!r}", failure, _temperature(model_type, rp, mpe))


@dataclass(frozen=True)
class _Site:
    """What a ``ROPE_TYPES`` row computes from: rope parameters ``rp``, base b, rotary dim d, mpe, the length."""

    rp: dict[str, Any]
    base: float
    d: int
    mpe: int
    length: int


@dataclass(frozen=True)
class _Computed:
    """A row's result: θ, magnitude, softmax factor, ``more`` (added to the note), ``kind`` (the type SGLang
    runs instead, DeepSeek's), ``scales_context`` (get_context_length multiplies mpe by ``factor``
    unless the rope parameters name ``original_max_position_embeddings``; llama3's never)."""

    inv: torch.Tensor
    magnitude: float = 1.0
    softmax: float = 1.0
    more: str = ""
    kind: str | None = None
    scales_context: bool = True


def _default(c: _Site) -> _Computed:
    """``RotaryEmbedding`` (base.py): θ_i = b^(−2i/d)."""
    return _Computed(_inv_freq(c.base, c.d))


def _linear(c: _Site) -> _Computed:
    """``LinearScalingRotaryEmbedding``: θ_i/s."""
    return _Computed(_inv_freq(c.base, c.d) / float(c.rp.get("factor", 1.0)))


def _dynamic(c: _Site) -> _Computed:
    """``DynamicNTKScalingRotaryEmbedding``, static: the base of mpe·s tokens for every sequence."""
    s, d = float(c.rp.get("factor", 1.0)), c.d
    return _Computed(_inv_freq(c.base * (s * s - (s - 1)) ** (d / (d - 2)), d),
                     more=" (dynamic is static: the base of mpe·s tokens)")


def _mla(c: _Site) -> _Computed:
    """DeepSeek's attention (``FAMILIES['deepseek']``): ``DeepseekScalingRotaryEmbedding``, the YaRN ramp
    always rounded, softmax × mscale(s, ``mscale_all_dim``)²."""
    s_ = float(c.rp.get("factor", 1.0))
    inv, magnitude = _yarn({**c.rp, "truncate": True}, c.base, c.d, c.mpe)
    softmax = _mscale(s_, float(c.rp.get("mscale_all_dim") or 0)) ** 2
    return _Computed(inv, magnitude, softmax, f" DeepSeek attention: deepseek_yarn, softmax scale × {softmax:.6g}",
                     "deepseek_yarn")


def _yarn_row(c: _Site) -> _Computed:
    """``YaRNScalingRotaryEmbedding`` (``_yarn``)."""
    inv, magnitude = _yarn(c.rp, c.base, c.d, c.mpe)
    return _Computed(inv, magnitude)


def _llama3_row(c: _Site) -> _Computed:
    """``Llama3RotaryEmbedding`` (``_llama3``); get_context_length never scales a llama3 context."""
    return _Computed(_llama3(c.rp, c.base, c.d, c.mpe), scales_context=False)


def _longrope(c: _Site) -> _Computed:
    """``Phi3LongRoPEScaledRotaryEmbedding``: the long factors for a batch with any position past T, magnitude
    ``long_mscale``/``short_mscale``, default √(1 + ln(mpe/T)/ln T)."""
    rp, base, d, mpe = c.rp, c.base, c.d, c.mpe
    t = int(rp.get("original_max_position_embeddings", mpe))
    long = c.length > t
    factors = torch.tensor(rp["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv = 1.0 / (factors * base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scale = mpe / t
    default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(t))
    m = rp.get("long_mscale" if long else "short_mscale")
    return _Computed(inv, default if m is None else float(m))


def _temperature(model_type: str, rp: dict[str, Any], mpe: int) -> str | None:
    """SGLang's Ministral 3 (models/ministral3.py): queries × 1 + β·ln(1 + ⌊p / max_position_embeddings⌋) with
    β = ``llama_4_scaling_beta`` — mpe where transformers divides by the rope's T (``rope.temperature_label``);
    None (not modelled) for other model types."""
    if model_type not in FAMILIES["ministral3"].members:
        return None
    beta = float(rp.get("llama_4_scaling_beta") or 0.0)
    return f"beta={beta:g}/T={mpe}" if beta else ""


def _yarn(rp: dict[str, Any], base: float, d: int, mpe: int) -> tuple[torch.Tensor, float]:
    """``YaRNScalingRotaryEmbedding`` (yarn.py): ``(θ, magnitude)``."""
    s = float(rp.get("factor", 1.0))
    t = rp.get("original_max_position_embeddings", mpe)
    if rp.get("mscale") is not None and rp.get("mscale_all_dim") is not None:
        magnitude = _mscale(s, rp["mscale"]) / _mscale(s, rp["mscale_all_dim"])
    else:
        magnitude = _mscale(s)
    magnitude *= float(rp.get("attn_factor", 1))

    def corr(rot: float) -> float:
        return d * math.log(t / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(rp.get("beta_fast", 32)), corr(rp.get("beta_slow", 1))
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    mask = (1 - ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)) * \
        float(rp.get("extrapolation_factor", 1))
    return 1.0 / (s * pos) * (1 - mask) + 1.0 / pos * mask, magnitude


def _llama3(rp: dict[str, Any], base: float, d: int, mpe: int) -> torch.Tensor:
    """``Llama3RotaryEmbedding._compute_inv_freq`` (rope_variant.py)."""
    inv = _inv_freq(base, d)
    s, low_f = float(rp.get("factor", 1.0)), float(rp.get("low_freq_factor", 1.0))
    high_f, t = float(rp.get("high_freq_factor", 4.0)), rp.get("original_max_position_embeddings", mpe)
    wl = 2 * math.pi / inv
    smooth = (t / wl - low_f) / (high_f - low_f) if low_f != high_f else 0
    scaled = torch.where(wl > t / low_f, inv / s, (1 - smooth) * inv / s + smooth * inv)
    return torch.where(wl < t / high_f, inv, scaled)


class SglangEngine(Engine):
    """SGLang: a model folder (``save_patched``) whose config.json SGLang computes ropescale's rotation
    from (``export_sglang``), and ``sglang.json`` (the context length, notes)."""

    name = "sglang"
    label = ENGINE
    rope_source = "ropescale.serving.sglang_rope"

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None) -> SglangExport:
        return export_sglang(handle, serve_length, freeze_dynamic_at=freeze_dynamic_at)

    def write(self, model, tokenizer, translation: SglangExport, output: Path, *, gguf=None) -> tuple[Path, list[str]]:
        record = {"context_length": translation.context_length, "notes": translation.notes}
        return write_model_folder(model, tokenizer, output, translation.config, SGLANG_FILE, record), []

    def rope(self, translation: SglangExport, length: int, context: dict[str, Any]
             ) -> EngineRope | dict[str, EngineRope]:
        ropes = sglang_layer_ropes(translation.config, length)
        return ropes.get(None, ropes)

    def serve_command(self, translation: SglangExport, path: Path, serve_length: int | None) -> str:
        return translation.serve_command(str(path))

    def describe(self, translation: SglangExport) -> str:
        return f"context_length {translation.context_length}"


# rope type → what SGLang 0.5.23 computes for it (``sglang_rope``) and how an export writes it (``_translate``;
# None: refused); ``mla``: computed as DeepSeek's YaRN on a DeepSeek model
ROPE_TYPES = rope_types(
    RopeRow(("default",), _default, _keep_export, _ROT + "factory.py, base.py (RotaryEmbedding)", unscaled=True),
    RopeRow(("linear",), _linear, _linear_export, _ROT + "factory.py (get_rope → LinearScalingRotaryEmbedding)"),
    RopeRow(("dynamic",), _dynamic, None, _ROT + "factory.py (get_rope → DynamicNTKScalingRotaryEmbedding)"),
    RopeRow(("yarn",), _yarn_row, _yarn_export, _ROT + "factory.py, yarn.py (YaRNScalingRotaryEmbedding)", mla=True),
    RopeRow(("llama3",), _llama3_row, _llama3_export, _ROT + "factory.py, rope_variant.py (Llama3RotaryEmbedding)",
            mla=True),
    RopeRow(("longrope",), _longrope, _longrope_export,
            _ROT + "factory.py (get_rope → Phi3LongRoPEScaledRotaryEmbedding)", mla=True),
)
# what every scaled rope type of a DeepSeek model (FAMILIES['deepseek']) computes instead
MLA_ROPE = RopeRow(("deepseek_yarn",), _mla, None, _ROT + "yarn.py (DeepseekScalingRotaryEmbedding); "
                   "sglang/srt/models/deepseek_v2.py")

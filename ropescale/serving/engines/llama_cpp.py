"""The llama.cpp engine: a patch's rotation as GGUF rope metadata, and llama.cpp's formulas re-implemented.

``gguf_rope`` translates the patch (through its transformers rope type, ``ropescale.serving.plan``)
into llama.cpp's ``{arch}.rope.*`` metadata and rope tensors; ``ropescale.serving.gguf.rewrite_gguf``
writes them into a copy of an existing GGUF (llama.cpp's converter output, say), every other key and
tensor copied unchanged through the ``gguf`` package (llama.cpp's own gguf-py; ``pip install 'ropescale[gguf]'``).
The engine is registered as ``llama.cpp`` (``export_for(model, "llama.cpp", L, OUT, gguf=BASE)``:
``OUT/model.gguf``; the old name ``gguf`` still resolves to it).

What each transformers rope type becomes (llama architecture):

=========  ===================================================================================
default    ``rope.freq_base`` = b (vanilla), b·s^(d/(d−2)) (NTK), or the frozen dynamic NTK base
linear     ``rope.scaling.type = linear``, ``rope.scaling.factor`` = s
yarn       ``type = yarn``, ``factor`` = s, ``original_context_length`` = T, and
           ``rope.scaling.attn_factor`` = A/(0.1·ln s + 1) — llama.cpp overwrites the runtime
           ``yarn_attn_factor`` with 1 and multiplies the GGUF key in; non-default betas refused
           (the llama architecture never reads ``rope.scaling.yarn_beta_*``)
llama3     ``type = none`` and the ``rope_freqs`` tensor: per-pair divisors from the model's real
           window T (llama.cpp's converter reads it from a top-level key defaulting to 8192)
longrope   ``type = none``, ``rope_freqs`` = the long (L > T) or short factors, chosen once for
           the served length, and ``attn_factor`` = the attention factor
=========  ===================================================================================

Per-layer-type models (Gemma 3, Gemma 3n: ``SWA_ARCH``) are written for their own architecture, whose
graph rotates sliding-window layers at ``rope.freq_base_swa`` unscaled and every other layer with the keys
above (``SWA_ROPE_ARCHS``): the global type's parameters as the table says, the sliding base as
``freq_base_swa``; a scaled sliding type, a YaRN attention factor other than the default (it reaches the
sliding layers too) and rope tensors (never read there) are refused. ``llama_cpp_layer_ropes`` computes
each type's rotation.

Dynamic NTK is refused unless frozen (``freeze_dynamic_at``): llama.cpp has no dynamic rope and the
converter drops it silently (the GGUF then runs vanilla RoPE).

``llama_cpp_rope`` re-implements llama.cpp's runtime rope for a GGUF's metadata: hparams in
``src/llama-model.cpp`` (``load_hparams``: ``rope.scaling.type`` defaults to ``linear``,
``rope_freq_scale_train`` = 1/``rope.scaling.factor``, ``rope.scaling.attn_factor``), cparams in
``src/llama-context.cpp`` (``yarn_ext_factor`` 1 for YaRN else 0; ``yarn_attn_factor`` overwritten
with get_mscale(s)/(1 + 0.1·ln s) then times ``rope.scaling.attn_factor``, PR #17945),
``llama_model::get_rope_factors`` (``rope_freqs``, else long/short factors by context size), and
ggml's ``ggml_rope_yarn_corr_dims``/``rope_yarn_ramp``/``rope_yarn``/``rope_cache_init``
(``ggml/src/ggml-cpu/ops.cpp``, ``ggml/src/ggml.c``), all in float32 as llama.cpp computes them —
as read in the llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (ggml 0.25.3, libllama
0.5.0; the llama architecture's tensors in ``src/models/llama.cpp``). End to end on the bundled
model, real llama.cpp on GGUFs this module wrote matched ropescale's log-probabilities within
2.4e-4 at 4T and 8T for every exported strategy.

Notation: b = ``rope_theta``, d = rotary dim (``n_rot``), T = training window, s = ``factor``,
A = attention factor (cos/sin magnitude), L = served length (``n_ctx``).

What llama.cpp reads is declared in tables (``ropescale.serving.engines.llama_cpp_keys``, re-exported
here): ``ROPE_TYPES`` (transformers rope type → ``RopeRow`` whose ``translate`` writes the keys above),
``SCALING_TYPES`` (the GGUF's ``rope.scaling.type`` → ``RopeRow`` whose ``compute`` gives ``llama_cpp_rope`` its
runtime parameters) and ``FAMILIES`` (the model types whose converter writes another architecture, and the
architectures whose graph reads rope apart). A rope type or family is one row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ropescale.errors import InvalidInput
from ropescale.rope_config import text_config
from ropescale.serving.engines import Engine
from ropescale.serving.engines.llama_cpp_keys import (
    DEEPSEEK2_TYPE,
    FAMILIES,
    ROPE_TYPES,
    SCALING_TYPES,
    SWA_ARCH,
    TEMPERATURE_ARCH,
    kind_keys,
)
from ropescale.serving.gguf import (
    DEEPSEEK2_ARCHS,
    LLAMA_CPP,
    LONGROPE_ARCHS,
    SWA_ROPE_ARCHS,
    GgufRope,
    check_arch_reads_tensors,
    gguf_module,
    rewrite_gguf,
)
from ropescale.serving.output import same_path
from ropescale.serving.plan import served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused, check_length, patch_handle

__all__ = ["ENGINE", "FAMILIES", "ROPE_TYPES", "SCALING_TYPES", "SWA_ARCH", "LlamaCppEngine", "gguf_rope",
           "llama_cpp_layer_ropes", "llama_cpp_rope"]

ENGINE = "llama.cpp"


def gguf_rope(model_or_handle, serve_length: int, *, freeze_dynamic_at: int | None = None,
              arch: str = "llama") -> GgufRope:
    """The GGUF rope metadata that makes llama.cpp rotate as the patched model does at ``serve_length``.

    See the module docstring for the table; a per-layer-type model (Gemma 3, Gemma 3n) is written
    for its llama.cpp architecture (``SWA_ARCH``, whatever ``arch`` says) by ``_layer_types``.
    Raises ``ExportRefused`` ("llama.cpp: ...", one line)
    for relative-position rules (ReRoPE, Leaky ReRoPE, SelfExtend, DCA, STRING), log-n, ``dynamic_block``,
    strategies without a transformers export hook, non-default YaRN betas, dynamic NTK
    without ``freeze_dynamic_at``, ``rope_freqs`` (llama3, longrope) for an ``arch`` that loads
    ``rope_factors_long/short`` instead (phi3, phimoe) or none (gemma3, gemma3n), and per-layer-type
    patches llama.cpp cannot apply (``_layer_types``); ``InvalidInput`` for an unpatched model or bad
    lengths; ``GgufUnavailable`` without the ``gguf`` package.
    """
    gguf = gguf_module()
    handle = patch_handle(model_or_handle)
    model_type = handle.model.config.model_type
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    freeze_default=False, per_layer_type=True,
                                    temperatures=("beta",) if model_type in TEMPERATURE_ARCH else ())
    if served.layer_types is not None:
        return _layer_types(handle, served, gguf)
    rp, ctx = served.rope_parameters, served.context
    arch = DEEPSEEK2_TYPE.get(model_type, TEMPERATURE_ARCH.get(model_type, arch))
    kv, tensors, notes = kind_keys(gguf, rp, ctx, served.serve_length, arch)
    if model_type in TEMPERATURE_ARCH:  # β where the patch keeps one, 0 (off) otherwise: a base GGUF's is replaced
        t_ = gguf.GGUFValueType
        beta = served.temperature.params["beta"] if served.temperature is not None else 0.0
        kv[f"{arch}.attention.temperature_scale"] = (float(beta), t_.FLOAT32)
        kv[f"{arch}.rope.scaling.original_context_length"] = (int(ctx["original_max_position_embeddings"]), t_.UINT32)
        notes.append(f"query temperature: attention.temperature_scale = {beta:g} (floor scale: "
                     f"original_context_length {ctx['original_max_position_embeddings']})")
    out = GgufRope(arch, kv, tensors, list(served.notes) + notes, int(ctx["dim"]), float(ctx["rope_theta"]),
                   rp["rope_type"])
    check_arch_reads_tensors(out)
    return out


def _layer_types(handle, served, gguf) -> GgufRope:
    """A per-layer-type model's GGUF rope (``ServedRope.layer_types``): its llama.cpp architecture
    (``SWA_ARCH``) rotates the sliding-window layers at ``rope.freq_base_swa`` with no scaling and
    every other layer with the ``rope.*`` keys (``SWA_ROPE_ARCHS``; converter: ``freq_base_swa``
    from ``rope_parameters.sliding_attention.rope_theta``, the scaling keys from ``full_attention``'s).
    So: the one non-sliding type's parameters as ``_kind_keys``; each sliding type's ``rope_theta``
    as ``freq_base_swa``. ``ExportRefused`` for a family llama.cpp has no such architecture for,
    other layouts than sliding + one global type, a sliding type with a scaled rope type (any but
    ``default``), sliding types with different bases or dims, and a YaRN attention factor other
    than 0.1·ln s + 1 (``rope.scaling.attn_factor`` multiplies the sliding layers' cos/sin too)."""
    config = handle.model.config
    arch = SWA_ARCH.get(config.model_type)
    if arch is None:
        more = ("; its gemma4 graph (src/models/gemma4.cpp) has a rope of its own per layer type, which ropescale "
                "has not re-implemented yet" if config.model_type.startswith("gemma4") else "")
        raise ExportRefused(f"llama.cpp: ropescale writes per-layer-type rope for the llama.cpp of {LLAMA_CPP}'s "
                            f"{', '.join(SWA_ROPE_ARCHS)} ({', '.join(SWA_ARCH)} models); {config.model_type}'s "
                            f"per-layer-type patch ({handle.layer_types}) is not exported{more}")
    sliding = [lt for lt in served.layer_types if "sliding" in lt]
    other = [lt for lt in served.layer_types if lt not in sliding]
    if not sliding or len(other) != 1:
        raise ExportRefused(f"llama.cpp: the llama.cpp of {LLAMA_CPP} gives {arch} sliding-window layers and one "
                            f"global set of rope keys; the layer types {list(served.layer_types)} do not map onto them")
    full = other[0]
    scaled = [f"{lt} ({served.layer_types[lt].get('rope_type', 'default')})" for lt in sliding
              if served.layer_types[lt].get("rope_type", "default") != "default"]
    if scaled:
        raise ExportRefused(f"llama.cpp: the llama.cpp of {LLAMA_CPP} rotates {arch}'s sliding-window layers at "
                            f"rope.freq_base_swa with no rope scaling (rope_freq_scale_train_swa is fixed at 1), so "
                            f"{', '.join(scaled)} cannot be expressed; patch {full} only (--layer-types {full})")
    bases = {float(served.layer_types[lt]["rope_theta"]) for lt in sliding}
    dims = {int(served.layer_contexts[lt]["dim"]) for lt in served.layer_types}
    if len(bases) != 1 or len(dims) != 1:
        raise ExportRefused(f"llama.cpp: the llama.cpp of {LLAMA_CPP} reads one {arch}.rope.freq_base_swa and one "
                            f"rope.dimension_count; the layer types' bases {sorted(bases)} / rotary dims "
                            f"{sorted(dims)} differ")
    rp, ctx = served.layer_types[full], served.layer_contexts[full]
    if rp["rope_type"] == "yarn" and abs(float(rp["attention_factor"]) - _yarn_default(rp)) > 1e-6:
        raise ExportRefused(f"llama.cpp: the llama.cpp of {LLAMA_CPP} multiplies every layer's cos/sin by "
                            f"rope.scaling.attn_factor, the sliding-window layers' too, so a YaRN attention_factor "
                            f"of {float(rp['attention_factor']):g} on {full} only cannot be expressed (the default "
                            f"0.1·ln s + 1 = {_yarn_default(rp):g} can)")
    kv, tensors, notes = kind_keys(gguf, rp, ctx, served.serve_length, arch)
    base_swa = bases.pop()
    kv[f"{arch}.rope.freq_base_swa"] = (base_swa, gguf.GGUFValueType.FLOAT32)
    notes = list(served.notes) + [f"{full}: {n}" for n in notes] + [
        f"{', '.join(sliding)}: rope.freq_base_swa = {base_swa:g}, unscaled (llama.cpp's sliding-window layers)"]
    kept_base = float(served.layer_contexts[sliding[0]]["rope_theta"])
    out = GgufRope(arch, kv, tensors, notes, dims.pop(), float(ctx["rope_theta"]), rp["rope_type"],
                   {lt: lt in sliding for lt in served.layer_types},
                   getattr(text_config(config), "sliding_window", None), kept_base)
    check_arch_reads_tensors(out)
    return out


def _yarn_default(rp: dict[str, Any]) -> float:
    """YaRN's default attention factor 0.1·ln s + 1 (1 for s ≤ 1)."""
    s = float(rp["factor"])
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def _value(v: Any) -> Any:
    return v[0] if isinstance(v, tuple) else v


def _arch(kv: dict[str, Any]) -> str:
    """The GGUF's architecture: ``general.architecture``, else the prefix of its ``{arch}.rope.*`` keys;
    ``InvalidInput`` (one line) when it has neither."""
    arch = kv.get("general.architecture") or next((k.split(".rope.")[0] for k in kv if ".rope." in k), None)
    if arch is None:
        raise InvalidInput("GGUF metadata without general.architecture nor any {arch}.rope.* key")
    return arch


def llama_cpp_rope(kv: dict[str, Any], tensors: dict[str, np.ndarray], n_ctx: int, head_dim: int, *,
                   yarn_beta_fast: float | None = None, yarn_beta_slow: float | None = None,
                   yarn_attn_factor: float | None = None, sliding: bool = False) -> EngineRope:
    """What llama.cpp computes for a GGUF's rope metadata ``kv`` (key → value, or ``GgufRope.kv``'s
    ``(value, type)``) and rope ``tensors`` (name → ``[d/2]``) at context size ``n_ctx`` [tokens].

    ``head_dim``: used as d when the GGUF has no ``{arch}.rope.dimension_count``. The keyword
    arguments are llama.cpp's runtime options (``--yarn-beta-fast`` …; None: unset).
    Per pair i (float32, as ggml computes it): θ_i = (b^(−2/d))^i by repeated products, divided by
    the ``rope_freqs`` divisor — or, for ``rope.scaling.type = longrope`` and Phi-3-type
    architectures, by ``rope_factors_long`` when the context padded to a multiple of 256 exceeds
    ``original_context_length``, else ``rope_factors_short`` (once per context, not per
    sequence; ``rope_freqs`` is then not loaded); times ``freq_scale`` = 1/s
    (1 for type ``none``); for YaRN mixed with the unscaled θ_i by the ramp over
    [⌊corr(β_fast)⌋, ⌈corr(β_slow)⌉], corr(β) = d·ln(T/(2πβ))/(2 ln b) — floor and ceil always, like
    transformers' ``truncate`` (its default). Magnitude: ``yarn_attn_factor`` × (1 + 0.1·ln s) for
    YaRN, where the runtime factor is overwritten by get_mscale(s)/(1 + 0.1·ln s) = 1 (so a runtime
    ``--yarn-attn-factor`` is lost) and multiplied by ``rope.scaling.attn_factor``; without YaRN
    the runtime factor (default 1) times ``rope.scaling.attn_factor``.
    ``sliding``: a sliding-window layer's rotation; in ``SWA_ROPE_ARCHS`` (gemma3: with
    ``attention.sliding_window`` > 0) base ``rope.freq_base_swa`` (default 10000) and ``freq_scale`` 1
    (YaRN's ramp then mixes equal frequencies), the runtime ``yarn_ext_factor``/``yarn_attn_factor`` of
    every layer (``rope.scaling.attn_factor`` reaches it) and no ``rope_freqs``; elsewhere as any layer.
    ``failure``: an unknown ``rope.scaling.type`` (llama.cpp aborts loading the model). deepseek2: the log
    multiplier and softmax factor (``_deepseek2_softmax``); mistral3: the query temperature (``_temperature``).
    Raises ``InvalidInput`` for a bad ``n_ctx`` or a ``kv`` without ``general.architecture``.
    """
    n_ctx = check_length(n_ctx, "n_ctx")
    kv = {k: _value(v) for k, v in kv.items()}
    arch = _arch(kv)
    r = f"{arch}.rope."
    f32 = np.float32
    n_dims = int(kv.get(r + "dimension_count", head_dim))
    base = f32(kv.get(r + "freq_base", 10000.0))
    kind = str(kv.get(r + "scaling.type", "linear"))  # llama-model.cpp: default "linear"
    factor = kv.get(r + "scaling.factor", kv.get(r + "scale_linear", 0.0)) or 0.0
    freq_scale = f32(1.0) if factor == 0.0 else f32(1.0) / f32(factor)
    n_ctx_train = int(kv.get(f"{arch}.context_length", n_ctx))
    n_orig = int(kv.get(r + "scaling.original_context_length", n_ctx_train))
    rope_attn = f32(kv.get(r + "scaling.attn_factor", 1.0))
    log_mul = _log_multiplier(kv, r, arch)
    note = f"llama.cpp rope.scaling.type {kind!r}"
    swa = sliding and arch in SWA_ROPE_ARCHS and (arch != "gemma3" or
                                                  float(kv.get(f"{arch}.attention.sliding_window", 0) or 0) > 0)
    if sliding:
        note += "; sliding-window layer: rope.freq_base_swa, unscaled" if swa else "; sliding layer rotated as global"
    row = SCALING_TYPES.get(kind)
    if row is None:
        nan = torch.full((n_dims // 2,), math.nan, dtype=torch.float64)
        return EngineRope(nan, math.nan, 1.0, note, f"llama.cpp aborts loading: unknown rope.scaling.type {kind!r}")
    freq_scale, ext, longrope = row.compute(freq_scale)
    attn = f32(1.0 if yarn_attn_factor is None else yarn_attn_factor)
    if ext != 0:
        attn = _yarn_attn_factor(f32(1.0) / freq_scale, log_mul, deepseek2=arch in DEEPSEEK2_ARCHS)
        if yarn_attn_factor is not None:
            note += f"; runtime yarn_attn_factor {yarn_attn_factor:g} overwritten"
    attn = f32(attn * rope_attn)
    beta_fast = f32(32.0 if yarn_beta_fast is None else yarn_beta_fast)
    beta_slow = f32(1.0 if yarn_beta_slow is None else yarn_beta_slow)
    for key in ("scaling.yarn_beta_fast", "scaling.yarn_beta_slow"):
        if r + key in kv and arch == "llama":
            note += f"; {r + key} not read by the llama architecture"
    if swa:  # llama_model::get_rope_freq_base/scale: the sliding layers' own base, rope_freq_scale_train_swa = 1
        base, freq_scale = f32(kv.get(r + "freq_base_swa", 10000.0)), f32(1.0)

    def corr_dim(n_rot):
        return f32(n_dims) * f32(math.log(f32(n_orig) / (f32(n_rot) * f32(2) * f32(math.pi)))) / (
            f32(2) * f32(math.log(base)))

    low = max(f32(0), f32(math.floor(corr_dim(beta_fast))))
    high = min(f32(n_dims - 1), f32(math.ceil(corr_dim(beta_slow))))
    ff, more = _factors(arch, longrope, tensors, n_ctx, n_orig)
    note += more
    out = _thetas(n_dims, base, ff, freq_scale, ext, low, high)
    magnitude = attn * (f32(1.0) + f32(0.1) * f32(math.log(f32(1.0) / freq_scale))) if ext != 0 else attn
    softmax = _deepseek2_softmax(attn, freq_scale, log_mul) if arch in DEEPSEEK2_ARCHS else 1.0
    return EngineRope(torch.from_numpy(out), float(magnitude), softmax, note,
                      temperature=_temperature(kv, arch, n_orig))


def _temperature(kv: dict[str, Any], arch: str, n_orig: int) -> str | None:
    """The query temperature of a mistral3 GGUF (``rope.temperature_label``; "" for none): β from
    ``attention.temperature_scale``, the floor scale n_ctx_orig_yarn; None (not modelled) for other architectures."""
    if arch not in TEMPERATURE_ARCH.values():
        return None
    beta = float(kv.get(f"{arch}.attention.temperature_scale", 0.0) or 0.0)
    return f"beta={beta:g}/T={n_orig}" if beta else ""


def _log_multiplier(kv: dict[str, Any], r: str, arch: str) -> float:
    """The YaRN log multiplier M the runtime reads: deepseek2 only (src/models/deepseek2.cpp), as the
    converter's 0.1·``mscale_all_dim`` divided back by 0.1; 0 for every other architecture."""
    return float(kv.get(r + "scaling.yarn_log_multiplier", 0.0)) / 0.1 if arch in DEEPSEEK2_ARCHS else 0.0


def _deepseek2_softmax(attn, freq_scale, log_mul: float) -> float:
    """src/models/deepseek2.cpp: kq_scale = mscale²/√d with mscale = attn·(1 + 0.1·ln(1/f))·(1 + 0.1·M·ln(1/f))
    (``attn``: the graph's attn_factor, f: freq_scale, M: the log multiplier): the factor on the softmax scale."""
    f32 = np.float32
    ln = f32(math.log(f32(1.0) / freq_scale))
    return float((attn * (f32(1.0) + f32(0.1) * ln) * (f32(1.0) + f32(0.1) * f32(log_mul) * ln)) ** 2)


def _factors(arch: str, longrope: bool, tensors: dict[str, np.ndarray], n_ctx: int, n_orig: int
             ) -> tuple[np.ndarray | None, str]:
    """``(frequency factors [d/2] or None, note)`` the graph of ``arch`` passes ``ggml_rope_ext``:
    none for ``SWA_ROPE_ARCHS``; ``rope_factors_long/short`` for ``longrope`` (rope.scaling.type) and Phi-3
    types, by the context ``n_ctx`` padded to a multiple of 256 against T = ``n_orig`` (llama-context.cpp);
    otherwise ``rope_freqs``."""
    if arch in SWA_ROPE_ARCHS:
        return None, ""
    if longrope or arch in LONGROPE_ARCHS:
        n_ctx_seq = -(-n_ctx // 256) * 256
        long = n_ctx_seq > n_orig
        ff = tensors.get("rope_factors_long.weight" if long else "rope_factors_short.weight")
        return ff, f"; {'long' if long else 'short'} factors (context {n_ctx_seq} after padding, T = {n_orig})"
    return tensors.get("rope_freqs.weight", tensors.get("rope_freqs")), ""


def llama_cpp_layer_ropes(kv: dict[str, Any], tensors: dict[str, np.ndarray], n_ctx: int, head_dim: int,
                          swa_types: dict[str, bool]) -> dict[str | None, EngineRope]:
    """``llama_cpp_rope`` per layer type: ``swa_types`` (``GgufRope.swa_types``: layer type → rotated
    as a sliding-window layer) → each type's rotation; ``{None: ...}`` for an empty one (one set)."""
    if not swa_types:
        return {None: llama_cpp_rope(kv, tensors, n_ctx, head_dim)}
    return {lt: llama_cpp_rope(kv, tensors, n_ctx, head_dim, sliding=is_swa) for lt, is_swa in swa_types.items()}


def _yarn_attn_factor(s, log_mul: float, *, deepseek2: bool = False):
    """llama-context.cpp's runtime ``yarn_attn_factor`` for YaRN of factor ``s`` (float32):
    get_mscale(s)/(1 + 0.1·ln s), get_mscale(s) = mscale(s, m)/mscale(s, log_mul) when the
    architecture read a ``yarn_log_multiplier`` (m = 1; for ``deepseek2`` m = log_mul when it is not 1:
    its ``TAG_DEEPSEEK2_YARN_LOG_MUL_FIX``), else mscale(s, 1)."""
    f32 = np.float32

    def mscale(scale, m):
        return f32(1.0) if scale <= 1 else f32(0.1) * f32(m) * f32(math.log(scale)) + f32(1.0)

    m = log_mul if deepseek2 and log_mul != 1.0 else 1.0
    attn = mscale(s, m) / mscale(s, log_mul) if log_mul != 0 else mscale(s, 1.0)
    return f32(attn * (f32(1.0) / (f32(1.0) + f32(0.1) * f32(math.log(s)))))


def _thetas(n_dims: int, base, ff, freq_scale, ext, low, high) -> np.ndarray:
    """ggml's ``rope_cache_init`` / ``rope_yarn`` per pair i (float32): θ_i = (b^(−2/d))^i by
    repeated products, divided by the factor ``ff[i]`` (None: 1), times ``freq_scale``, mixed
    with the unscaled θ_i by the YaRN ramp over [low, high] when ``ext`` ≠ 0. ``[d/2]`` float64."""
    f32 = np.float32
    theta_scale = f32(base ** f32(-2.0 / n_dims))
    theta = f32(1.0)
    out = np.empty(n_dims // 2, dtype=np.float64)
    for i in range(n_dims // 2):
        extrap = f32(theta / f32(ff[i])) if ff is not None else theta
        interp = f32(freq_scale * extrap)
        value = interp
        if ext != 0:
            y = f32((i - low) / max(f32(0.001), f32(high - low)))  # rope_yarn_ramp: i0/2 = i
            mix = f32((f32(1) - min(f32(1), max(f32(0), y))) * ext)
            value = f32(interp * (f32(1) - mix) + extrap * mix)
        out[i] = value
        theta = f32(theta * theta_scale)
    return out


class LlamaCppEngine(Engine):
    """llama.cpp: ``OUT/model.gguf``, the base GGUF (``gguf=``) with its rope metadata rewritten
    (``gguf_rope``, ``ropescale.serving.gguf.rewrite_gguf``); dynamic NTK only frozen
    (``freeze_dynamic_at``), never by default."""

    name = "llama.cpp"
    label = ENGINE
    folder = False
    reads_gguf = True
    rope_source = "ropescale.serving.llama_cpp_rope"

    def check(self, output: Path, *, gguf: Path | None) -> None:
        if gguf is None:
            raise InvalidInput(f"the {self.name} engine rewrites an existing GGUF: give the unpatched model's "
                               "(--gguf BASE.gguf)")
        if not Path(gguf).is_file():
            raise InvalidInput(f"{gguf}: no such GGUF file")
        if same_path(output / "model.gguf", gguf):
            raise InvalidInput(f"{output / 'model.gguf'}: writing over the source GGUF; choose another output folder")

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None) -> GgufRope:
        return gguf_rope(handle, serve_length, freeze_dynamic_at=freeze_dynamic_at)

    def write(self, model, tokenizer, translation: GgufRope, output: Path, *, gguf=None) -> tuple[Path, list[str]]:
        return rewrite_gguf(gguf, output / "model.gguf", translation), []  # staged there: whole or nothing

    def rope(self, translation: GgufRope, length: int, context: dict[str, Any]
             ) -> EngineRope | dict[str, EngineRope]:
        """``llama_cpp_rope`` of the metadata as a GGUF of the model holds it (``context_length`` T,
        ``rope.dimension_count`` d; a llama-architecture one, or for a per-layer-type export its own
        architecture with ``attention.sliding_window``): per layer type (``llama_cpp_layer_ropes``)
        for a per-layer-type export."""
        dim = translation.dim or context["dim"]
        arch = translation.arch if translation.swa_types or translation.arch in DEEPSEEK2_ARCHS + tuple(
            TEMPERATURE_ARCH.values()) else "llama"
        kv = {"general.architecture": arch, f"{arch}.context_length": context["original_max_position_embeddings"],
              f"{arch}.rope.dimension_count": dim, **translation.for_arch(arch).kv}
        if translation.sliding_window:
            kv[f"{arch}.attention.sliding_window"] = translation.sliding_window
        ropes = llama_cpp_layer_ropes(kv, translation.tensors, length, dim, translation.swa_types)
        return ropes.get(None, ropes)

    def serve_command(self, translation: GgufRope, path: Path, serve_length: int) -> str:
        return f"llama-cli -m {path} -c {serve_length}"

    def describe(self, translation: GgufRope) -> str:
        return ", ".join(f"{k.split('rope.')[-1]}={v[0] if isinstance(v, tuple) else v}"
                         for k, v in translation.kv.items()) + \
            "".join(f", {n}[{a.size}]" for n, a in translation.tensors.items())


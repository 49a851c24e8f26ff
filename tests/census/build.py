"""Tiny random models of every causal-LM type, built from each type's own config class.

``tiny_config(t)`` starts from the config class's defaults (the architecture as its authors
declare it) and shrinks what it finds, in sub-configs too:

- sizes: ``SIZES`` (hidden size, intermediate sizes, experts, low ranks, windows, …);
- head dims (``HEAD_DIMS``: head_dim, MLA's qk_rope/qk_nope/v head dims, indexer and linear-
  attention heads, …) all scaled by one factor, so that their equalities, sums and ratios —
  MLA's v_head_dim ≠ qk head dim, Gemma 4's global head twice the local one — survive; the
  hidden size stays heads × head_dim where the default config has it so;
- the vocabulary to ``VOCAB``, with the config's special-token ids moved into its top 16;
- the fewest layers (at least 2) whose *layer signature* — at each layer index, the tuple of
  every per-layer list of the config (layer_types, no_rope_layers, mlp_only_layers,
  layers_block_type, …) — takes the same set of values as in the default config: NoPE every
  4th layer, sliding:full 5:1, hybrid linear-attention or Mamba layers, dense-then-MoE all stay;
- towers of multimodal types (vision, audio): one small layer.

Weights: random from ``SEED``, ``initializer_range`` ``INIT`` (sharper attention than the usual
0.02, which leaves attention near uniform and hides a wrong rotation), and noise on parameters a
model initialises to a constant (norm weights, gates): a zero q/k norm (ZAYA's) would make
attention blind to positions, a unit one commute with rotations that a trained one does not.

Per-family overrides (``OVERRIDES``) apply only where the generic shrink fails, each with the
reason. ``build(t)`` returns the model in eval mode, float64 by default.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig

from tests.census.catalog import CausalLMType

__all__ = ["MAX_POS", "OVERRIDES", "SEED", "VOCAB", "build", "text_config", "tiny_config"]

SEED = 0
VOCAB = 128  # tokens; the census feeds ids below VOCAB - 16, special tokens sit above
MAX_POS = 32  # max_position_embeddings [tokens]: the tiny training window, below the census lengths
INIT = 0.2  # initializer_range: sharper attention than 0.02, so positions move logits visibly
HEAD_DIM = 32  # the largest head dim of the tiny config [channels]

SIZES: dict[str, Any] = {
    "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "ffn_hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": MAX_POS,
    "original_max_position_embeddings": MAX_POS, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "n_group": 1, "num_expert_group": 1, "topk_group": 1, "top_k_experts": 2,
    "zero_expert_num": 2, "expert_ffn_hidden_size": 32, "kv_lora_rank": 16, "q_lora_rank": 16,
    # indexers select fewer keys than the relative rules' window (checks.WINDOW): DSA's top-k keys, MiniMax
    # M3's top-k blocks of index_block_size keys (plus its local block)
    "index_n_heads": 2, "index_topk": 4, "index_block_size": 2, "index_topk_blocks": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_num_heads": 4, "linear_head_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_d_ssm": 32, "mamba_chunk_size": 16,
    "n_mamba_heads": 4, "mamba_headdim": 8, "lru_width": 64, "attention_window_size": 16,
    "sliding_window": 16, "attention_chunk_size": 16,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "image_size": 28, "patch_size": 14,
    "initializer_range": INIT,
}
HEAD_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim",
             "linear_key_head_dim", "linear_value_head_dim", "swa_head_dim", "global_head_dim")
KV_HEADS = ("num_key_value_heads", "num_global_key_value_heads", "swa_num_key_value_heads")
AT_MOST = {"num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2}  # never more than the default (ZAYA allows 1 only)
# None in some defaults, yet the model needs them
REQUIRED = {"num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1}
TOWER_LAYERS = ("num_hidden_layers", "depth", "num_layers")  # one layer each in non-text towers
TOWER_SIZES = {"hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 2, "num_heads": 2,
               "embed_dim": 32, "out_hidden_size": 64}


def _fields(cfg: PreTrainedConfig) -> dict[str, Any]:
    """The config's own values, under their field names and their aliases (``attribute_map``:
    Dbrx's ``d_model`` is also ``hidden_size``); read from ``__dict__``: no per-layer-attribute
    guard, no properties."""
    own = {k: v for k, v in cfg.__dict__.items() if not k.startswith("_")}
    return own | {alias: own[real] for alias, real in type(cfg).attribute_map.items() if real in own}


def _declared(cls, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` under the config class's field names, keeping only declared fields: a value the
    config derives in ``__post_init__`` (Zamba2's ``mamba_headdim``) must be derived again, and
    an undeclared kwarg would be set after the derivation and override it."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in kw.items():
        k = k if k in names else cls.attribute_map.get(k, k)
        if k in names:
            out[k] = v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


def _per_layer(f: dict[str, Any]) -> tuple[dict[str, list], dict[str, list]]:
    """The config's per-layer lists (one value per layer: layer_types, no_rope_layers, …) and its
    layer-index lists (strictly increasing indices: moe_layers, hybrid_layer_ids, …)."""
    n = f.get("num_hidden_layers")
    per, idx = {}, {}
    if not _is_int(n) or n < 1:
        return per, idx
    for k, v in sorted(f.items()):
        if not isinstance(v, (list, tuple)) or "token" in k:
            continue
        ints = v and all(_is_int(x) for x in v)
        if ints and all(a < b for a, b in zip(v, v[1:])) and v[-1] < n and len(v) > 1:
            idx[k] = list(v)
        elif len(v) == n:
            per[k] = list(v)
    return per, idx


def _fewest_layers(f: dict[str, Any]) -> int:
    """The fewest layers (≥ 2) whose signatures — per layer, the tuple of every per-layer list's
    value and of its membership in every index list — take every value the full stack takes."""
    per, idx = _per_layer(f)
    n = f["num_hidden_layers"]
    sig = [tuple(str(v[i]) for v in per.values()) + tuple(i in v for v in idx.values()) for i in range(n)]
    everything = set(sig)
    return next(k for k in range(2, max(n, 2) + 1) if set(sig[:k]) == everything) if n >= 2 else n


def _token_ids(f: dict[str, Any]) -> dict[str, Any]:
    """Special-token ids ≥ VOCAB moved to distinct ids in [VOCAB - 16, VOCAB)."""
    out, free = {}, iter(range(VOCAB - 1, VOCAB - 17, -1))
    for k, v in sorted(f.items()):
        if not ("token_id" in k or "token_index" in k):
            continue
        if _is_int(v) and v >= VOCAB:
            out[k] = next(free)
        elif isinstance(v, list) and v and all(_is_int(x) for x in v) and max(v) >= VOCAB:
            out[k] = [x if x < VOCAB else next(free) for x in v]
    return out


def _head_scale(f: dict[str, Any], extra: list[dict[str, Any]] = ()) -> float | None:
    """The one factor of every head dim: the largest of ``f`` and of ``extra`` (per-layer overrides) → HEAD_DIM."""
    dims = [d[k] for d in (f, *extra) for k in HEAD_DIMS if _is_int(d.get(k)) and d[k] > 0]
    return HEAD_DIM / max(dims) if dims else None


def _shrink(f: dict[str, Any], text: bool, scale: float | None = None) -> dict[str, Any]:
    """kwargs shrinking one (sub-)config whose values are ``f`` (head dims × ``scale``, default
    ``_head_scale(f)``)."""
    kw = {k: v for k, v in SIZES.items() if _is_int(f.get(k)) or (k == "initializer_range" and k in f)}
    kw |= {k: min(v, f[k]) for k, v in AT_MOST.items() if _is_int(f.get(k))}
    if not text:
        kw |= {k: v for k, v in TOWER_SIZES.items() if _is_int(f.get(k))}
        kw |= {k: 1 for k in TOWER_LAYERS if _is_int(f.get(k))}
    heads, hidden = f.get("num_attention_heads"), f.get("hidden_size")
    if "head_dim" in f and f["head_dim"] is None and _is_int(heads) and _is_int(hidden):
        f = {**f, "head_dim": hidden // heads}  # required by the model; the default leaves it None
    scale = scale or _head_scale(f)
    kw |= {k: _even(f[k] * scale) for k in HEAD_DIMS if _is_int(f.get(k)) and f[k] > 0}
    if _is_int(f.get("rotary_dim")) and _is_int(heads) and _is_int(hidden):  # GPT-J, CodeGen: a share of the head
        kw["rotary_dim"] = _even(f["rotary_dim"] * (64 // kw.get("num_attention_heads", heads)) / (hidden // heads))
    if _is_int(hidden):
        if _is_int(heads) and _is_int(f.get("head_dim")) and heads * f["head_dim"] == hidden:
            kw["hidden_size"] = kw.get("num_attention_heads", heads) * kw["head_dim"]  # kept heads × head_dim
        else:
            kw.setdefault("hidden_size", 64 if text else TOWER_SIZES["hidden_size"])
    for k in KV_HEADS:
        if k in f and (f[k] is None or (_is_int(f[k]) and f[k] > 0)):
            kw[k] = kw.get("num_attention_heads", 4) if f[k] in (None, heads) else 2  # None: as many as heads
    if all(_is_int(f.get(k)) for k in ("mamba_d_head", "mamba_n_heads", "mamba_expand")):  # the config checks it
        inner = kw["mamba_d_ssm"] if "mamba_d_ssm" in kw else f["mamba_expand"] * kw["hidden_size"]
        kw["mamba_d_head"] = inner // kw["mamba_n_heads"]
    for k, v in REQUIRED.items():
        if k in f and f[k] is None:
            kw[k] = v
    if _is_int(f.get("vocab_size")):
        kw["vocab_size"] = VOCAB
        kw |= _token_ids(f)
    return kw


def _layer_kwargs(f: dict[str, Any], n: int) -> dict[str, Any]:
    """The per-layer lists cut to the first ``n`` layers, the index lists to indices below ``n``
    (the config's own pattern, not recomputed: some configs hard-code it for their default depth);
    per-layer sizes (Gemma 3n's intermediate_size, Laguna's heads per layer) shrunk like scalars."""
    per, idx = _per_layer(f)
    kw: dict[str, Any] = {"num_hidden_layers": n}
    heads = f.get("num_attention_heads")
    for k, v in per.items():
        v = v[:n]
        if all(_is_int(x) for x in v):
            if k in SIZES:
                v = [SIZES[k]] * n
            elif "heads" in k:
                v = [SIZES["num_attention_heads"] if x == heads else 2 for x in v]
        kw[k] = v
    return kw | {k: [i for i in v if i < n] for k, v in idx.items()}


def text_config(cfg: PreTrainedConfig) -> PreTrainedConfig:
    """The config holding the language model's layers (``cfg`` itself for text-only types)."""
    try:
        return cfg.get_text_config()
    except ValueError:  # several candidates (MusicGen's text encoder and decoder): the decoder
        return getattr(cfg, "decoder", cfg)


# --- per-family overrides, each with why ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Override:
    why: str
    text: dict[str, Any] = dataclasses.field(default_factory=dict)  # kwargs of the text config
    sub: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # sub-config name → kwargs


OVERRIDES: dict[str, Override] = {}


def _override(names: str, why: str, sub: dict[str, dict[str, Any]] | None = None, **text) -> None:
    for name in names.split():
        OVERRIDES[name] = Override(why, text, sub or {})


_override("bamba", "the class default declares no attention layer (attn_layer_indices=None); Bamba-9B has "
          "attention at layers 9, 18, 27", attn_layer_indices=[1])
_override("granitemoehybrid", "the class default is Mamba-only (layer_types all linear_attention); Granite 4.0-H "
          "interleaves attention layers", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
_override("recurrent_gemma", "block_types cycles recurrent, recurrent, attention: the first attention block is "
          "the 3rd layer", num_hidden_layers=3)
_override("dbrx", "modeling_dbrx.py reads attn_config.rope_theta, which the class default's attn_config lacks "
          "(DBRX checkpoints' config.json carry it), nor clip_qkv, which it clamps with",
          sub={"attn_config": {"rope_theta": 500000.0, "kv_n_heads": 2, "clip_qkv": 8.0}})
_override("gemma3n_text", "the last num_kv_shared_layers (15 of 35) reuse earlier layers' KV, which needs a "
          "producer of each layer type before them: 5 of 10 layers, a multiple of the 5-layer pattern",
          num_hidden_layers=10, num_kv_shared_layers=5)
_override("lfm2_moe", "the class default leaves layer_types None, which modeling_lfm2_moe.py indexes; LFM2 "
          "checkpoints mix conv and attention layers (first num_dense_layers=2 dense)",
          num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"])
_override("qwen4_exp qwen4_exp_text", "the class default leaves the QSA indexer's sizes None, yet "
          "indexed_attention layers build the indexer (token_budget // compress_ratio)",
          indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=4, indexer_compress_ratio=2)
_override("minimax_m3_vl_text", "the class default declares every layer full_attention, so no layer builds the "
          "block-sparse indexer; MiniMax M3 checkpoints interleave minimax_m3_sparse layers",
          num_hidden_layers=2, layer_types=["full_attention", "minimax_m3_sparse"])
_override("dots3_note", "the vision tower's default MoE pyramid names layers 25-41 in per_layer_config: one "
          "dense layer instead; the towers' adapters sized to the tiny towers (their validators check it)",
          sub={"vision_config": {"mlp_layer_types": ["dense"], "pyramid_num_routed": [-1], "adapter_in_dim": 32,
                                 "adapter_out_dim": 64},
               "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}})
_override("gptj codegen roformer", "RoPE from a sinusoidal table of max_position_embeddings rows, indexed by position: "
          "64 rows for the census's 48 positions", max_position_embeddings=64)
_override("longcat_flash", "Longcat-Flash declares num_layers (28) blocks of two attention sub-layers each; "
          "num_hidden_layers is derived", num_layers=1)
_override("cohere_compass_text", "the class default leaves rope_parameters empty, which the rotary module indexes "
          "per layer type: M-RoPE (sections scaled to the tiny head) on sliding layers, None (NoPE) on full ones, "
          "as the module allows", num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [4, 2, 2]}, "full_attention": None})
_override("kolibri1_1", "transformers 5.25: the class default's 12 indexer heads exceed the tiny model's query heads "
          "per key head, and its pool (16384), local (128) and sink (8) tokens cover every census key: "
          "one indexer head, a pool of 8 keys in blocks of 2, 2 local and 1 sink token (selection below the rules' "
          "window); 10 layers: two NoPE indexed layers, the second reading the first's keys and values",
          num_hidden_layers=10, index_num_heads=1, index_pool_size=8, index_compression=2, index_num_local_tokens=2,
          index_num_sink_tokens=1)
_override("reformer", "ReformerModelWithLMHead asserts is_decoder", is_decoder=True)
_override("gpt_neo", "attention_types ([[global, local], 12]) must expand to num_layers", num_layers=2,
          attention_types=[[["global", "local"], 1]])
_override("mamba2", "the config checks num_heads × head_dim = expand × hidden_size", num_heads=4, head_dim=32)
_BLT_PART = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
             "intermediate_size": 64}
_override("blt", "four stacks (patcher, local encoder, global transformer, local decoder) whose widths must agree "
          "(the local stacks declare the global width in hidden_size_global), and hash embeddings of 500002 rows",
          encoder_hash_byte_group_vocab=64,
          sub={"encoder_config": _BLT_PART | {"hidden_size_global": 64},
               "decoder_config": _BLT_PART | {"hidden_size_global": 64, "num_hidden_layers": 2},
               "global_config": _BLT_PART | {"num_hidden_layers": 2}, "patcher_config": _BLT_PART})


def tiny_config(t: CausalLMType) -> PreTrainedConfig:
    """The tiny config of type ``t`` (the class's default rope parameters: scaling as shipped)."""
    default = t.config_class()
    text = text_config(default)
    over = OVERRIDES.get(t.name, Override(""))
    f = _fields(text)
    spec = text.__dict__.get("_heterogeneity_spec")  # per-layer overrides (Gemma 4's global head_dim, Dots3's MLA)
    per_layer = dict(spec.per_layer_overrides) if spec is not None else {}
    scale = _head_scale(f, list(per_layer.values()))
    tkw = _shrink(f, True, scale)
    n = f.get("num_hidden_layers")
    if _is_int(n):
        n = over.text.get("num_hidden_layers") or _fewest_layers(f)
        tkw |= _layer_kwargs(f, n)
    extra = {}
    if per_layer:
        extra["per_layer_config"] = {i: {k: v for k, v in _shrink(f | d, True, scale).items() if k in d}
                                     for i, d in per_layer.items() if not _is_int(i) or i < n}
    top = {}
    for k, v in _fields(default).items():
        if isinstance(v, PreTrainedConfig) and v is not text:  # towers, and the parts of composite LMs
            top[k] = type(v)(**_declared(type(v), _shrink(_fields(v), False)) | over.sub.get(k, {}))
    if text is default:
        return t.config_class(**_declared(t.config_class, tkw) | extra | over.text | top)
    key = next(k for k, v in _fields(default).items() if v is text)
    top[key] = type(text)(**_declared(type(text), tkw) | extra | over.text)
    return t.config_class(**top)


def build(t: CausalLMType, config: PreTrainedConfig | None = None, state_dict=None, dtype=torch.float64):
    """The model of ``t`` as ``AutoModelForCausalLM.from_config`` builds it (what a user gets; a
    composite config gives its text model where the mapping says so) from ``config`` (default
    ``tiny_config(t)``; deep-copied: models keep their config), seeded, eval mode, in ``dtype``
    (float64 by default, so that rounding, which deep or recurrent stacks such as HRM's amplify
    to 1e-3 in float32, never passes for a wrong rotation or hides one; experts run eagerly, as
    torch's grouped matmul takes no float64); ``state_dict`` loaded when given."""
    cfg = copy.deepcopy(config if config is not None else tiny_config(t))
    torch.manual_seed(SEED)
    text = text_config(cfg)
    if text is not cfg and t.model_class.config_class is type(text) and not hasattr(cfg, "text_config"):
        model = t.model_class(text).eval()  # MusicGen: the causal LM takes the decoder config (not text_config)
    else:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():  # constant parameters (zero-initialised norms, gates, biases) get noise: a zero
        for p in model.parameters():  # q/k norm (ZAYA's) makes attention blind to positions in a random model
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p) * INIT)
    model = model.to(dtype)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model

"""What each layer does with positions (``ropescale.rotary.probe``) and the per-layer report, on the model
families of 2025–26 whose layers differ: NoPE layers (SmolLM3, Llama 4, Cohere 2), interleaving decided in
attention (GLM), a mirrored rotate_half (NanoChat), MLA with its rotary channels last and narrower values
(DeepSeek-V3), several frequency sets (Gemma 3), proportional RoPE (Gemma 4), half-width cos/sin
(gpt-oss). The oracle for each is the model's own config, which decides these things in its modeling file —
not what ropescale reads."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

import ropescale
from ropescale.rotary import rotate_pairs

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None)
FULL_LAST = ["sliding_attention"] * 3 + ["full_attention"]

FAMILIES = {  # name: (config class, model class, overrides)
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {"no_rope_layer_interval": 2}),
    "llama4": (T.Llama4TextConfig, T.Llama4ForCausalLM,
               {"head_dim": 16, "num_local_experts": 2, "intermediate_size_mlp": 96}),
    "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM, {"sliding_window": 8, "layer_types": FULL_LAST}),
    "glm": (T.GlmConfig, T.GlmForCausalLM, {"head_dim": 16}),
    "nanochat": (T.NanoChatConfig, T.NanoChatForCausalLM, {}),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                    {"q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 12, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "first_k_dense_replace": 4, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               {"head_dim": 16, "sliding_window": 8, "layer_types": FULL_LAST}),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM,
                {"head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 8,
                 "layer_types": FULL_LAST}),
}


def build(name: str):
    cfg_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**SMALL, **extra})).eval()


def expected_rope_layers(name: str, cfg) -> list[bool]:
    """Which layers rotate, as each family's config decides it (its modeling file reads these)."""
    n = cfg.num_hidden_layers
    if name in ("smollm3", "llama4"):
        return [bool(x) for x in cfg.no_rope_layers[:n]]  # 1: the layer uses RoPE
    if name == "cohere2":  # Cohere 2: RoPE on sliding-window layers only
        return [t == "sliding_attention" for t in cfg.layer_types[:n]]
    return [True] * n


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_probe_reads_each_layers_contract_from_the_model(name):
    model = build(name)
    cfg = model.config
    layers = ropescale.patching.probe_layers(model, *ropescale.rotary.rotary_sites(model))
    assert [info.rotates for info in layers] == expected_rope_layers(name, cfg)
    assert [info.index for info in layers] == list(range(cfg.num_hidden_layers))
    for info in (i for i in layers if i.rotates):
        assert info.kind == "rope"
        if name == "deepseek_v3":  # MLA: q = [nope | rope], values of their own width
            assert (info.start, info.dim, info.head_dim, info.v_head_dim) == (16, 8, 24, 12)
        elif name == "glm":  # partial rotary (0.5), pairs interleaved by its apply_rotary_pos_emb
            assert (info.start, info.dim, info.interleaved) == (0, 8, True)
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            assert (info.start, info.dim) == (0, head_dim)
        assert info.interleaved == (name in ("glm", "cohere2", "llama4"))
        assert info.sign == (-1 if name == "nanochat" else 1)
        if name in ("gemma3",):  # each layer uses its own layer type's frequencies
            assert info.site.layer_type == cfg.layer_types[info.index]


def _layer_io(model, ids):
    """Per attention layer: its input hidden states and output, captured by hooks."""
    seen = {}

    def hook(module, args, kwargs, out):
        seen[module] = (kwargs.get("hidden_states", args[0] if args else None), out[0])

    attn = [m for n, m in model.named_modules() if n.endswith(("self_attn", "attention")) and n.count(".") == 3]
    hooks = [m.register_forward_hook(hook, with_kwargs=True) for m in attn]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits, [seen[m] for m in attn], attn


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("strategy,params", [("rerope", {"window": 6}), ("dca", {"chunk_size": 12,
                                                                            "local_window": 2})])
def test_relative_rules_act_on_the_rotating_layers_only(name, strategy, params):
    """Inside the window the rule is vanilla; past it the logits move; a layer without RoPE computes
    exactly what it computed unpatched from the same input (its input replaced by the unpatched one)."""
    model = build(name)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    ref, io, attn = _layer_io(model, ids)
    short = ids[:, :5]
    with torch.no_grad():
        ref_short = model(short).logits
    with ropescale.patch(model, strategy, **params) as h, torch.no_grad():
        torch.testing.assert_close(model(short).logits, ref_short, rtol=0, atol=1e-5)
        assert (model(ids).logits - ref).abs().max() > 1e-4
        nope = [m for m, info in zip(attn, h.layers) if not info.rotates]
        for m in nope:  # feed each NoPE layer its unpatched input: bit-identical output
            i = attn.index(m)
            got = {}

            def swap(module, args, kwargs, i=i):
                kwargs["hidden_states"] = io[i][0]
                return args, kwargs

            def grab(module, args, kwargs, out, got=got):
                got["out"] = out[0]

            hs = [m.register_forward_pre_hook(swap, with_kwargs=True), m.register_forward_hook(grab, with_kwargs=True)]
            model(ids)
            for x in hs:
                x.remove()
            assert torch.equal(got["out"], io[i][1])


def test_the_report_names_every_layer():
    model = build("llama4")
    with ropescale.patch(model, "yarn", factor=4.0) as h:
        rows = h.report()
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert rows[3] == {"layer": 3, "module": "model.layers.3.self_attn", "rope": "none",
                       "applied": "no RoPE, untouched",  # Llama 4's NoPE-layer temperature, its config's defaults
                       "temperature": "llama4:attn_scale=0.1,floor_scale=8192 (model's, kept)"}
    assert rows[0]["applied"] == "yarn" and rows[0]["rotary_dim"] == 16 and rows[0]["layout"] == "interleaved"
    assert rows[0]["rope_theta"] == model.config.rope_parameters["rope_theta"]
    model = build("gemma3")
    with ropescale.patch(model, "linear", factor=2.0) as h:  # by default only the full-attention layers
        applied = {r["layer"]: r["applied"] for r in h.report()}
    assert applied == {0: "kept", 1: "kept", 2: "kept", 3: "linear"}


def test_rotate_pairs_against_the_rotation_written_out():
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    angles = torch.rand(5, 4, dtype=torch.float64) * 6
    got = rotate_pairs(x, angles, start=2, interleaved=True)
    want = x.clone()
    for i in range(4):
        a, b = 2 + 2 * i, 3 + 2 * i
        c, s = angles[:, i].cos(), angles[:, i].sin()
        want[..., a] = x[..., a] * c - x[..., b] * s
        want[..., b] = x[..., b] * c + x[..., a] * s
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)


def test_a_model_whose_attention_cannot_be_observed_refuses_relative_rules_only():
    from ropescale.attention import AttentionNotPluggableError

    model = build("glm")
    copy.deepcopy(model)
    model.set_attn_implementation = lambda name: (_ for _ in ()).throw(ValueError("no custom attention"))
    with ropescale.patch(model, "linear", factor=2.0) as h:  # frequencies need no observation
        assert h.layers is None and h.report() == []
    with pytest.raises(AttentionNotPluggableError, match="could not be observed"):
        ropescale.patch(model, "rerope", window=4)


@pytest.mark.parametrize("name", ["gemma4_text", "qwen3_5_text"])
def test_the_report_on_gemma4_and_qwen3_5_follows_their_configs(name):
    """Gemma 4: θ and rope type per layer type, proportional RoPE on the global layers at their own
    global_head_dim; Qwen3.5: its Gated DeltaNet layers hold no attention and are "no RoPE" rows
    (main left them out: only attention-interface layers were reported), its full-attention
    layers rotate partial_rotary_factor · head_dim channels. The oracle is each config, built by the
    census's tiny builder, and the model's own decoder layers."""
    from tests.census.build import build as census_build
    from tests.census.build import text_config
    from tests.census.run import types

    model = census_build(types()[name])
    tc = text_config(model.config)
    kinds = list(dict.fromkeys(tc.layer_types))
    with ropescale.patch(model, "yarn", factor=2.0, **({"layer_types": kinds} if name == "gemma4_text" else {})) as h:
        rows = h.report()
    assert [r["layer"] for r in rows] == list(range(tc.num_hidden_layers))  # every decoder layer
    linear = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer, "self_attn")]
    assert linear == [i for i, t in enumerate(tc.layer_types) if t == "linear_attention"]
    assert bool(linear) == (name == "qwen3_5_text")
    for i in linear:  # Gated DeltaNet: no positions anywhere in it
        assert rows[i] == {"layer": i, "module": f"model.layers.{i}", "rope": "none", "layer_type": "linear_attention",
                           "applied": "no RoPE (linear_attention), untouched", "temperature": ""}
    for r in (r for r in rows if r["layer"] not in linear):
        lt = tc.layer_types[r["layer"]]
        rp = tc.rope_parameters[lt] if name == "gemma4_text" else tc.rope_parameters
        assert (r["rope"], r["applied"]) == ("rope", "yarn")
        assert r["rope_type"] == rp["rope_type"] and r["rope_theta"] == rp["rope_theta"]
        if name == "gemma4_text":  # global layers: their own head size, proportional (zero pairs kept)
            assert r["rotary_dim"] == tc.per_layer_config[r["layer"]].head_dim
            assert (r["rope_type"] == "proportional") == (lt == "full_attention")
        else:
            assert r["rotary_dim"] == int(tc.head_dim * rp["partial_rotary_factor"])

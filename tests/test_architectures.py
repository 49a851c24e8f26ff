"""The architecture × strategy conformance matrix.

For every RoPE family: a vanilla patch is bit-identical, unpatch restores logits bit for bit,
and each strategy transformers implements gives the logits of the same weights built with
transformers' own ``rope_parameters`` (fp32, ≤ 1e-5).
"""

import pytest
import torch
import transformers as T

import ropescale
from tests.families import FAMILIES, family_config, family_model

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0))  # past max_pos 64


@torch.no_grad()
def logits(model):
    return model(IDS).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_is_bit_identical_and_unpatch_restores(family):
    model = family_model(family)
    base = logits(model)
    with ropescale.patch(model, "vanilla"):
        assert torch.equal(logits(model), base)
    with ropescale.patch(model, "yarn", factor=4.0):
        assert not torch.equal(logits(model), base)
    assert torch.equal(logits(model), base)


def half_dim(model):
    (_, module), = ropescale.find_rotary_modules(model)
    return next(b.numel() for n, b in module.named_buffers() if n.endswith("inv_freq") and "original" not in n)


SHORT_LONG = lambda n: ([1.0 + 0.1 * i for i in range(n)], [1.0 + 2.0 * i for i in range(n)])

# (ours, our params, transformers' rope_parameters, patch kwargs); n = rotary pairs
CASES = {
    "linear": lambda n: ({"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic_ntk": lambda n: ({"factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}, {}),
    "yarn": lambda n: ({"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                       {}),
    "llama3": lambda n: ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}, {"original_max_position_embeddings": 16}),
    "longrope": lambda n: ({"short_factor": SHORT_LONG(n)[0], "long_factor": SHORT_LONG(n)[1], "factor": 2.0},
                           {"rope_type": "longrope", "short_factor": SHORT_LONG(n)[0], "long_factor": SHORT_LONG(n)[1],
                            "original_max_position_embeddings": 32}, {"original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("strategy", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_builtin(family, strategy):
    model = family_model(family)
    n = half_dim(model)
    ours, native_rope, kwargs = CASES[strategy](n)
    if family == "phi3" and strategy != "longrope":
        if strategy != "linear":
            pytest.skip("Phi3's config accepts only default and longrope rope types")
        # linear == longrope with constant factors s and no attention scaling
        native_rope = {"rope_type": "longrope", "short_factor": [4.0] * n, "long_factor": [4.0] * n,
                       "original_max_position_embeddings": 64, "attention_factor": 1.0}
    native = family_model(family, model.state_dict(), **native_rope)
    with ropescale.patch(model, strategy, **ours, **kwargs):
        got = logits(model)
    torch.testing.assert_close(got, logits(native), rtol=0, atol=1e-5)


def test_gemma3_patches_full_attention_by_default_and_both_on_request():
    model = family_model("gemma3")
    sliding = model.model.rotary_emb.sliding_attention_inv_freq
    with ropescale.patch(model, "linear", factor=4.0) as h:
        assert h.layer_types == ["full_attention"]
        assert model.model.rotary_emb.sliding_attention_inv_freq is sliding  # kept, to the tensor
        assert {r["applied"] for r in h.report() if r["frequencies"].endswith("[sliding_attention]")} == {"kept"}
    cfg = family_config("gemma3", rope_type="linear", factor=4.0)
    cfg.rope_parameters["sliding_attention"] = {**cfg.rope_parameters["sliding_attention"],
                                                "rope_type": "linear", "factor": 4.0}
    torch.manual_seed(0)
    native_both = T.Gemma3ForCausalLM(cfg).eval()
    native_both.load_state_dict(model.state_dict())
    with ropescale.patch(model, "linear", factor=4.0, layer_types=["sliding_attention", "full_attention"]):
        torch.testing.assert_close(logits(model), logits(native_both), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="layer_types \\['global'\\] not in"):
        ropescale.patch(model, "linear", factor=2.0, layer_types=["global"])


def test_phi3_training_window_is_read_from_its_config():
    with ropescale.patch(family_model("phi3"), "yarn", factor=2.0) as h:
        assert h.context["original_max_position_embeddings"] == 32  # not max_position_embeddings (64)


def test_olmo_keeps_float32_cos_sin_in_bf16():
    model = family_model("olmo")  # bf16 activations; frequencies stay float32 buffers
    pos = torch.arange(10)[None]
    x = torch.zeros(1, 10, 64, dtype=torch.bfloat16)
    cos_ref, _ = model.model.rotary_emb(x, pos)
    with ropescale.patch(model, "vanilla"):
        cos, _ = model.model.rotary_emb(x, pos)
    assert cos_ref.dtype == cos.dtype == torch.float32 and torch.equal(cos, cos_ref)


@pytest.mark.parametrize("config_cls,model_cls", [(T.CohereConfig, T.CohereForCausalLM),
                                                  (T.Starcoder2Config, T.Starcoder2ForCausalLM)])
def test_family_outside_the_list_works_through_the_same_hooks(config_cls, model_cls):
    """Cohere interleaves its cos/sin (θ0 θ0 θ1 θ1 …); detected by probing, not by name."""
    import copy

    from tests.families import COMMON
    cfg = config_cls(**COMMON)
    torch.manual_seed(0)
    model = model_cls(copy.deepcopy(cfg)).eval()
    base = logits(model)
    with ropescale.patch(model, "vanilla"):
        assert torch.equal(logits(model), base)
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 64}
    native = model_cls(cfg).eval()
    native.load_state_dict(model.state_dict())
    with ropescale.patch(model, "yarn", factor=4.0):
        torch.testing.assert_close(logits(model), logits(native), rtol=0, atol=1e-5)


def test_phi3_5_moe_recomputing_its_frequencies_is_patched_and_restored():
    """PhimoeRotaryEmbedding recomputes inv_freq from its config at every call and scales cos/sin by
    the shipped short/long mscale (Phi-3.5-MoE ships longrope): vanilla is the unscaled model and
    linear equals transformers' own linear rope type (at mscale 1); unpatch gives the shipped model back bit for bit."""
    sizes = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64)
    half = 8  # head_dim 16
    shipped = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
               "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + i for i in range(half)],
               "short_mscale": 1.1, "long_mscale": 1.3}

    def build(rope):
        torch.manual_seed(0)
        return T.PhimoeForCausalLM(T.PhimoeConfig(**sizes, rope_parameters=dict(rope))).eval()

    ids = torch.randint(3, 64, (1, 40))
    with torch.no_grad():
        model = build(shipped)
        before = model(ids).logits
        plain = build({"rope_type": "default", "rope_theta": 10000.0})(ids).logits
        linear = build({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0,  # cos/sin × mscale:
                        "original_max_position_embeddings": 16, "short_mscale": 1.0, "long_mscale": 1.0})(ids).logits
        assert (before - plain).abs().max() > 1e-3  # the shipped scaling does move the logits
        with ropescale.patch(model, "vanilla"):
            torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=1e-5)
        with ropescale.patch(model, "linear", factor=2.0):
            torch.testing.assert_close(model(ids).logits, linear, rtol=0, atol=1e-5)
        assert torch.equal(model(ids).logits, before)
        assert model.config.rope_parameters["rope_type"] == "longrope"


@pytest.mark.parametrize("strategy", ["rerope", "yarn"])
def test_the_layer_report_gives_each_layer_types_own_theta(strategy):
    """Gemma 3's sliding layers rotate with θ = 10⁴, its global ones with 10⁶ (the config's per-type
    rope_parameters): the report says so under a relative rule (one rule, from the global type's
    context) as under a frequency rule."""
    model = family_model("gemma3")
    cfg = model.config.rope_parameters
    with ropescale.patch(model, strategy, **({"window": 16} if strategy == "rerope" else {"factor": 2.0})) as h:
        theta = {r["frequencies"].rsplit("[", 1)[1].rstrip("]"): r["rope_theta"] for r in h.report()}
    assert theta == {lt: cfg[lt]["rope_theta"] for lt in ("sliding_attention", "full_attention")}
    assert theta["sliding_attention"] != theta["full_attention"]

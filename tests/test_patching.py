"""patch/unpatch on real transformers models: exact restore, and logits equal to transformers'
own rope_parameters for the types it implements (the oracle)."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaForCausalLM

import ropescale
from tests.conftest import build, tiny_llama_config

IDS = {L: torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(L)) for L in (40, 64, 65, 200)}


@torch.no_grad()
def logits(model, L):
    return model(IDS[L]).logits


@pytest.mark.parametrize("L", [40, 200])
def test_vanilla_patch_is_bit_identical_and_unpatch_restores(tiny_llama, L):
    base = logits(tiny_llama, L)
    original, inv_freq = tiny_llama.model.rotary_emb, tiny_llama.model.rotary_emb.inv_freq
    with ropescale.patch(tiny_llama, "vanilla") as h:
        # the model's own module, its buffer swapped for the strategy's (equal values, another tensor)
        assert tiny_llama.model.rotary_emb is original and tiny_llama.model.rotary_emb.inv_freq is not inv_freq
        assert h.active and torch.equal(logits(tiny_llama, L), base)
    assert tiny_llama.model.rotary_emb.inv_freq is inv_freq and ropescale.current_patch(tiny_llama) is None
    assert torch.equal(logits(tiny_llama, L), base)


def test_patch_then_unpatch_restores_logits_exactly(tiny_llama):
    base = logits(tiny_llama, 200)
    h = ropescale.patch(tiny_llama, "yarn", factor=4.0)
    changed = logits(tiny_llama, 200)
    h.unpatch()
    assert not torch.equal(changed, base)  # the patch did something
    assert torch.equal(logits(tiny_llama, 200), base)
    h.unpatch()  # idempotent
    ropescale.unpatch(tiny_llama)  # no-op without a patch


ORACLES = [  # (our strategy, params, transformers rope_parameters)
    ("linear", {"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ("linear", {"factor": 1.5}, {"rope_type": "linear", "factor": 1.5}),
    ("yarn", {"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("yarn", {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0},
     {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 64}),
    ("dynamic_ntk", {}, {"rope_type": "dynamic", "factor": 1.0}),
    ("dynamic_ntk", {"factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}),
]


@pytest.mark.parametrize("strategy,params,rope", ORACLES, ids=lambda x: str(x) if isinstance(x, str) else None)
@pytest.mark.parametrize("L", [40, 64, 65, 200])
def test_logits_match_transformers_builtin(tiny_llama, strategy, params, rope, L):
    native = build(LlamaForCausalLM, tiny_llama_config(**rope), tiny_llama.state_dict())
    expected = logits(native, L)
    with ropescale.patch(tiny_llama, strategy, **params):
        got = logits(tiny_llama, L)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_ntk_equals_vanilla_model_with_raised_rope_theta(tiny_llama):
    s, d = 4.0, 16
    native = build(LlamaForCausalLM, tiny_llama_config(rope_theta=10000.0 * s ** (d / (d - 2))),
                   tiny_llama.state_dict())
    with ropescale.patch(tiny_llama, "ntk", factor=s):
        torch.testing.assert_close(logits(tiny_llama, 200), logits(native, 200), rtol=0, atol=1e-5)


def test_partial_rotary_dim_is_honoured():
    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    model = build(GPTNeoXForCausalLM, cfg)
    base = logits(model, 200)
    rot_dim = 2 * ropescale.find_rotary_modules(model)[0][1].inv_freq.numel()
    assert rot_dim == 4  # 25 % of head_dim 16
    with ropescale.patch(model, "vanilla") as h:
        assert h.context["dim"] == 4
        assert torch.equal(logits(model, 200), base)
    cfg_lin = GPTNeoXConfig(**{**cfg.to_dict(),
                               "rope_parameters": {**cfg.rope_parameters, "rope_type": "linear", "factor": 4.0}})
    native = build(GPTNeoXForCausalLM, cfg_lin, model.state_dict())
    with ropescale.patch(model, "linear", factor=4.0):
        torch.testing.assert_close(logits(model, 200), logits(native, 200), rtol=0, atol=1e-5)


def test_model_without_rotary_embedding_gets_clear_error():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ropescale.NoRotaryEmbeddingError, match="no rotary embedding.*inv_freq"):
        ropescale.patch(model, "yarn", factor=2)


def test_bad_inputs_raise_clear_errors(tiny_llama):
    with pytest.raises(ropescale.UnknownStrategyError, match="known strategies"):
        ropescale.patch(tiny_llama, "rope_magic")
    with pytest.raises(ValueError, match="factor is required"):
        ropescale.patch(tiny_llama, "yarn")
    with ropescale.patch(tiny_llama, "linear", factor=2), pytest.raises(ValueError, match="already patched"):
        ropescale.patch(tiny_llama, "ntk", factor=2)


def test_original_max_position_embeddings_override(tiny_llama):
    with ropescale.patch(tiny_llama, "dynamic_ntk", original_max_position_embeddings=256) as h:
        assert h.context["original_max_position_embeddings"] == 256
        got = logits(tiny_llama, 200)  # 200 < 256: dynamic stays vanilla
    assert torch.equal(got, logits(tiny_llama, 200))


def test_save_patched_and_load_back(tmp_path, tiny_model_dir):
    model, tok = ropescale.load_model(str(tiny_model_dir))
    ids = torch.randint(0, 100, (1, 100))
    with torch.no_grad():
        ropescale.patch(model, "yarn", factor=4.0, beta_fast=16.0)
        expected = model(ids).logits
        ropescale.save_patched(model, tok, tmp_path / "out")
        loaded, _ = ropescale.load_model(str(tmp_path / "out"))
        h = ropescale.current_patch(loaded)
        assert h.strategy == "yarn" and h.params["beta_fast"] == 16.0
        assert torch.equal(loaded(ids).logits, expected)
    with pytest.raises(ValueError, match="not patched"):
        ropescale.save_patched(loaded.__class__(loaded.config), tok, tmp_path / "x")


def test_patch_refuses_a_model_on_the_meta_device():
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(ValueError, match="is on the meta device .*: no weights to patch; load the model"):
        ropescale.patch(model, "yarn", factor=2)
    assert ropescale.current_patch(model) is None


@pytest.mark.parametrize("strategy,options,named", [
    ("rerope", {"layer_types": ["bogus"]}, "layer_types=['bogus']"),
    ("rerope", {"dynamic_block": 7}, "dynamic_block=7"),
    ("yarn", {"dynamic_cache": "rerotate", "factor": 2.0}, "dynamic_cache='rerotate'"),
    ("linear", {"attention_path": "naive", "factor": 2.0}, "attention_path='naive'"),
])
def test_options_a_strategy_does_not_use_are_refused(tiny_llama, strategy, options, named):
    import ropescale

    with pytest.raises(ValueError) as e:
        ropescale.patch(tiny_llama, strategy, **options)
    assert str(e.value).startswith(f"{strategy} does not use {named} ")
    assert ropescale.current_patch(tiny_llama) is None


def test_options_a_strategy_uses_are_accepted(tiny_llama):
    import ropescale

    with ropescale.patch(tiny_llama, "dynamic_ntk", dynamic_block=7, dynamic_cache="rerotate"):
        pass
    with ropescale.patch(tiny_llama, "rerope", window=8, attention_path="naive", block_size=16):
        pass


def _cos(inv_freq, positions):
    freqs = positions[:, None].double() * inv_freq.double()[None]  # [s, d/2]
    return torch.cat([freqs, freqs], -1).cos()  # [s, d]: the rotate-half layout


def test_train_at_sets_the_length_dynamic_strategies_train_for(tiny_llama):
    """In training mode L = max(train_at length, positions); the oracle is the dynamic NTK formula
    b' = b·(L/T)^(d/(d−2)) (factor 1) written out here, with T = 64, L = 256, d = 16."""
    pos = torch.arange(40)
    x = torch.zeros(1, 40, 16)
    exponent = torch.arange(0, 16, 2).double() / 16
    vanilla, stretched = 1e4 ** -exponent, (1e4 * 4.0 ** (16 / 14)) ** -exponent
    with ropescale.patch(tiny_llama, "dynamic_ntk") as h:
        rotary = tiny_llama.model.rotary_emb
        h.train_at(256)
        rotary.train()
        torch.testing.assert_close(rotary(x, pos[None])[0][0].double(), _cos(stretched, pos), rtol=0, atol=1e-5)
        rotary.eval()  # evaluation: L from the positions (40 < T): vanilla
        torch.testing.assert_close(rotary(x, pos[None])[0][0].double(), _cos(vanilla, pos), rtol=0, atol=1e-5)
        h.train_at(None)
        rotary.train()
        torch.testing.assert_close(rotary(x, pos[None])[0][0].double(), _cos(vanilla, pos), rtol=0, atol=1e-5)
        for bad in (0, 2.5, True, "256"):
            with pytest.raises(ValueError, match=f"training length {bad!r} must be a whole number"):
                h.train_at(bad)
    tiny_llama.eval()
    with pytest.raises(RuntimeError, match="patch has been undone"):
        h.train_at(256)


def test_train_at_is_harmless_for_truncation_rules(tiny_llama):
    with ropescale.patch(tiny_llama, "rerope", window=16) as h:
        h.train_at(256)  # nothing depends on L

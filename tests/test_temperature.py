"""Query temperature (``ropescale.temperature``): each rule against the model family that ships it or its
formula written out, and exact under the KV cache."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T
from transformers import DynamicCache

import ropescale
from ropescale.errors import InvalidInput
from ropescale.temperature import Temperature, parse_temperature
from tests.conftest import with_cache

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, head_dim=16)
IDS = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(0))


def ministral(beta: float):
    rp = {"rope_type": "default", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
          "llama_4_scaling_beta": beta}
    torch.manual_seed(0)
    return T.Ministral3ForCausalLM(T.Ministral3Config(**SMALL, rope_parameters=rp)).eval()


@pytest.mark.parametrize("strategy,params", [("vanilla", {}), ("rerope", {"window": 1000})])
def test_beta_is_mistrals_llama_4_scaling_beta(strategy, params):
    """Ministral 3 multiplies queries by 1 + β·ln(1 + ⌊p/T⌋) itself; the same weights with β = 0 and
    ropescale's ``beta`` rule give its logits (T = 32, positions to 150: five steps)."""
    shipped, plain = ministral(0.3), ministral(0.0)
    plain.load_state_dict(shipped.state_dict())
    with torch.no_grad():
        want = shipped(IDS).logits
        assert (plain(IDS).logits - want).abs().max() > 1e-3  # the rule matters here
        with ropescale.patch(plain, strategy, temperature="beta:beta=0.3", **params):
            torch.testing.assert_close(plain(IDS).logits, want, rtol=0, atol=1e-5)


def test_the_rules_against_their_formulas():
    pos = torch.tensor([[0, 5, 31, 32, 100, 8191, 8192, 70000]])
    p = pos.double()
    logn = torch.clamp(torch.log(p + 1) / math.log(32), min=1)
    llama4 = 1 + 0.1 * torch.log(1 + torch.floor((p + 1) / 8192))
    beta = 1 + 0.2 * torch.log(1 + torch.floor(p / 32))
    torch.testing.assert_close(Temperature("logn").factor(pos, 32).double(), logn, rtol=1e-6, atol=0)
    torch.testing.assert_close(Temperature("llama4").factor(pos, 32).double(), llama4, rtol=1e-6, atol=0)
    torch.testing.assert_close(parse_temperature("beta:beta=0.2").factor(pos, 32).double(), beta, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rule", ["llama4:floor_scale=16", "beta:beta=0.5"])
def test_cached_decoding_equals_the_full_forward(tiny_llama, rule):
    prompt = IDS[:, :40] % 256
    with torch.no_grad(), ropescale.patch(tiny_llama, "yarn", factor=4.0, temperature=rule):
        cache = DynamicCache(config=tiny_llama.config)
        out = tiny_llama(prompt, **with_cache(cache), use_cache=True)
        ids = prompt
        for _ in range(40):  # past T = 64: the factor steps up while decoding
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            out = tiny_llama(nxt, **with_cache(cache), use_cache=True)
            torch.testing.assert_close(out.logits[:, -1], tiny_llama(ids).logits[:, -1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad,message", [
    ("cold", "temperature 'cold' unknown; choose one of logn, llama4, beta"),
    ("beta:gamma=1", "temperature beta: unknown parameter 'gamma'; it takes beta"),
    ("beta:beta=-1", "beta=-1.0 must be a finite number > 0"),
    ("beta:beta=nan", "beta=nan must be a finite number > 0"),
    ("beta:beta", "write parameters as name=value"),
    (3, "give a kind"),
])
def test_bad_temperatures_are_one_line(tiny_llama, bad, message):
    with pytest.raises(InvalidInput, match=message.replace("(", "\\(").replace(")", "\\)")):
        ropescale.patch(tiny_llama, "vanilla", temperature=bad)
    with pytest.raises(InvalidInput, match="name one query temperature"):
        ropescale.patch(tiny_llama, "vanilla", logn=True, temperature="beta")
    assert ropescale.current_patch(tiny_llama) is None


def test_the_option_is_recorded_and_travels_through_a_strategy_spec():
    from ropescale.runs.config import parse_strategy

    spec = parse_strategy("yarn:factor=4,temperature={kind: beta, beta: 0.2}")
    assert spec.params == {"factor": 4} and spec.display == "yarn:factor=4+beta:beta=0.2"
    model = ministral(0.0)
    with ropescale.patch(model, "yarn", factor=2.0, temperature=spec.temperature) as h:
        assert h.options == {"temperature": "beta:beta=0.2"} and h.to_dict()["temperature"] == "beta:beta=0.2"


def _transformers_ministral(beta: float, rope_type: str, **scaling):
    """The same weights as ``ministral(beta)`` with transformers' own scaled rope type and β in the config."""
    rp = {"rope_type": rope_type, "rope_theta": 10000.0, "original_max_position_embeddings": 32,
          "llama_4_scaling_beta": beta, **scaling}
    model = T.Ministral3ForCausalLM(T.Ministral3Config(**SMALL, rope_parameters=rp)).eval()
    model.load_state_dict(ministral(beta).state_dict())
    return model


@pytest.mark.parametrize("strategy,rope_type,params", [("linear", "linear", {"factor": 4.0}),
                                                       ("yarn", "yarn", {"factor": 4.0})])
def test_native_temperature_keeps_the_models_own(strategy, rope_type, params):
    """``temperature="native"`` keeps Ministral 3's shipped β: the patched model equals transformers' own
    linear/yarn with β kept; by default the strategy removes it (β = 0), as the report says."""
    shipped = ministral(0.3)
    with torch.no_grad():
        kept, dropped = _transformers_ministral(0.3, rope_type, **params), _transformers_ministral(0.0, rope_type,
                                                                                                    **params)
        assert (kept(IDS).logits - dropped(IDS).logits).abs().max() > 1e-3  # β matters at these positions
        with ropescale.patch(shipped, strategy, temperature="native", **params) as h:
            torch.testing.assert_close(shipped(IDS).logits, kept(IDS).logits, rtol=0, atol=1e-5)
            assert h.options["temperature"] == "native"
            assert {r["temperature"] for r in h.report()} == {"beta:beta=0.3 (model's, kept)"}
        with ropescale.patch(shipped, strategy, **params) as h:
            torch.testing.assert_close(shipped(IDS).logits, dropped(IDS).logits, rtol=0, atol=1e-5)
            assert {r["temperature"] for r in h.report()} == {"beta:beta=0.3 (model's) removed"}
        with ropescale.patch(shipped, strategy, temperature="logn", **params) as h:
            assert {r["temperature"] for r in h.report()} == {"beta:beta=0.3 (model's) replaced by logn"}
        assert shipped.config.rope_parameters["llama_4_scaling_beta"] == 0.3  # unpatched: β is back


def test_llama4_keeps_its_nope_layer_temperature_and_the_report_says_so():
    """Llama 4's attn_temperature_tuning acts in its NoPE layers, outside RoPE: every strategy keeps it. Its
    attention gets no position_ids: log-n takes them from the rotary module's call (T = 16: factor 1 below it)."""
    cfg = T.Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             no_rope_layers=[1, 1, 1, 0], attn_temperature_tuning=True, floor_scale=16,
                             attn_scale=0.2, num_local_experts=2, pad_token_id=None, max_position_embeddings=16)
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(cfg).eval()
    ids = IDS[:1, :40]
    with torch.no_grad():
        ref = model(ids).logits
        with ropescale.patch(model, "vanilla", logn=True) as h:
            got = model(ids).logits
            cells = {r["rope"]: r["temperature"] for r in h.report()}
    assert torch.equal(got[:, :16], ref[:, :16]) and (got[:, 16:] - ref[:, 16:]).abs().max() > 1e-3
    assert cells == {"rope": "logn (added)",
                     "none": "llama4:attn_scale=0.2,floor_scale=16 (model's, kept) + logn (added)"}

"""``native`` keeps the model as it was loaded: logits bit for bit those of the unpatched model, for
every shipped rope type, dynamic ones included (transformers updates their frequencies past the
window, and the patch must not switch that off); the parameters its export writes are transformers'
own, with what transformers derives at load time written out."""

import pytest
import torch
from transformers import LlamaForCausalLM

import ropescale
from ropescale.strategies import get_strategy
from ropescale.strategies.native import shipped_rope_parameters
from tests.conftest import build, tiny_llama_config
from tests.families import FAMILIES, family_config

IDS = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(7))  # past the windows (64, 16)
N = 8  # rotary pairs of the tiny Llama

SHIPPED = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.05 * i for i in range(N)], "long_factor": [1.0 + 0.5 * i for i in range(N)]},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
@pytest.mark.parametrize("name", SHIPPED)
def test_native_is_the_model_as_loaded(name):
    model = build(LlamaForCausalLM, tiny_llama_config(**SHIPPED[name]))
    long, short = model(IDS).logits, model(IDS[:, :12]).logits
    with ropescale.patch(model, "native"):
        for ids, expected in ((IDS, long), (IDS[:, :12], short), (IDS, long)):  # past the window, back, past
            assert torch.equal(model(ids).logits, expected)


@torch.no_grad()
def test_a_layer_type_left_alone_keeps_its_dynamic_update():
    """Gemma 3 patched on its global layers only: its sliding layers' own rope type (dynamic here) still
    updates past the window as transformers runs it, while the global layers take the strategy's."""
    sliding = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    full = {"rope_type": "default", "rope_theta": 1000000.0}
    mixed = _gemma3({"sliding_attention": sliding, "full_attention": full})
    reference = _gemma3({"sliding_attention": sliding, "full_attention": {**full, "rope_type": "linear",
                                                                          "factor": 4.0}})
    expected = reference(IDS).logits
    with ropescale.patch(mixed, "linear", factor=4.0, layer_types=["full_attention"]):
        assert torch.equal(mixed(IDS).logits, expected)


def _gemma3(rope):
    config = family_config("gemma3")
    config.rope_parameters = rope
    torch.manual_seed(0)
    return FAMILIES["gemma3"][1](config).eval()


def test_its_export_writes_what_transformers_derives():
    """Phi-3's LongRoPE has no factor (transformers takes mpe / T) and a YaRN config may leave the betas
    and the attention factor to defaults: written out with transformers' values, so an engine that
    rewrites max_position_embeddings or reads the keys serves the same."""
    base = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0], "long_factor": [2.0]}
    got = shipped_rope_parameters(base, 128)
    assert got["factor"] == 4.0 and got["attention_factor"] == (1 + torch.log(torch.tensor(4.0)).item()
                                                                / torch.log(torch.tensor(32.0)).item()) ** 0.5
    yarn = shipped_rope_parameters({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": None}, 64)
    assert yarn["beta_fast"] == 32.0 and yarn["beta_slow"] == 1.0 and yarn["truncate"] is True
    assert yarn["attention_factor"] == 1.0  # mscale(s, 0.707) / mscale(s, 0.707), DeepSeek-V2
    assert shipped_rope_parameters({"rope_type": "dynamic", "factor": 2.0}, 64) == {"rope_type": "dynamic",
                                                                                    "factor": 2.0}
    assert get_strategy("native").keeps_model and not get_strategy("yarn").keeps_model

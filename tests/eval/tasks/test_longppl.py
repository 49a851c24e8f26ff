"""LongPPL against the paper's definition (Fang et al. 2025, arXiv:2410.23771, and PKU-ML/LongPPL's
``find_key_token``/``compute_longppl``): by hand on made-up log-probabilities, and token by token
with one naive forward per token's context on a tiny model."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.config import ConfigError, build_config
from eval.sweep import run_sweep
from eval.tasks.longppl import key_tokens, short_context_nll, token_nll
from ropescale.models import REFERENCE_MODEL, load_tokenizer
from ropescale.runs.data import load_documents, tokenize_documents


def test_key_tokens_by_hand():
    full = torch.tensor([0.5, 1.0, 3.0, 0.1, 1.9], dtype=torch.float64)
    short = torch.tensor([3.0, 2.9, 9.0, math.nan, 4.0], dtype=torch.float64)
    # LSD = short − full = 2.5, 1.9, 6.0, nan, 2.1 (> 2: T F T F T); LCL = −full > −2: T T F T T
    assert key_tokens(full, short, 2.0, -2.0).tolist() == [True, False, False, False, True]
    # LongPPL of an evaluated model with NLLs e: exp(mean of e over the key tokens) = exp((1.2 + 0.4) / 2)
    e = torch.tensor([1.2, 5.0, 7.0, 0.0, 0.4], dtype=torch.float64)
    assert math.exp(e[key_tokens(full, short, 2.0, -2.0)].mean().item()) == pytest.approx(math.exp(0.8))


def naive_nll(model, ids, start, p):
    """−log P(ids[p] | ids[start:p]): one forward over exactly that context."""
    logits = model(torch.tensor([ids[start:p]])).logits[0, -1].double()
    return -logits.log_softmax(-1)[ids[p]].item()


def test_short_and_full_nll_equal_one_forward_per_token(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = list(range(10, 30))  # 20 tokens
    short, stride = 8, 5
    with torch.no_grad():
        full = token_nll(model, torch.tensor(ids))
        sh = short_context_nll(model, torch.tensor(ids), short, stride)
        for p in range(1, 20):
            assert full[p - 1].item() == pytest.approx(naive_nll(model, ids, 0, p), abs=1e-5)
            if p < short:
                assert math.isnan(sh[p - 1].item())
            else:  # the reference's blocks: tokens [s + short, s + short + stride) share the context from s
                s = (p - short) // stride * stride
                assert sh[p - 1].item() == pytest.approx(naive_nll(model, ids, s, p), abs=1e-5)


def test_longppl_end_to_end(tmp_path, text_file):
    """On the bundled KJV model (a random one gains nothing from context: no key tokens), over a
    text of two 48-token windows."""
    tok = load_tokenizer("reference")
    ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"][:120]
    short_text = tmp_path / "two-windows.txt"
    short_text.write_text(tok.decode(ids))
    cfg = build_config({"task": "longppl", "model": "reference", "data": str(short_text), "lengths": [48],
                        "strategies": ["vanilla"], "device": "cpu",
                        "longppl": {"short": 16, "stride": 8, "alpha": 0.5, "beta": -6.0}})
    (r,) = run_sweep(cfg, tmp_path / "run", progress=False)
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL).eval()
    ids = tokenize_documents(tok, load_documents(cfg.data.spec()))[0].tolist()
    assert 96 <= len(ids) < 144
    all_nll, key_nll = [], []
    with torch.no_grad():
        for w in range(2):  # chunk windows: tokens [48w, 48w + 48)
            win = ids[48 * w:48 * w + 48]
            for p in range(1, 48):
                f = naive_nll(model, win, 0, p)
                all_nll.append(f)
                if p >= 16:
                    s = (p - 16) // 8 * 8
                    if naive_nll(model, win, s, p) - f > 0.5 and -f > -6.0:
                        key_nll.append(f)
    assert key_nll, "the example must have key tokens"
    assert r["key_tokens"] == len(key_nll) and r["tokens"] == len(all_nll) == 94
    assert r["longppl"] == pytest.approx(math.exp(sum(key_nll) / len(key_nll)), rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(sum(all_nll) / len(all_nll)), rel=1e-5)
    assert r["windows"] == 2 and "LongPPL (key tokens)" in (tmp_path / "run" / "results.md").read_text()


def test_bad_longppl_options_are_one_line():
    with pytest.raises(ConfigError, match="short context 64 is not shorter than the shortest length 64"):
        build_config({"task": "longppl", "lengths": [64, 128], "strategies": ["vanilla"], "longppl": {"short": 64}})

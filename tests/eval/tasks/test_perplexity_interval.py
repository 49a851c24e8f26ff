"""The perplexity task's uncertainty (``ppl_ci``): a 95% block-bootstrap interval over blocks of ``ci_block``
consecutive scored tokens, recorded with the blocks it resampled. Checked on a tiny model against the
per-token NLL written out by hand: the blocks partition the scored tokens, their sums are the hand loop's,
and the interval is the bootstrap of exactly those blocks."""

import math

import pytest
import torch
import torch.nn.functional as F

from eval.config import build_config
from eval.sweep import run_sweep
from ropescale.runs.uncertainty import block_bootstrap_ppl
from ropescale.runs.windows import make_windows


@torch.no_grad()
def _hand_blocks(model_dir, ids, length, block, max_windows):
    """Per window of ``length`` tokens (chunk mode, ``max_windows`` of them evenly spaced), the summed NLL of
    each block of ``block`` targets, by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, tokens = [], []
    for w in make_windows([len(ids)], length, max_windows=max_windows):
        window = ids[w.start:w.end]
        logp = F.log_softmax(model(window[None]).logits[0].double(), -1)  # [n, V]
        per = -logp[:-1].gather(-1, window[1:, None])[:, 0]  # [n-1]: targets 1 … n-1
        for k in range(0, len(per), block):
            nll.append(float(per[k:k + block].sum()))
            tokens.append(len(per[k:k + block]))
    return nll, tokens


def test_the_interval_is_the_bootstrap_of_the_scored_blocks(tmp_path, tiny_model_dir, text_file):
    from transformers import AutoTokenizer

    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [48], "max_windows": 3,
                        "strategies": ["vanilla"], "device": "cpu", "perplexity": {"ci_block": 16}})
    (record,) = run_sweep(cfg, tmp_path / "run", progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = torch.tensor(tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    want_nll, want_tok = _hand_blocks(tiny_model_dir, ids, 48, 16, 3)  # blocks of targets [1, 17), [17, 33), [33, 48)
    assert record["block_tokens"] == want_tok == [16, 16, 15] * 3
    assert record["nll_blocks"] == pytest.approx(want_nll, abs=2e-4)
    assert sum(record["block_tokens"]) == record["tokens"]
    assert sum(record["nll_blocks"]) == pytest.approx(record["nll"] * record["tokens"], rel=1e-5)
    low, high = block_bootstrap_ppl(torch.tensor(want_nll), torch.tensor(want_tok, dtype=torch.float64))
    assert record["ppl_ci"] == pytest.approx([low, high], rel=1e-4)
    assert record["ppl_ci"][0] < record["ppl"] < record["ppl_ci"][1]
    assert "block bootstrap: 9 blocks of 16" in record["ci"]


def test_the_interval_is_shown_beside_the_perplexity_and_leaves_the_identity_alone(tmp_path, tiny_model_dir,
                                                                                    text_file):
    base = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "max_windows": 4,
            "strategies": ["vanilla"], "device": "cpu"}
    (a,) = run_sweep(build_config(base), tmp_path / "run", progress=False)
    md = (tmp_path / "run" / "results.md").read_text(encoding="utf-8")
    assert f"{a['ppl']:.2f} ({a['ppl_ci'][0]:.2f}–{a['ppl_ci'][1]:.2f})" in md
    # another block size resumes the same experiment (the interval is not part of what is measured)
    again = run_sweep(build_config({**base, "perplexity": {"ci_block": 8}}), tmp_path / "run", progress=False)
    assert again == [] or again[0]["ppl"] == a["ppl"]
    assert math.isfinite(a["ppl_ci"][1] - a["ppl_ci"][0])


def test_max_tokens_scores_about_the_same_tokens_at_every_length(tmp_path, tiny_model_dir, text_file):
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [16, 32, 64],
                        "strategies": ["vanilla"], "device": "cpu", "perplexity": {"max_tokens": 64}})
    records = {r["length"]: r for r in run_sweep(cfg, tmp_path / "run", progress=False)}
    assert {n: r["windows"] for n, r in records.items()} == {16: 4, 32: 2, 64: 1}  # ceil(64 / L) windows
    assert {n: r["tokens"] for n, r in records.items()} == {16: 60, 32: 62, 64: 63}
    # with max_windows the smaller cap holds
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [16],
                        "strategies": ["vanilla"], "device": "cpu",
                        "perplexity": {"max_tokens": 64, "max_windows": 3}})
    assert run_sweep(cfg, tmp_path / "run2", progress=False)[0]["windows"] == 3

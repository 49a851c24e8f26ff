"""End to end on the bundled reference model (T = 128): a 3-trial search at 512 tokens over 2
windows of kjv-train, its folder, resuming it, and its best.json applied through ``patch`` and
read as ``eval``'s strategy spec."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import ropescale
from eval.config import build_config
from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.models import load_model
from ropescale.runs.config import parse_strategy
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from ropescale.runs.manifest import ExperimentMismatchError
from ropescale.runs.scoring import score_windows
from ropescale.runs.windows import make_windows

pytestmark = pytest.mark.slow

RAW = {"model": "reference", "strategy": "yarn", "fixed": {"factor": 4}, "lengths": [512],
       "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2], "attention_factor": [0.9, 1.4]},
       "budget": 3, "max_windows": 2, "seed": 0}


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    best = run_search(build_search_config(RAW), out, progress=False)
    return out, best


def test_writes_its_folder(searched):
    out, best = searched
    for name in ("best.json", "trials.csv", "results.md", "search.png", "study.db", "manifest.json"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))
    assert [r["trial"] for r in rows] == ["0", "1", "2"]
    columns = {"beta_fast", "beta_slow", "attention_factor", "objective", "constraint", "ppl@512", "ppl_train"}
    assert columns <= set(rows[0])
    # the best is the feasible trial with the lowest objective (else the lowest overall)
    feasible = [r for r in rows if r["feasible"] == "True"] or rows
    assert best["trial"] == int(min(feasible, key=lambda r: float(r["objective"]))["trial"])
    # one length of weight 1: the objective is that length's mean NLL, log of its PPL
    for r in rows:
        assert math.isclose(float(r["objective"]), math.log(float(r["ppl@512"])), rel_tol=1e-9)
    assert json.loads((out / "best.json").read_text()) == best
    md = (out / "results.md").read_text()
    assert "reference" in md and "kjv-train" in md and "tpe" in md and best["spec"] in md


def test_best_json_applies_through_patch_and_reproduces_its_perplexity(searched):
    _, best = searched
    assert best["strategy"] == "yarn" and best["params"]["factor"] == 4
    assert set(best["params"]) == {"factor", "beta_fast", "beta_slow", "attention_factor"}
    model, tokenizer = load_model("reference", device="cpu")
    docs = tokenize_documents(tokenizer, load_documents(DataSpec(source="kjv-train")))
    windows = make_windows([len(d) for d in docs], 512, max_windows=2)
    vanilla = score_windows(model, docs, windows, length=512).mean_nll
    with ropescale.patch(model, best["strategy"], **best["params"]):
        nll = score_windows(model, docs, windows, length=512).mean_nll
    assert math.isclose(math.exp(nll), best["ppl"]["512"], rel_tol=1e-6)
    assert not math.isclose(nll, vanilla, rel_tol=1e-3)  # the patch did something
    assert torch.equal(model.model.rotary_emb.inv_freq, model.model.rotary_emb.original_inv_freq)


def test_best_spec_is_an_eval_strategy_entry(searched):
    _, best = searched
    spec = parse_strategy(best["spec"])
    assert spec.name == "yarn" and spec.params == best["params"]
    cfg = build_config({"lengths": [512], "strategies": [best["spec"]]})
    assert cfg.strategies[0].params == best["params"]


def test_resuming_runs_only_what_is_left_and_another_search_is_refused(searched, tmp_path):
    out, best = searched
    again = run_search(build_search_config(RAW), out, progress=False)
    assert again == best  # budget reached: nothing evaluated
    more = run_search(build_search_config({**RAW, "budget": 4}), out, progress=False)
    rows = list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))
    assert len(rows) == 4 and more["evaluations"] == 4
    with pytest.raises(ExperimentMismatchError):
        run_search(build_search_config({**RAW, "seed": 1}), out, progress=False)


LONGROPE = {"model": "reference", "strategy": "longrope", "method": "evolution", "lengths": [512], "budget": 6,
            "max_windows": 1, "evolution": {"population": 4, "iterations": 1, "elite": 2}}


def test_evolution_writes_a_longrope_spec_that_patch_applies_and_resumes(tmp_path):
    out = tmp_path / "lr"
    best = run_search(build_search_config(LONGROPE), out, progress=False)
    for name in ("best.json", "trials.csv", "results.md", "search.png", "factors.png", "evolution.jsonl"):
        assert (out / name).is_file(), name
    p = best["params"]
    assert best["strategy"] == "longrope" and p["factor"] == 4.0  # s = 512 / 128
    assert len(p["long_factor"]) == len(p["short_factor"]) == 16 and p["short_factor"] == [1.0] * 16
    assert all(a <= b for a, b in zip(p["long_factor"], p["long_factor"][1:]))  # monotone, as LongRoPE keeps it
    assert len(list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))) == best["evaluations"] == 6
    assert parse_strategy(best["spec"]).params == p
    model, _ = load_model("reference", device="cpu")
    with ropescale.patch(model, best["strategy"], **p):
        pass
    # resumed from the journal: the same result
    assert run_search(build_search_config(LONGROPE), out, progress=False) == best


@pytest.mark.parametrize(("change", "words"), [
    ({"strategy": "yarn"}, "longrope's per-pair factors"),
    ({"evolution": {"generations": 3}}, "unknown key 'generations'"),
    ({"search": ["factor"]}, "leave search: out"),
    ({"fixed": {"long_factor": [1.0] * 16}}, "searched by method evolution"),
])
def test_evolution_configs_are_checked(change, words):
    from ropescale.runs.config import ConfigError

    with pytest.raises(ConfigError, match=words):
        build_search_config({**LONGROPE, **change})


def test_the_retrieval_term_adds_the_passkey_answer_nll(tmp_path):
    raw = {**RAW, "budget": 1, "max_windows": 1, "retrieval_weight": 0.5, "retrieval_trials": 2,
           "lengths": [256, 512], "length_weights": [1, 3]}
    run_search(build_search_config(raw), tmp_path / "r", progress=False)
    (row,) = csv.DictReader((tmp_path / "r" / "trials.csv").open(encoding="utf-8"))
    answer = float(row["retrieval_nll"])
    assert answer > 0  # a negative log-likelihood of a 5-digit key
    expected = 0.25 * math.log(float(row["ppl@256"])) + 0.75 * math.log(float(row["ppl@512"])) + 0.5 * answer
    assert math.isclose(float(row["objective"]), expected, rel_tol=1e-9)

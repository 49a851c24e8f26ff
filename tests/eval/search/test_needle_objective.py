"""LongRoPE2's needle-driven search term (arXiv:2502.20082): the mean NLL per answer token of
needles planted in the search text, against one naive forward per answer token, and its place in
the objective."""

import csv
import math

import torch

from eval.search.config import build_search_config
from eval.search.needle_objective import answer_nll, needle_examples
from eval.search.run import run_search
from ropescale.models import load_model
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

RAW = {"model": "reference", "strategy": "yarn", "fixed": {"factor": 2}, "lengths": [256],
       "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2]}, "budget": 1, "max_windows": 1, "seed": 0}


def test_answer_nll_equals_one_forward_per_answer_token():
    model, tok = load_model("reference", device="cpu")
    docs = tokenize_documents(tok, load_documents(DataSpec("kjv-heldout", max_documents=1)))
    examples = needle_examples(tok, docs, length=256, trials=2, train_length=128)
    assert len(examples) == 2 and all(len(e.prompt.ids) + len(e.candidates[0]) == 256 for e in examples)
    total, n = 0.0, 0
    with torch.no_grad():
        for e in examples:
            answer = e.candidates[0]
            assert tok.decode(answer).strip() == e.prompt.answer
            for j, t in enumerate(answer):
                logits = model(torch.tensor([e.prompt.ids + answer[:j]])).logits[0, -1].double()
                total -= logits.log_softmax(-1)[t].item()
                n += 1
        assert math.isclose(answer_nll(model, examples, "cpu"), total / n, rel_tol=1e-6)


def test_the_needle_term_joins_the_objective(tmp_path):
    run_search(build_search_config({**RAW, "needle_weight": 0.5, "needle_trials": 2}), tmp_path / "n",
               progress=False)
    (row,) = csv.DictReader((tmp_path / "n" / "trials.csv").open(encoding="utf-8"))
    needle = float(row["needle_nll"])
    assert needle > 0
    assert math.isclose(float(row["objective"]), math.log(float(row["ppl@256"])) + 0.5 * needle, rel_tol=1e-9)

"""A task is a term of the search's objective by declaring it (issue 54, item 2; issue 55: graphwalks as a search
term): ``tasks: [{task, weight, trials, options}]`` adds weight × the mean NLL per answer token of the task's gold
answers (``Task.gold_answers``). Checked against two oracles — the hand-built passkey term it generalises (the same
prompts give the same number) and a plain forward over prompt + answer — in process and through a plugin engine."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from eval.engines.answering import Answered, transformers_logprobs
from eval.engines.registry import add_role, remove_role
from eval.engines.scoring import ScoringEngine
from eval.search.config import TERM_SEED, build_search_config
from eval.search.run import run_search
from ropescale.runs.config import ConfigError

PASSKEY = {"task": "passkey", "weight": 0.5, "trials": 3}  # its defaults: depths 0, ½, 1, one key each, seed 7919
GRAPHWALKS = {"task": "graphwalks", "weight": 0.25, "trials": 2, "options": {"tokens_to_generate": 16,
                                                                              "cache": False}}


class Relay(ScoringEngine):
    """A plugin's engine answering log-probabilities from the patched model in this process."""

    name = "relay-terms-test"
    answers = frozenset({"logprobs"})

    def tolerance(self, options, dtype):
        return 1e-6

    def answer(self, requests, serving):
        return Answered(results=[{"logprobs": transformers_logprobs(serving.model, r["ids"], serving.device).tolist()}
                                 for r in requests], version="relay 1")


remove_role(Relay.name, "scorer")


@pytest.fixture
def raw(tiny_model_dir, text_file):
    return {"model": str(tiny_model_dir), "data": str(text_file), "heldout": None, "strategy": "yarn",
            "fixed": {"factor": 2}, "search": {"beta_fast": [4, 64]}, "lengths": [64], "budget": 2,
            "max_windows": 2, "threads": 1, "device": "cpu", "dtype": "float32"}


def _rows(folder):
    return list(csv.DictReader((folder / "trials.csv").open(encoding="utf-8")))


def test_passkey_as_a_task_term_is_the_hand_built_retrieval_term(tmp_path, raw):
    """The same passkey prompts (depths 0, ½, 1, seed 7919, two candidates) through ``tasks:`` and through
    ``retrieval_weight``: the same NLL per trial, and J moves by the same weight × NLL."""
    old = run_search(build_search_config({**raw, "retrieval_weight": 0.5, "retrieval_trials": 3}), tmp_path / "old",
                     progress=False)
    new = run_search(build_search_config({**raw, "tasks": [PASSKEY]}), tmp_path / "new", progress=False)
    for a, b in zip(_rows(tmp_path / "old"), _rows(tmp_path / "new"), strict=True):
        assert float(b["nll@passkey"]) == pytest.approx(float(a["retrieval_nll"]), rel=1e-9)
        assert float(b["objective"]) == pytest.approx(float(a["objective"]), rel=1e-9)
    assert new["objective"] == pytest.approx(old["objective"], rel=1e-9)


def _plain_answer_nll(model, prompt, answer):
    """Oracle: −Σ log p(answer | prompt) / len(answer) from one plain forward and a log-softmax."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [n, V]
    return -sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(answer)) / len(answer)


def test_a_graphwalks_term_is_the_gold_answer_nll_in_process_and_through_an_engine(tmp_path, raw):
    from eval.search.objective import SearchObjective
    from ropescale.runs.lifecycle import load_inputs

    raw = {**raw, "lengths": [1024], "max_windows": 1}
    cfg = build_search_config({**raw, "budget": 1, "tasks": [GRAPHWALKS]})
    objective = SearchObjective(cfg, inputs=load_inputs(cfg.model, cfg.data.spec()))
    gold = objective.terms["graphwalks"]
    assert len(gold) == 2 and all(len(p) + len(a) <= 1024 for p, a in gold)
    assert all(a and objective.tokenizer.decode(a).startswith("Final Answer: [") for _, a in gold)
    params, m = objective({"beta_fast": 16.0})
    import ropescale

    with ropescale.patch(objective.model, "yarn", original_max_position_embeddings=objective.train_length, **params):
        want = sum(_plain_answer_nll(objective.model, p, a) * len(a) for p, a in gold) / sum(len(a) for _, a in gold)
    assert m.task_nll["graphwalks"] == pytest.approx(want, rel=1e-6)
    windows = sum(cfg.weights()[0] * m.nll[L] for L in cfg.lengths)
    assert m.objective == pytest.approx(windows + 0.25 * want, rel=1e-6)
    add_role(Relay, "scorer")
    try:
        best = run_search(build_search_config({**raw, "budget": 1, "tasks": [GRAPHWALKS], "engine": Relay.name}),
                          tmp_path / "relay", progress=False)
        here = run_search(build_search_config({**raw, "budget": 1, "tasks": [GRAPHWALKS]}), tmp_path / "here",
                          progress=False)
    finally:
        remove_role(Relay.name, "scorer")
    (a,), (b,) = _rows(tmp_path / "here"), _rows(tmp_path / "relay")
    assert math.isclose(float(a["nll@graphwalks"]), float(b["nll@graphwalks"]), rel_tol=1e-6)
    assert best["objective"] == pytest.approx(here["objective"], rel=1e-6)


@pytest.mark.parametrize(("term", "message"), [
    ({"task": "perplexity", "weight": 1}, r"tasks.0: .*task perplexity has no gold answers to score "
                                          r"\(objective_term\); terms: .*graphwalks.*passkey"),
    ({"task": "paskey", "weight": 1}, r"tasks.0: .*unknown task 'paskey'.*passkey"),
    ({"task": "passkey", "weight": 0}, r"tasks.0.weight"),
    ({"task": "passkey", "weight": 1, "options": {"depth": [0.5]}}, r"tasks.0.options.depth: unknown key.*depths"),
    ({"task": "passkey", "weight": 1, "trails": 2}, r"tasks.0.trails: unknown key"),
])
def test_a_bad_term_is_one_line(raw, term, message):
    with pytest.raises(ConfigError, match=message):
        build_search_config({**raw, "tasks": [term]}, "s.yaml")


def test_a_term_whose_examples_cannot_fit_is_one_line_before_the_folder(tmp_path, raw):
    with pytest.raises(ConfigError, match=r"^tasks: graphwalks: graphwalks at 64 tokens: no example fits"):
        run_search(build_search_config({**raw, "tasks": [GRAPHWALKS]}), tmp_path / "s", progress=False)
    assert not (tmp_path / "s" / "trials.csv").exists()


def test_one_term_per_task(raw):
    with pytest.raises(ConfigError, match=r"tasks: .*task passkey is given twice: one term per task"):
        build_search_config({**raw, "tasks": [PASSKEY, {**PASSKEY, "weight": 1}]}, "s.yaml")


def test_a_plugin_generation_task_without_gold_text_is_no_term():
    from eval.tasks.base import TASKS
    from eval.tasks.synthetic.base import GeneratedTask

    class NoGold(GeneratedTask):
        name = "no-gold-test"
        metrics = ()

    try:
        assert NoGold.objective_term is False and TASKS.lookup("graphwalks").objective_term is True
    finally:
        TASKS.pop("no-gold-test", None)


def test_a_term_defaults_to_its_own_seed_and_enters_the_identity(raw):
    cfg = build_search_config({**raw, "tasks": [{"task": "graphwalks", "weight": 1, "trials": 3}]})
    opts = cfg.tasks[0].task_options()
    assert opts.seed == TERM_SEED != type(opts)().seed and opts.num_samples == 3
    assert cfg.identity()["tasks"][0]["task"] == "graphwalks"
    assert "tasks" not in build_search_config(raw).identity()  # earlier studies keep their identity


def test_a_terms_nll_reaches_the_trackers():
    from eval.search.trackers import trial_numbers

    got = trial_numbers({"objective": 1.5, "ppl@64": 3.0, "nll@graphwalks": 2.25, "nll@passkey": float("nan"),
                         "spec": {"factor": 2}}, {"beta_fast": 4.0, "truncate": True})
    assert got == {"objective": 1.5, "ppl@64": 3.0, "nll@graphwalks": 2.25, "param/beta_fast": 4.0}

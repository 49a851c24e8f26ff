"""The retrieval scorer against hand-built logits, and the Wilson interval against its formula's
published values."""


import pytest
import torch

from eval.tasks.prompts import Prompt
from eval.tasks.retrieval import (
    Example,
    RetrievalOptions,
    _candidate_scores_cached,
    _greedy,
    candidate_scores_full,
    contains_match,
    first_integer_match,
    summarise,
    wilson,
)
from ropescale.compat import output_cache


@pytest.mark.parametrize("k,n,expected", [
    (8, 10, (0.4902, 0.9433)),  # Brown, Cai & DasGupta (2001) / statsmodels proportion_confint(method="wilson")
    (0, 10, (0.0, 0.2775)),
    (10, 10, (0.7225, 1.0)),
    (1, 2, (0.0945, 0.9055)),
])
def test_wilson_interval(k, n, expected):
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(expected[0], abs=1e-4) and hi == pytest.approx(expected[1], abs=1e-4)


def test_wilson_needs_trials():
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_matchers():
    assert first_integer_match(" 48213. Remember", "48213")
    assert not first_integer_match(" 482130", "48213") and not first_integer_match(" 4821 3", "48213")
    assert first_integer_match(": 48213", "48213") and not first_integer_match("no digits", "1")
    assert contains_match(": 1234567.", "1234567") and not contains_match(" 123456", "1234567")


class BigramCache:
    """Position-free 'cache': a bigram model needs none, but the scorer copies and repeats it."""

    def __init__(self):
        self.batch = 1

    def batch_repeat_interleave(self, k):
        self.batch *= k


class Bigram(torch.nn.Module):
    """Hand-built LM: log p(next | ..., last) = table[last, next]."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        logits = self.table[input_ids]  # [b, s, V]
        logits = logits[:, -logits_to_keep:] if logits_to_keep else logits  # as transformers' models slice
        return type("Out", (), {"logits": logits, "past_key_values": past_key_values or BigramCache()})()


def test_candidate_scores_and_greedy_on_hand_built_logits():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(12, 12, generator=g).log_softmax(-1)  # rows already log-probabilities
    model = Bigram(table)
    prompt = [3, 7, 5]
    cands = [[1, 2, 4], [9, 2], [1, 11, 0]]
    # by hand: Σ log p(c_j | c_{j-1}), the first token after the prompt's last token
    oracle = [sum(table[prev, t].item() for prev, t in zip([prompt[-1]] + c[:-1], c)) for c in cands]
    out = model(torch.tensor([prompt]))
    last = out.logits[0, -1].float().log_softmax(-1)
    cached = _candidate_scores_cached(model, last, BigramCache(), cands, "cpu")
    full = candidate_scores_full(model, prompt, cands, "cpu")
    assert cached.tolist() == pytest.approx(oracle, abs=1e-6) and full.tolist() == pytest.approx(oracle, abs=1e-6)
    # greedy: the argmax chain of the table from the prompt's last token
    chain, t = [], prompt[-1]
    for _ in range(4):
        t = int(table[t].argmax())
        chain.append(t)
    assert _greedy(model, last, BigramCache(), 4) == chain


def test_cached_candidates_equal_full_forwards_on_a_real_model(tiny_llama):
    prompt = list(range(3, 40))
    cands = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with torch.no_grad():
        out = tiny_llama(input_ids=torch.tensor([prompt]), use_cache=True)
        last = out.logits[0, -1].float().log_softmax(-1)
        cached = _candidate_scores_cached(tiny_llama, last, output_cache(out), cands, "cpu")
        full = candidate_scores_full(tiny_llama, prompt, cands, "cpu")
        naive = []
        for c in cands:  # the textbook way: one sequence at a time
            lp = tiny_llama(torch.tensor([prompt + c])).logits[0].double().log_softmax(-1)
            naive.append(sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(c)))
    assert cached.tolist() == pytest.approx(naive, abs=1e-4) and full.tolist() == pytest.approx(naive, abs=1e-4)
    # the cache the greedy decoder goes on with was not touched by the candidates
    assert output_cache(out).get_seq_length() == len(prompt)


def test_summarise_per_depth():
    opts = RetrievalOptions(depths=[0.0, 1.0], trials=3, candidates=4)
    p = Prompt([1, 2], "5", [3], 0, 1, 0.0)
    examples = [Example(p, [[3]], di) for di in (0, 0, 0, 1, 1, 1)]
    r = summarise(examples, [True, True, False, False, False, False], [True, True, True, True, False, False], opts)
    assert r["accuracy"] == pytest.approx(2 / 6) and r["candidate_accuracy"] == pytest.approx(4 / 6)
    assert r["chance"] == 0.25 and [d["depth"] for d in r["by_depth"]] == [0.0, 1.0]
    assert (r["by_depth"][0]["accuracy"] == pytest.approx(2 / 3)
            and r["by_depth"][1]["candidate_accuracy"] == pytest.approx(1 / 3))
    assert r["by_depth"][1]["accuracy_ci"] == pytest.approx(list(wilson(0, 3)))


@pytest.mark.parametrize("bad,match", [
    ({"depths": [0.5, 1.2]}, "depths must lie in"),
    ({"trials": 0}, "greater than or equal to 1"),
    ({"digits": 1, "candidates": 10}, "more than there are 1-digit keys"),
])
def test_bad_options(bad, match):
    with pytest.raises(ValueError, match=match):
        RetrievalOptions(**bad)

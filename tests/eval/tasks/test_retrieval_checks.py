"""Retrieval checks as their sources define them: YaRN's passkey compares integers, RULER's
niah_single prompt opens with its header line, and the greedy budget is an option."""


import pytest
import torch
from transformers import AutoTokenizer

import eval.tasks.retrieval as retrieval
from eval.tasks import needle
from eval.tasks.passkey import Passkey, PasskeyOptions
from eval.tasks.prompts import cycle_units, sentence_units
from eval.tasks.retrieval import RetrievalOptions, first_integer_match
from ropescale.models import REFERENCE_MODEL
from ropescale.strategies import get_strategy


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


@pytest.mark.parametrize("output,answer,expected", [
    (" 060494. Remember", "60494", True),  # YaRN: int(first integer) == key, so a leading zero still matches
    ("060494", "060494", True),
    (" 0060494", "60494", True),
    (" 604940", "60494", False),
    (" 6049 4", "60494", False),
    (" 1 and 60494", "60494", False),  # only the first integer counts
    ("no digits", "60494", False),
])
def test_first_integer_match_compares_integers(output, answer, expected):
    assert first_integer_match(output, answer) is expected


RULER_HEADER = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.")


@pytest.mark.parametrize("length", [122, 128, 300])  # 121: header, needle, question, answer
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_prompt_opens_with_rulers_header_and_keeps_its_length(tok, length, depth):
    text = ("In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void; "
            "and darkness was upon the deep.")
    units = sentence_units(tok, [tok(text, add_special_tokens=False)["input_ids"]])
    p = needle.make_prompt(tok, cycle_units(units), length=length, depth=depth, word="apple", number="1234567")
    assert p.length == length
    decoded = tok.decode(p.ids)
    assert decoded.startswith(RULER_HEADER + "\n") and decoded.count(RULER_HEADER) == 1
    assert tok.decode(p.ids[p.needle_start:p.needle_end]) == \
        "\nOne of the special magic numbers for apple is: 1234567.\n"
    if depth == 0.0:  # the needle right after the header line
        assert decoded.startswith(RULER_HEADER + "\n\nOne of the special magic numbers for apple is: 1234567.\n")


def test_greedy_extra_tokens_is_an_option():
    assert RetrievalOptions().greedy_extra_tokens == 2
    assert PasskeyOptions(greedy_extra_tokens=0).greedy_extra_tokens == 0
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        RetrievalOptions(greedy_extra_tokens=-1)
    # part of the cell identity when it changes the numbers; the default hashes as before it was an option
    assert set(RetrievalOptions().key()) == {"depths", "trials", "digits", "candidates", "seed"}
    assert RetrievalOptions(greedy_extra_tokens=4).key()["greedy_extra_tokens"] == 4


class _Uniform(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        logits = torch.zeros(*input_ids.shape, 300)
        logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        return type("Out", (), {"logits": logits, "past_key_values": past_key_values})()


@pytest.mark.parametrize("extra", [0, 2, 5])
def test_greedy_decodes_answer_tokens_plus_the_option(tok, monkeypatch, extra):
    asked = []
    monkeypatch.setattr(retrieval, "_greedy", lambda model, last, cache, n: asked.append(n) or [])
    monkeypatch.setattr(retrieval, "_candidate_scores_cached", lambda *a: torch.tensor([0.0, 1.0]))
    task = Passkey(PasskeyOptions(trials=2, depths=[0.5], digits=5, candidates=2, greedy_extra_tokens=extra),
                   tokenizer=tok, train_length=128)
    examples = task.examples(128)
    task.measure(_Uniform(), examples, [0, 1], length=128, strategy=get_strategy("vanilla"), device="cpu", desc=None)
    assert asked == [len(ex.prompt.answer_ids) + extra for ex in examples]

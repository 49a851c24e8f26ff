"""Prompt builder gold cases on the bundled tokenizer."""

import random

import pytest
from transformers import AutoTokenizer

from eval.tasks import needle, passkey
from eval.tasks.prompts import (
    PromptError,
    build_prompt,
    continuation,
    cycle_units,
    distractor_keys,
    random_key,
    sentence_units,
)
from ropescale.models import REFERENCE_MODEL


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("length", [96, 128, 300, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_length_and_depth(tok, length, depth):
    units = passkey.filler_units(tok)
    p = passkey.make_prompt(tok, cycle_units(units), length=length, depth=depth, key="48213")
    assert p.length == length  # prompt + answer fill the length exactly
    text = tok.decode(p.ids)
    info = passkey.INFO.format(key="48213")
    assert text.count(info) == 1 and text.endswith("\n" + passkey.QUESTION)
    assert tok.decode(p.ids[p.needle_start:p.needle_end]) == "\n" + info + "\n"
    # the needle sits at the requested depth of the haystack, within one filler sentence
    question = enc(tok, "\n" + passkey.QUESTION)
    haystack = length - len(p.answer_ids) - len(question) - (p.needle_end - p.needle_start)
    assert abs(p.needle_start - depth * haystack) <= max(map(len, units))
    assert tok.decode(p.answer_ids) == " 48213"
    # the haystack is the filler, in order, from its first sentence, cut only at the very end
    hay = tok.decode(p.ids[: p.needle_start] + p.ids[p.needle_end: len(p.ids) - len(question)])
    assert (" " + " ".join(passkey.FILLER * 100)).startswith(hay)


def test_depth_extremes_and_preamble(tok):
    units = passkey.filler_units(tok)
    p0 = passkey.make_prompt(tok, cycle_units(units), length=200, depth=0.0, key="7", preamble=True)
    assert tok.decode(p0.ids).startswith(passkey.PREAMBLE + "\n\n" + passkey.INFO.format(key=7))
    p1 = passkey.make_prompt(tok, cycle_units(units), length=200, depth=1.0, key="7")
    assert tok.decode(p1.ids).endswith(passkey.INFO.format(key=7) + "\n\n" + passkey.QUESTION)


def test_too_short_and_bad_depth(tok):
    units = cycle_units(passkey.filler_units(tok))
    # 31 (newline, 29-token information line, newline) + 13 (newline, question) + 6 (answer)
    with pytest.raises(PromptError, match="length 40 is too short for this prompt: the needle, question and answer "
                                          "alone take 50 tokens"):
        passkey.make_prompt(tok, units, length=40, depth=0.5, key="48213")
    with pytest.raises(ValueError, match="depth 1.5 must be between 0 and 1"):
        build_prompt(tok, units, length=128, depth=1.5, needle="x", question="q", answer="1")


def test_needle_prompt(tok):
    units = sentence_units(tok, [enc(tok, "In the beginning God created the heaven and the earth.\nAnd the earth "
                                           "was without form, and void; and darkness was upon the deep.")])
    p = needle.make_prompt(tok, cycle_units(units), length=128, depth=0.5, word="apple", number="1234567")
    text = tok.decode(p.ids)
    assert p.length == 128 and text.count("One of the special magic numbers for apple is: 1234567.") == 1
    assert text.endswith(needle.QUESTION.format(word="apple")) and tok.decode(p.answer_ids) == " 1234567"


def test_sentence_units_split_at_sentence_ends(tok):
    ids = enc(tok, "And God said, Let there be light: and there was light.\nAnd God saw the light")
    units = sentence_units(tok, [ids])
    assert ["".join(tok.decode(u)) for u in units] == ["And God said, Let there be light:", " and there was light.",
                                                       "\n", "And God saw the light"]
    assert [t for u in units for t in u] == ids  # nothing lost, nothing reordered


def test_keys():
    rng = random.Random(0)
    keys = [random_key(rng, 5) for _ in range(200)]
    assert all(len(k) == 5 and k[0] != "0" for k in keys)
    d = distractor_keys(rng, "12345", 9)
    assert len(set(d)) == 9 and "12345" not in d and all(len(k) == 5 for k in d)
    with pytest.raises(ValueError, match="cannot draw 9 distinct 1-digit"):
        distractor_keys(rng, "5", 9)


def test_continuation_splits_like_lm_eval(tok):
    ctx, ans = continuation(tok, "The pass key is", "48213")
    assert ctx + ans == enc(tok, "The pass key is 48213") and tok.decode(ans) == " 48213"

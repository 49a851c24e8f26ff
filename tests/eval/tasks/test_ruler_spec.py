"""RULER's metrics, prediction clean-up and word list, against the authors' code written out
(NVIDIA/RULER ``c3f5e3b4``: ``scripts/eval/synthetic/constants.py``, ``scripts/eval/evaluate.py``,
``scripts/data/synthetic/niah.py``) on hand-made outputs."""

import random
import re

import pytest

from eval.tasks.prompts import PromptError
from eval.tasks.ruler_spec import (
    HOPELESS_AFTER,
    MAX_RETRIES,
    TooLong,
    postprocess_pred,
    sample_score,
    shrink_until_fits,
    string_match_all,
    string_match_part,
)
from eval.tasks.ruler_text import JoinedWords, _category, sent_tokenize


# --- RULER, as its authors wrote it -------------------------------------------------------------
def ruler_string_match_part(preds, refs):
    score = sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) for pred, ref in zip(preds, refs)]) \
        / len(preds) * 100
    return round(score, 2)


def ruler_string_match_all(preds, refs):
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


def ruler_postprocess_pred(predict_str: str, task_config: dict):
    predict_str = predict_str.strip()
    np_pattern = re.compile(r'[\x00-\x1f]')
    predict_str = np_pattern.sub('\n', predict_str).strip()
    return predict_str
# -------------------------------------------------------------------------------------------------


PREDS = [" 1234567 and 7654321", "The special magic NUMBERS are 1234567.", "", "nothing\x07here\t 42 ",
         "uuid: 3F2504E0-4F89-11D3-9A0C-0305E82C3301", "KEY-ONE, key-two, Key-Three"]
REFS = [["1234567", "7654321"], ["1234567", "7654321", "1111111"], ["999"], ["42"],
        ["3f2504e0-4f89-11d3-9a0c-0305e82c3301"], ["key-one", "key-two", "key-three", "key-four"]]


def test_metrics_equal_rulers():
    preds = [ruler_postprocess_pred(p, {}) for p in PREDS]
    assert [postprocess_pred(p) for p in PREDS] == preds
    # by hand: (1 + 1/3 + 0 + 1 + 1 + 3/4) / 6 and 5 / 6
    assert string_match_all(preds, REFS) == ruler_string_match_all(preds, REFS) == 68.06
    assert string_match_part(preds, REFS) == ruler_string_match_part(preds, REFS) == 83.33
    for p, r in zip(preds, REFS):  # the per-sample terms the harness averages
        assert round(sample_score("string_match_all", p, r) * 100, 2) == ruler_string_match_all([p], [r])
        assert round(sample_score("string_match_part", p, r) * 100, 2) == ruler_string_match_part([p], [r])


def test_joined_words_equal_the_full_list():
    """``JoinedWords`` (no millions of strings) against niah.py's sorted(set(...)), on every adjective
    that shares a head with another (blue / blue-eyed, …), twenty others at random, and all nouns —
    plus made-up words with spaces, apostrophes and hyphens that collide."""
    adjs, nouns = _category("adjectives"), _category("nouns")
    heads = {}
    for a in adjs:
        heads.setdefault(re.split(r"[ '\-]", a)[0], []).append(a)
    tricky = [a for group in heads.values() if len(group) > 1 for a in group]
    assert any("-" in a for a in tricky) and any("-" in n for n in nouns)
    subset = tricky + random.Random(0).sample(adjs, 20)
    for a_list, n_list in [(subset, nouns), (["a", "a-b", "a b", "a'b", "ab", "a-", "b"], ["b", "b-c", "c", "", "-"])]:
        want = sorted({f"{adj}-{noun}" for adj in a_list for noun in n_list})
        got = JoinedWords(a_list, n_list)
        assert len(got) == len(want)
        assert got[:] == want
        rng1, rng2 = random.Random(5), random.Random(5)
        assert [rng1.choice(got) for _ in range(50)] == [rng2.choice(want) for _ in range(50)]


def test_punkt_splits_as_nltk_english():
    """Punkt's English model: abbreviations (Mr., Dr.) do not end sentences; '.', '?' and '!' do."""
    text = "Mr. Smith met Dr. Jones at 5 p.m. on Jan. 3. They talked. Did it work? Yes! It did."
    assert sent_tokenize(text) == ("Mr. Smith met Dr. Jones at 5 p.m. on Jan. 3.", "They talked.", "Did it work?",
                                   "Yes!", "It did.")


def test_shrink_until_fits_refuses_where_ruler_loops_forever():
    calls = []

    def never(size, total=1000):
        calls.append(size)
        raise TooLong(total, 100)

    with pytest.raises(PromptError, match=r"^x: no example fits \(100 draws at the smallest haystack, size 5, were all "
                                          r"too long\): the shortest 1000 tokens with the generation budget, more "
                                          r"than 100$"):
        shrink_until_fits(never, 20, 5, what="x")  # hopeless: 10× over
    assert calls[:4] == [20, 15, 10, 5] and len(calls) == 3 + HOPELESS_AFTER
    calls.clear()
    with pytest.raises(PromptError, match=rf"^x: no example fits \({MAX_RETRIES} draws"):
        shrink_until_fits(lambda s: never(s, 103), 5, 5, what="x")  # close: RULER's full patience
    assert len(calls) == MAX_RETRIES
    draws = iter([104] * 300 + [99])  # the 301st draw at the smallest size fits, as RULER would find it
    assert shrink_until_fits(lambda s: s if (t := next(draws)) <= 100 else never(s, t), 5, 5, what="x") == 5
    assert shrink_until_fits(lambda s: s if s <= 10 else never(s), 20, 5, what="x") == 10

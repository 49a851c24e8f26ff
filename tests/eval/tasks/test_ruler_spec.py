"""RULER's metrics, prediction clean-up and word list, against the authors' code written out
(NVIDIA/RULER ``c3f5e3b4``: ``scripts/eval/synthetic/constants.py``, ``scripts/eval/evaluate.py``,
``scripts/data/synthetic/niah.py``) on hand-made outputs."""

import random
import re

import pytest

from eval.tasks.prompts import PromptError
from eval.tasks.ruler.spec import (
    TooLong,
    postprocess_pred,
    sample_score,
    shrink_until_fits,
    string_match_all,
    string_match_part,
)
from eval.tasks.ruler.text import JoinedWords, _category, sent_tokenize


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


def test_shrink_until_fits_refuses_only_where_the_sizes_say_no_draw_can_fit():
    """RULER's loop (niah.py ``generate_samples``: ``while True``, the size shrunk by ``incremental``
    down to the smallest, then fresh draws at it until one fits). Refused at once where the text
    every draw holds is over the length (``floor``) or the draw is impossible at that size
    (``random.sample`` of more items than there are); otherwise drawn on as RULER does — past the
    20,000 draws main stopped at (niah_multiquery at 1,018 tokens, seed 2: RULER's sample comes at
    draw ~28,000)."""
    calls = []

    def too_long(size, total):
        calls.append(size)
        raise TooLong(total, 100)

    with pytest.raises(PromptError, match=r"^x: no example fits: every draw at the smallest haystack \(size 5\) takes "
                                          r"at least 101 tokens with the generation budget \(its fixed text\), more "
                                          r"than 100$"):
        shrink_until_fits(lambda s: too_long(s, 1000), 20, 5, what="x", floor=lambda s: 101)
    assert calls == [20, 15, 10, 5]  # decided at the first draw at the smallest size, not after a count

    draws = iter([101] * 30_000 + [99])  # the 30,001st draw at the smallest size fits
    fits = shrink_until_fits(lambda s: s if (t := next(draws)) <= 100 else too_long(s, t), 5, 5, what="x",
                             floor=lambda s: 90)
    assert fits == 5 and next(draws, None) is None

    def impossible(size):  # niah.py's random.sample(range(num_haystack), len(needles)) with too few lines
        return random.Random(0).sample(range(size), 10)

    with pytest.raises(PromptError, match=r"^x: no example fits: at the smallest haystack \(size 2\) no draw is "
                                          r"possible \(ValueError: Sample larger than population"):
        shrink_until_fits(impossible, 7, 5, what="x", floor=lambda s: 0)
    assert shrink_until_fits(lambda s: s if s <= 10 else too_long(s, 1000), 20, 5, what="x", floor=lambda s: 0) == 10

    calls.clear()  # a bound the caller asks for (RulerOptions.max_draws): refused after that many draws
    with pytest.raises(PromptError, match=r"^x: no example fits in max_draws=7 draws at the smallest haystack "
                                          r"\(size 5\): the shortest 101 tokens with the generation budget, more "
                                          r"than 100 \(a draw of 90 would fit; RULER keeps drawing\)$"):
        shrink_until_fits(lambda s: too_long(s, 101), 5, 5, what="x", floor=lambda s: 90, max_draws=7)
    assert len(calls) == 7



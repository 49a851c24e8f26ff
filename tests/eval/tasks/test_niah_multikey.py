"""niah_multikey against its oracle, RULER's own generator (NVIDIA/RULER at c3f5e3b):
``scripts/data/synthetic/niah.py`` (``generate_input_output``, essay haystack), the ``niah``
template and answer prefix of ``scripts/data/synthetic/constants.py`` joined as
``scripts/data/prepare.py`` joins them for the ``base`` model template, the ``niah_multikey_1``
settings of ``scripts/synthetic.yaml``, and the metric ``string_match_all`` of
``scripts/eval/synthetic/constants.py`` — each written out below as the authors wrote it, on the same
sentences, keys, values and depths, compared string-equal and token-for-token."""

import pytest
import torch
from transformers import AutoTokenizer

from eval.config import ConfigError, build_config
from eval.sweep import run_sweep
from eval.tasks import get_task
from eval.tasks.niah_multikey import (
    DEPTHS,
    NiahMultikey,
    NiahMultikeyOptions,
    assemble,
    make_prompt,
    sentence_pairs,
    split_sentences,
)
from eval.tasks.prompts import PromptError, continuation, cycle_units
from eval.tasks.retrieval import contains_match
from ropescale.models import REFERENCE_MODEL
from ropescale.reference import kjv
from ropescale.runs.data import DataError, load_documents, tokenize_documents
from tests.approx import nested_approx
from tests.eval.test_tasks import expected_record, scored_by_hand

# --- RULER, as its authors wrote it -------------------------------------------------------------
# scripts/data/synthetic/constants.py TASKS['niah']
RULER_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                  "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                  "magic {type_needle_v} for {query} mentioned in the provided text?")
RULER_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# scripts/data/prepare.py: Templates['base'] = "{task_template}"; template = base.format(...) + answer_prefix
RULER_BASE = "{task_template}"
# scripts/synthetic.yaml niah_multikey_1
MULTIKEY_1 = dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                  num_needle_k=4, num_needle_v=1, num_needle_q=1)


def ruler_depths():
    """niah.py: DEPTHS = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))"""
    import numpy as np

    return [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


def ruler_input(document_sents, keys, values, depths, query, type_needle_v="numbers", num_needle_q=1,
                num_needle_v=1):
    """niah.py generate_input_output, essay branch, with its random draws given: ``document_sents``
    for sent_tokenize's output, ``depths`` (percent) for random.sample(DEPTHS, ...), the needles in
    the order the shuffle left them, ``query`` for the sampled key index."""
    needle = "One of the special magic {type_needle_v} for {key} is: {value}."
    needles = [needle.format(type_needle_v=type_needle_v, key=k, value=v) for k, v in zip(keys, values)]
    insertion_positions = [0] + \
                          sorted([int(len(document_sents) * (depth / 100)) for depth in depths]) + \
                          [len(document_sents)]
    document_sents_list = []
    for i in range(1, len(insertion_positions)):
        last_pos = insertion_positions[i - 1]
        next_pos = insertion_positions[i]
        document_sents_list.append(" ".join(document_sents[last_pos:next_pos]))
        if i - 1 < len(needles):
            document_sents_list.append(needles[i - 1])
    context = " ".join(document_sents_list)

    queries = [keys[query]]
    answers = [values[query]]
    query = ', '.join(queries[:-1]) + ', and ' + queries[-1] if len(queries) > 1 else queries[0]
    template = RULER_BASE.format(task_template=RULER_TEMPLATE) + RULER_ANSWER_PREFIX
    if num_needle_q * num_needle_v == 1:
        template = template.replace('Some', 'A')
        template = template.replace('are all', 'is')
        template = template.replace('are', 'is')
        template = template.replace('answers', 'answer')
        type_needle_v = type_needle_v[:-1]  # remove "s"
    input_text = template.format(type_needle_v=type_needle_v, context=context, query=query)
    return input_text, answers


def string_match_all(preds, refs):
    """scripts/eval/synthetic/constants.py, the metric of every niah task."""
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


# --- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


@pytest.fixture(scope="module")
def sentences():
    return split_sentences(dict(kjv.split("heldout"))["Ruth"])


KEYS = ["saddle", "lantern", "violin", "harbor"]
VALUES = ["8425610", "3534445", "6784075", "5904516"]


def ruler_order(depths):
    """The needle order RULER's shuffle must leave so that needle i lands at depths[i]."""
    return sorted(range(len(depths)), key=lambda i: depths[i])


def ruler_for(units, depths_pct, query):
    """RULER's prompt over ``units`` with needle i at depths_pct[i] (percent), asking for key ``query``."""
    order = ruler_order(depths_pct)
    text, answers = ruler_input([t for t, _ in units], [KEYS[i] for i in order], [VALUES[i] for i in order],
                                [depths_pct[i] for i in order], order.index(query))
    return text, answers


# --- the prompt ----------------------------------------------------------------------------------
def test_settings_are_rulers():
    assert ruler_depths() == DEPTHS and len(DEPTHS) == 40
    o = NiahMultikeyOptions()
    assert (o.keys, o.digits) == (MULTIKEY_1["num_needle_k"], 7)


CASES = [  # needle depths in percent (needle 0 is asked for unless said), RULER's quirks included
    ([51, 13, 82, 36], 0),  # four distinct positions inside the text
    ([28, 95, 5, 64], 2),   # the question asks for a needle other than the first given
    ([0, 44, 69, 90], 0),   # depth 0: the context opens with a space before the needle
    ([100, 23, 59, 77], 0),  # depth 100: a space after the last needle, before the question's newline
    ([46, 49, 10, 87], 1),  # 46% and 49% of 12 sentences are both sentence 5: two spaces between needles
    ([0, 0, 100, 100], 3),  # every needle at an end
]


@pytest.mark.parametrize("depths_pct,query", CASES)
@pytest.mark.parametrize("n", [1, 2, 12, 40])
def test_prompt_over_whole_sentences_is_rulers_token_for_token(tok, sentences, depths_pct, query, n):
    units = sentence_pairs(tok, sentences[:n])
    p = assemble(tok, units, depths=[d / 100 for d in depths_pct], keys=KEYS, values=VALUES, query=query)
    text, answers = ruler_for(units, depths_pct, query)
    assert tok.decode(p.ids) == text
    assert p.ids == tok(text, add_special_tokens=False)["input_ids"]
    assert [p.answer] == answers and p.answer_ids == continuation(tok, text, answers[0])[1]
    assert tok.decode(p.ids[p.needle_start:p.needle_end]) == \
        f" One of the special magic numbers for {KEYS[query]} is: {VALUES[query]}."
    assert sorted(p.others) == sorted(v for i, v in enumerate(VALUES) if i != query)


def test_the_singular_template_reads_as_rulers(tok, sentences):
    # one sentence: depths 0.5, 0 and 0.2 are all before it, in order of depth; 1.0 after it
    p = assemble(tok, sentence_pairs(tok, sentences[:1]), depths=[0.5, 0.0, 1.0, 0.2], keys=KEYS, values=VALUES,
                 query=0)
    assert tok.decode(p.ids) == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the number afterwards.\n"
        " One of the special magic numbers for lantern is: 3534445. "
        " One of the special magic numbers for harbor is: 5904516. "
        " One of the special magic numbers for saddle is: 8425610. "
        + sentences[0] +
        " One of the special magic numbers for violin is: 6784075. "
        "\nWhat is the special magic number for saddle mentioned in the provided text? The special magic number "
        "for saddle mentioned in the provided text is")


def first_tokens(tok, units, h):
    """The haystack RULER is given when the prompt holds h haystack tokens: whole sentences, the
    last cut at a token (its text what those tokens say)."""
    out, used = [], 0
    for text, ids in units:
        if used >= h:
            break
        if used + len(ids) > h:
            ids = ids[: h - used]
            text = tok.decode(ids)[1:]
        out.append((text, ids))
        used += len(ids)
    return out


@pytest.mark.parametrize("depths_pct,query", CASES)
@pytest.mark.parametrize("length", [210, 230, 256, 333, 512, 1024])
def test_prompts_hit_their_length_and_are_rulers_over_their_haystack(tok, sentences, depths_pct, query, length):
    units = sentence_pairs(tok, sentences)
    p = make_prompt(tok, cycle_units(units, 3), length=length, depths=[d / 100 for d in depths_pct], keys=KEYS,
                    values=VALUES, query=query)
    assert p.length == length and len(p.ids) + len(p.answer_ids) == length
    text, _ = ruler_for(first_tokens(tok, units[3:], p.haystack), depths_pct, query)
    assert tok.decode(p.ids) == text


def test_a_length_too_short_is_one_line(tok, sentences):
    units = sentence_pairs(tok, sentences)
    # 1 token left for the haystack, but four needles before one unit bring three joining spaces
    with pytest.raises(PromptError, match=r"^length 204 is too short for this prompt: the header, 4 needles, "
                                          r"question and answer take 203 tokens, and the 1 left cannot hold a "
                                          r"haystack with the spaces between needles$"):
        make_prompt(tok, cycle_units(units), length=204, depths=[0.5, 0.1, 0.2, 0.3], keys=KEYS, values=VALUES,
                    query=0)
    with pytest.raises(PromptError, match=r"^length 202 is too short for this prompt: the header, 4 needles, "
                                          r"question and answer alone take 203 tokens$"):
        make_prompt(tok, cycle_units(units), length=202, depths=[0.5, 0.1, 0.2, 0.3], keys=KEYS, values=VALUES,
                    query=0)


def test_sentences_split_as_ruler_reads_its_essays():
    text = ("In the beginning God created the heaven and the earth.\nAnd the earth was without form,\n\tand "
            "void; and darkness was upon the face of the deep.   And God said, Let there be light: and there was "
            "light. Who said \"Go.\" Then (it was good.) He asked: why? Yes! no.5 ends")
    assert split_sentences(text) == [
        "In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void; and darkness was upon the face of the deep.",
        "And God said, Let there be light: and there was light.",
        "Who said \"Go.\"",
        "Then (it was good.)",
        "He asked: why?",
        "Yes!",
        "no.5 ends",
    ]


# --- the metric -----------------------------------------------------------------------------------
def test_metric_is_rulers_string_match_all():
    preds = [" 8425610.", "8425610", " 3534445. 8425610", " 842561", " 3534445", "", " 84256100"]
    refs = [["8425610"]] * len(preds)
    ours = [contains_match(p, r[0]) for p, r in zip(preds, refs)]
    assert ours == [True, True, True, False, False, False, True]
    assert round(100 * sum(ours) / len(ours), 2) == string_match_all(preds, refs)


# --- options, lengths, examples -------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [
    ({"keys": 1}, "keys\n  Input should be greater than or equal to 2"),
    ({"keys": 41}, "keys\n  Input should be less than or equal to 40"),
    ({"keys": True}, "expected an integer, got true"),
    ({"digits": 1, "keys": 4, "candidates": 7, "trials": 2},
     "keys=4 values and candidates=7 need more distinct 1-digit numbers"),
    ({"depths": [0.5, 1.5]}, r"depths must lie in \[0, 1\]"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        NiahMultikeyOptions(**bad)


def test_bad_config_is_one_line():
    one_line = r"^config: niah_multikey_depths.kys: unknown key; allowed: .*\(did you mean 'keys'\?\)$"
    with pytest.raises(ConfigError, match=one_line):
        build_config({"task": "niah_multikey_depths", "lengths": [512], "strategies": ["vanilla"],
                      "niah_multikey_depths": {"kys": 3}})
    with pytest.raises(ConfigError, match=r"^config: length 64 cannot hold a niah_multikey prompt: its header, "
                                          r"4 needles, question and answer are 89 words, at least one token each$"):
        build_config({"task": "niah_multikey_depths", "lengths": [64, 512], "strategies": ["vanilla"]})
    build_config({"task": "niah_multikey_depths", "lengths": [89], "strategies": ["vanilla"]})


def test_min_words_counts_the_shortest_prompt():
    o = NiahMultikeyOptions(keys=2, digits=3)
    needle = "One of the special magic numbers for apple is: 123."
    question = ("What is the special magic number for apple mentioned in the provided text? The special magic "
                "number for apple mentioned in the provided text is")
    header = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
              "you about the number afterwards.")
    assert o.min_words() == len(header.split()) + 2 * len(needle.split()) + len(question.split()) + 1 == 69


@pytest.fixture(scope="module")
def task(tok):
    docs = tokenize_documents(
        tok, load_documents(build_config({"lengths": [8], "strategies": ["vanilla"]}).data.spec()))
    opts = NiahMultikeyOptions(depths=[0.0, 0.5, 1.0], trials=2, candidates=6)
    return NiahMultikey(opts, tokenizer=tok, train_length=128, documents=docs)


def test_task_is_found_by_name_and_reads_data():
    assert get_task("niah_multikey_depths") is NiahMultikey and NiahMultikey.uses_data
    assert NiahMultikey.summary().startswith("Multi-key needle in a haystack")


@pytest.mark.parametrize("length", [256, 1024])
def test_examples(task, tok, length):
    ex = task.examples(length)
    assert len(ex) == 6 and [e.depth_index for e in ex] == [0, 0, 1, 1, 2, 2]
    assert [e.prompt.length for e in ex] == [length] * 6
    assert [e.prompt.ids for e in task.examples(length)] == [e.prompt.ids for e in ex]  # seeded
    for e in ex:
        p = e.prompt
        text = tok.decode(p.ids)
        key = p.question.split(" for ")[1].split(" ")[0]
        assert text.count(f" One of the special magic numbers for {key} is: {p.answer}.") == 1
        assert len(p.others) == 3 and len(set(p.others + (p.answer,))) == 4
        assert all(f"is: {v}." in text for v in p.others)
        values = [p.answer, *p.others]
        cands = [tok.decode(c).strip() for c in e.candidates]
        assert len(cands) == 6 and len(set(cands)) == 6
        assert cands[:4] == values and all(len(c) == 7 and c.isdigit() for c in cands)
        assert e.candidates[0] == p.answer_ids


def test_a_source_without_text_is_one_line(tok):
    empty = NiahMultikey(NiahMultikeyOptions(), tokenizer=tok, train_length=128,
                         documents=[torch.tensor(tok(" \n\t ", add_special_tokens=False)["input_ids"])])
    with pytest.raises(DataError, match=r"^the data source: no text for the niah_multikey haystack$"):
        empty.examples(512)


def test_fewer_candidates_than_needles(tok, task):
    small = NiahMultikey(NiahMultikeyOptions(depths=[0.5], trials=1, candidates=2), tokenizer=tok,
                         train_length=128, documents=task.documents)
    (e,) = small.examples(512)
    assert [tok.decode(c).strip() for c in e.candidates] == [e.prompt.answer, e.prompt.others[0]]


def test_niah_multikey_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir, text_file):
    cfg = build_config({"task": "niah_multikey_depths", "model": str(tiny_model_dir), "data": str(text_file),
                        "lengths": [224], "strategies": ["vanilla", "yarn"], "device": "cpu",
                        "niah_multikey_depths": {"trials": 2, "depths": [0.0, 1.0], "keys": 3, "digits": 4,
                                          "candidates": 3}})
    records = run_sweep(cfg, tmp_path, progress=False)
    assert [(r["task"], r["strategy"], r["trials"], r["chance"]) for r in records] == [
        ("niah_multikey_depths", "vanilla", 4, 1 / 3), ("niah_multikey_depths", "yarn", 4, 1 / 3)]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    docs = tokenize_documents(tok, load_documents(cfg.data.spec()))
    t = NiahMultikey(cfg.options, tokenizer=tok, train_length=32, documents=docs)
    with torch.no_grad():
        overall, by_depth = expected_record(scored_by_hand(tiny_model_dir, t, 224, lambda text, a: a in text),
                                            [0.0, 1.0])
    r = records[0]
    assert {k: r[k] for k in overall} == nested_approx(overall)
    assert [{k: d[k] for k in e} for d, e in zip(r["by_depth"], by_depth)] == nested_approx(by_depth)
    assert (tmp_path / "depth_heatmap.png").stat().st_size > 0

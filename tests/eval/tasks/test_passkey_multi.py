"""Labelled passkeys (``passkey_multi``): the prompt read back as text (every needle once, at its depth, the
question naming the label whose key is the answer), the length exact for the longest question, distinct
labels and keys, the haystack's other keys first among the candidates; and a sweep on the bundled model
that scores one forward of the haystack per trial group."""

import re

import pytest

from eval.tasks.base import get_task
from eval.tasks.passkey import filler_units
from eval.tasks.passkey_multi import INFO, haystack_prompts
from eval.tasks.prompts import PromptError, cycle_units
from ropescale.models import load_model


@pytest.fixture(scope="module")
def tok():
    return load_model("reference", device="cpu")[1]


def test_one_haystack_holds_every_key_once_at_its_depth_and_each_question_asks_one(tok):
    depths, labels, keys = [0.1, 0.5, 0.9], [37, 12, 80], ["51234", "60987", "72345"]
    prompts = haystack_prompts(tok, cycle_units(filler_units(tok)), length=400, depths=depths, labels=labels, keys=keys)
    assert max(p.length for p in prompts) == 400 and all(p.length >= 396 for p in prompts)
    shared = min(len(p.ids) for p in prompts) - 20
    assert all(p.ids[:shared] == prompts[0].ids[:shared] for p in prompts)  # one haystack
    for p, depth, label, key in zip(prompts, depths, labels, keys):
        text = tok.decode(p.ids)
        for lab, k in zip(labels, keys):  # every needle once
            assert text.count(INFO.format(label=lab, key=k)) == 1
        assert tok.decode(p.ids[p.needle_start:p.needle_end]).strip() == INFO.format(label=label, key=key)
        assert re.search(rf"What is the pass key number {label}\? The pass key number {label} is$", text)
        assert p.answer == key and tok.decode(p.answer_ids).strip() == key
        haystack = p.needle_start / (len(p.ids) - 30)
        assert abs(haystack - depth) < 0.1  # within a filler sentence or two of its depth


def test_too_short_a_length_is_one_line(tok):
    with pytest.raises(PromptError, match="too short for 3 labelled keys"):
        haystack_prompts(tok, cycle_units(filler_units(tok)), length=60, depths=[0.1, 0.5, 0.9], labels=[10, 11, 12],
                         keys=["11111", "22222", "33333"])


def test_examples_give_each_haystack_distinct_labels_and_keys_and_hard_candidates(tok):
    cls = get_task("passkey_multi")
    t = cls(cls.Options(depths=[0.2, 0.5, 0.8], trials=2, candidates=5), tokenizer=tok, train_length=128,
            documents=None)
    examples = t.examples(256)
    assert len(examples) == 6 and [e.depth_index for e in examples] == [0, 1, 2, 0, 1, 2]
    for group in (examples[:3], examples[3:]):
        keys = [e.prompt.answer for e in group]
        labels = [re.search(r"number (\d+)\?", e.prompt.question).group(1) for e in group]
        assert len(set(keys)) == 3 and len(set(labels)) == 3
        for e in group:
            cands = [tok.decode(c).strip() for c in e.candidates]
            assert cands[0] == e.prompt.answer and len(set(cands)) == 5
            assert set(cands[1:3]) == set(keys) - {e.prompt.answer}  # the haystack's other keys first
    assert examples[0].prompt.answer != examples[3].prompt.answer  # another haystack, other keys


@pytest.mark.slow
def test_a_sweep_on_the_bundled_model_reports_every_key(tmp_path):
    from eval.config import build_config
    from eval.sweep import run_sweep

    cfg = build_config({"task": "passkey_multi", "model": "reference", "lengths": [128], "strategies": ["vanilla"],
                        "passkey_multi": {"depths": [0.25, 0.75], "trials": 2}, "device": "cpu"})
    (record,) = run_sweep(cfg, tmp_path / "run", progress=False)
    assert record["trials"] == 4 and [d["trials"] for d in record["by_depth"]] == [2, 2]
    assert 0 <= record["accuracy"] <= 1 and record["accuracy_ci"][0] <= record["accuracy"] <= record["accuracy_ci"][1]


def test_a_repeated_depth_is_refused_not_dropped():
    # RetrievalOptions keeps sorted(set(depths)): [0.5, 0.5] became one key, under min_length=2, with no word
    from pydantic import ValidationError

    from eval.tasks.passkey_multi import PasskeyMultiOptions

    with pytest.raises(ValidationError, match=r"depths must be distinct .*0\.5 is given twice"):
        PasskeyMultiOptions(depths=[0.5, 0.2, 0.5])
    assert PasskeyMultiOptions(depths=[0.5, 0.2]).depths == [0.2, 0.5]

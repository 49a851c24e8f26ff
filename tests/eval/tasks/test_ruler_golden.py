"""RULER's generators against the authors' own output: ``tests/data/ruler/<task>.json.xz`` holds the
samples RULER's ``scripts/data/prepare.py`` wrote (NVIDIA/RULER ``c3f5e3b4``, ``--tokenizer_type hf``
with the bundled reference tokenizer, base template, essay haystack = the bundled KJV held-out
books; how: ``tests/data/ruler/make_golden.py``) for 3 seeds × 3 lengths, 2 samples each. Every
task must write the same samples — prompt, answer prefix, references, RULER's length and (niah) the
answer's character and token position — and read the same tokens."""

import json
import lzma
from functools import cache
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eval.tasks import get_task
from ropescale.models import REFERENCE_MODEL
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

DATA = Path(__file__).resolve().parents[2] / "data" / "ruler"
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
BUDGET = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}


@cache
def tokenizer():
    return AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))


@cache
def kjv_docs():
    return tokenize_documents(tokenizer(), load_documents(DataSpec("kjv-heldout")))


@cache
def golden(task: str) -> dict:
    with lzma.open(DATA / f"{task}.json.xz", "rt", encoding="utf-8") as f:
        return json.load(f)


def make_task(name: str, seed: int):
    cls = get_task(name)
    opts = cls.Options(num_samples=2, seed=seed, cache=False)
    return cls(opts, tokenizer=tokenizer(), train_length=128, documents=kjv_docs() if cls.uses_data else None,
               source="kjv-heldout")


@pytest.mark.parametrize("task", TASKS)
def test_the_golden_files_hold_rulers_runs(task):
    doc = golden(task)
    assert doc["ruler_commit"].startswith("c3f5e3b4") and doc["model_template_type"] == "base"
    assert len({r["seed"] for r in doc["runs"]}) >= 3 and len({r["length"] for r in doc["runs"]}) >= 3
    assert len(doc["runs"]) == RUNS


RUNS = 9  # 3 seeds × 3 lengths per task: one test each, so that the slow ones spread over the workers


@pytest.mark.parametrize("index", range(RUNS))
@pytest.mark.parametrize("task", TASKS)
def test_prompts_equal_rulers(task, index):
    tok = tokenizer()
    run = golden(task)["runs"][index]
    t = make_task(task, run["seed"])
    examples = t.examples(run["length"])
    assert len(examples) == len(run["samples"]) == 2
    for ex, want in zip(examples, run["samples"]):
        got = ex.sample.to_json()
        where = f"{task} seed {run['seed']} length {run['length']}"
        for k in ("input", "answer_prefix", "outputs", "length", "index"):
            assert got[k] == want[k], f"{where}: {k} differs"
        assert got.get("token_position_answer") == want.get("token_position_answer"), where
        # tokens: what the model reads is RULER's input + answer prefix, tokenized
        assert ex.ids == tok(want["input"] + want["answer_prefix"])["input_ids"], where
        assert len(tok.tokenize(want["input"] + want["answer_prefix"])) + BUDGET[t.family] == want["length"]
        assert want["length"] <= run["length"]


def test_fewer_samples_are_a_prefix():
    """RULER draws its size search before any sample: the first sample of a 2-sample run is the
    1-sample run's (what lets the cache answer smaller requests)."""
    run = golden("niah_single_1")["runs"][0]
    t = make_task("niah_single_1", run["seed"])
    one = t.generate(run["length"], 1)
    assert one[0].input == run["samples"][0]["input"]

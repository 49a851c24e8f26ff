"""The walks of issue 30: a search (TPE and LongRoPE's evolution) loads the tokenizer once and
tokenizes its data once, however many pieces of the run need them (the objective, the model, the
run's identity in the manifest). Counted at transformers' ``AutoTokenizer.from_pretrained`` and
at the tokenizer's call on the search split's documents."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.runs.data import DataSpec, load_documents

pytestmark = pytest.mark.slow

TPE = {"model": "reference", "strategy": "yarn", "fixed": {"factor": 4}, "lengths": [256],
       "search": {"beta_fast": [4, 64]}, "budget": 1, "max_windows": 1, "seed": 0, "threads": 2}
EVOLUTION = {"model": "reference", "strategy": "longrope", "method": "evolution", "lengths": [256], "budget": 2,
             "max_windows": 1, "threads": 2, "evolution": {"population": 2, "iterations": 0, "elite": 1}}


@pytest.fixture
def counted(monkeypatch):
    """``{"tokenizers": n, "data": n}``: tokenizers loaded, and calls tokenizing the search split."""
    counts = {"tokenizers": 0, "data": 0}
    docs = load_documents(DataSpec(source="kjv-train"))
    load, call = AutoTokenizer.from_pretrained, PreTrainedTokenizerBase.__call__

    def from_pretrained(*args, **kwargs):
        counts["tokenizers"] += 1
        return load(*args, **kwargs)

    def tokenize(self, text=None, *args, **kwargs):
        if isinstance(text, list) and text == docs:
            counts["data"] += 1
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", tokenize)
    return counts


@pytest.mark.parametrize("raw", [TPE, EVOLUTION], ids=["tpe", "evolution"])
def test_a_search_loads_the_tokenizer_once_and_tokenizes_its_data_once(raw, counted, tmp_path):
    run_search(build_search_config(raw), tmp_path / "s", progress=False)
    assert counted == {"tokenizers": 1, "data": 1}

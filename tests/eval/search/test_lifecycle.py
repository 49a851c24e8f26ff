"""The walks of issue 30: a search (TPE and LongRoPE's evolution) loads the tokenizer once and
tokenizes its data once, however many pieces of the run need them (the objective, the model, the
run's identity in the manifest). Counted at transformers' ``AutoTokenizer.from_pretrained`` and
at the tokenizer's call on the search split's documents."""

from __future__ import annotations

import pytest

from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.runs.data import DataSpec, load_documents
from tests.load_counts import count_loads

pytestmark = pytest.mark.slow

TPE = {"model": "reference", "strategy": "yarn", "fixed": {"factor": 4}, "lengths": [256],
       "search": {"beta_fast": [4, 64]}, "budget": 1, "max_windows": 1, "seed": 0}
EVOLUTION = {"model": "reference", "strategy": "longrope", "method": "evolution", "lengths": [256], "budget": 2,
             "max_windows": 1, "evolution": {"population": 2, "iterations": 0, "elite": 1}}


@pytest.fixture
def counted(monkeypatch):
    """``{"tokenizers": n, "data": n}``: tokenizers loaded, and calls tokenizing the search split."""
    return count_loads(monkeypatch, load_documents(DataSpec(source="kjv-train")))


@pytest.mark.parametrize("raw", [TPE, EVOLUTION], ids=["tpe", "evolution"])
def test_a_search_loads_the_tokenizer_once_and_tokenizes_its_data_once(raw, counted, tmp_path):
    run_search(build_search_config(raw), tmp_path / "s", progress=False)
    assert counted == {"tokenizers": 1, "data": 1}

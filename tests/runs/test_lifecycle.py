"""The run lifecycle (``ropescale.runs.lifecycle``) walked by a sweep and by a fine-tuning run: each
loads the tokenizer once and tokenizes its data once (both loaded the tokenizer twice before:
``load_tokenizer``, then ``load_model`` again). Counted at transformers' ``AutoTokenizer.from_pretrained``
and at the tokenizer's call on the run's documents; the searches' walks are in
``tests/eval/search/test_lifecycle.py``."""

from __future__ import annotations

import pytest

from eval.config import build_config
from eval.sweep import run_sweep
from ropescale.runs.data import DataSpec, load_documents
from ropescale.training import build_finetune_config, finetune
from tests.load_counts import count_loads


@pytest.fixture
def counted(monkeypatch, tiny_model_dir, text_file):
    """``{"tokenizers": n, "data": n}``: tokenizers loaded, and calls tokenizing ``text_file``'s documents
    (the tiny model is saved first: its fixture loads a tokenizer of its own)."""
    return count_loads(monkeypatch, load_documents(DataSpec(source=str(text_file))))


def test_a_sweep_loads_the_tokenizer_once_and_tokenizes_its_data_once(counted, tiny_model_dir, text_file, tmp_path):
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32],
                        "strategies": ["vanilla", "linear"], "max_windows": 2, "device": "cpu"})
    run_sweep(cfg, tmp_path / "s", progress=False)
    assert counted == {"tokenizers": 1, "data": 1}


def test_a_finetuning_run_loads_the_tokenizer_once_and_tokenizes_its_data_once(counted, tiny_model_dir, text_file,
                                                                                tmp_path):
    cfg = build_finetune_config({"model": str(tiny_model_dir), "strategy": "linear", "data": str(text_file),
                                 "length": 64, "steps": 1, "batch_size": 1, "warmup": 0, "device": "cpu"})
    finetune(cfg, tmp_path / "f", progress=False)
    assert counted == {"tokenizers": 1, "data": 1}

"""Counting the loads of a run's walk: tokenizers loaded (transformers' ``AutoTokenizer.from_pretrained``)
and calls tokenizing the run's documents (the tokenizer's ``__call__`` on exactly that list)."""

from __future__ import annotations

from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def count_loads(monkeypatch, docs: list[str]) -> dict[str, int]:
    """``{"tokenizers": n, "data": n}``, counted from now until ``monkeypatch`` is undone."""
    counts = {"tokenizers": 0, "data": 0}
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

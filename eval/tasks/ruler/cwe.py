"""RULER's common words extraction, ``cwe`` (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER
``c3f5e3b4`` ``scripts/data/synthetic/common_words_extraction.py`` with ``scripts/synthetic.yaml``'s
``cwe``: freq_cw 30, freq_ucw 3, num_cw 10): the ten most common words of a numbered list. Prompts
from ``cwe_gen``; metric ``string_match_all``; 120 tokens generated."""

from __future__ import annotations

from pydantic import Field

from .base import RulerOptions, RulerTask
from .cwe_gen import generate_cwe

__all__ = ["CommonWords", "CweOptions"]


class CweOptions(RulerOptions):
    """RULER cwe's options (its word counts, at RULER's defaults)."""

    freq_cw: int = Field(30, ge=1, description="repeats of each common word (≥ 4096 tokens; RULER: 30)")
    freq_ucw: int = Field(3, ge=1, description="repeats of each other word (≥ 4096 tokens; RULER: 3)")
    num_cw: int = Field(10, ge=1, description="common words (RULER: 10)")
    num_fewshot: int = Field(1, ge=0, description="solved examples before the task (RULER: 1)")
    english_words: str | None = Field(None, description="a local copy of RULER's json/english_words.json, drawn from "
                                                        "when a list needs more words than wonderwords has")

    def key(self):
        return super().key() | {"english_words": bool(self.english_words)}


class CommonWords(RulerTask):
    """RULER cwe: the ten most common words of a long numbered list."""

    name = "cwe"
    family = "common_words_extraction"
    Options = CweOptions

    def generate(self, length, num_samples):
        o = self.options
        return generate_cwe(count=self.count, template=self.template, max_seq_length=length, num_samples=num_samples,
                            seed=o.seed, tokens_to_generate=self.budget, freq_cw=o.freq_cw, freq_ucw=o.freq_ucw,
                            num_cw=o.num_cw, num_fewshot=o.num_fewshot, english_words=o.english_words,
                            what=self.name, max_draws=o.max_draws)

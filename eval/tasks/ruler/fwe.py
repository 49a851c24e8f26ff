"""RULER's frequent words extraction, ``fwe`` (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER
``c3f5e3b4`` ``scripts/data/synthetic/freq_words_extraction.py`` with ``scripts/synthetic.yaml``'s
``fwe``: alpha 2.0): the three most frequent coded words of a Zipf-distributed text. Prompts from
``fwe_gen``; metric ``string_match_all``; 50 tokens generated."""

from __future__ import annotations

from pydantic import Field

from .base import RulerOptions, RulerTask
from .fwe_gen import generate_fwe

__all__ = ["FreqWords", "FweOptions"]


class FweOptions(RulerOptions):
    """RULER fwe's options: the Zipf exponent, coded word length and vocabulary (RULER's defaults)."""

    alpha: float = Field(2.0, gt=1.0, description="Zipf exponent of the word counts (RULER: 2.0)")
    coded_wordlen: int = Field(6, ge=1, description="letters per coded word (RULER: 6)")
    vocab_size: int = Field(-1, ge=-1, description="coded words; -1: (length − budget) // 50, as RULER")


class FreqWords(RulerTask):
    """RULER fwe: the three most frequent words of a coded text."""

    name = "fwe"
    family = "freq_words_extraction"
    Options = FweOptions

    def generate(self, length, num_samples):
        o = self.options
        return generate_fwe(count=self.count, template=self.template, max_seq_length=length, num_samples=num_samples,
                            seed=o.seed, tokens_to_generate=self.budget, alpha=o.alpha, coded_wordlen=o.coded_wordlen,
                            vocab_size=o.vocab_size, what=self.name)

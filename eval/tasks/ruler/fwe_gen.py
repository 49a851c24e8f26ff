"""RULER's frequent-words generator (NVIDIA/RULER ``c3f5e3b4``,
``scripts/data/synthetic/freq_words_extraction.py``), draw for draw.

A coded text of random ``coded_wordlen``-letter words whose counts follow a Zipf law of exponent
``alpha`` (the most frequent made ``...``, noise); the answer is the next three words by rank. The
vocabulary has ``(length − budget) // 50`` words unless ``vocab_size`` is set; a length too short
for four words, or for the template alone, is refused (RULER would divide by zero when scoring,
or loop forever).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

import numpy as np

from ..prompts import PromptError
from .spec import FAMILIES, RulerSample, split_answer_prefix
from .text import Draws

__all__ = ["generate_fwe"]


def generate_fwe(*, count: Callable[[str], int], template: str, max_seq_length: int, num_samples: int, seed: int,
                 tokens_to_generate: int = 50, alpha: float = 2.0, coded_wordlen: int = 6, vocab_size: int = -1,
                 what: str = "fwe") -> list[RulerSample]:
    """``freq_words_extraction.py``'s samples (see ``niah_gen.generate_niah``)."""
    from scipy.special import zeta

    d = Draws(seed)
    budget = max_seq_length - tokens_to_generate
    vocab_n = budget // 50 if vocab_size == -1 else vocab_size
    if vocab_n < 4:
        raise PromptError(f"{what} at {max_seq_length} tokens: a vocabulary of {vocab_n} coded words has no three "
                          "answers after the noise word (RULER sizes it (length − generation budget) // 50; "
                          "use a longer length or set vocab_size ≥ 4)")

    def input_output(max_len: int, num_words: int, incremental: int) -> tuple[str, list[str], int]:
        vocab = ["".join(d.py.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_n)]
        while len(set(vocab)) < vocab_n:
            vocab.append("".join(d.py.choices(string.ascii_lowercase, k=coded_wordlen)))
        vocab = sorted(set(vocab))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."

        def gen_text(n: int) -> tuple[str, list[str]]:
            k = np.arange(1, len(vocab) + 1)
            sampled_cnt = n * (k ** -alpha) / zeta(alpha)
            words = [x for w, zi in zip(vocab, sampled_cnt.astype(int)) for x in [w] * zi]
            random.Random(seed).shuffle(words)
            return template.format(context=" ".join(words), query=""), vocab[1:4]

        if num_words > 0:
            text, answer = gen_text(num_words)
            while count(text) > max_len:
                if num_words <= 0:
                    raise PromptError(f"{what} at {max_seq_length} tokens: the template alone is longer than "
                                      f"{max_len} tokens")
                num_words -= incremental
                text, answer = gen_text(num_words)
        else:
            num_words = max_len // coded_wordlen
            text, answer = gen_text(num_words)
            while count(text) < max_len:
                num_words += incremental
                text, answer = gen_text(num_words)
            num_words -= incremental
        text, answer = gen_text(num_words)
        return text, answer, num_words

    incremental = budget // 32
    if incremental < 1:
        raise PromptError(f"{what} at {max_seq_length} tokens: too short for the generation budget")
    _, _, num_example_words = input_output(budget, -1, incremental)
    family = FAMILIES["freq_words_extraction"]
    out = []
    for index in range(num_samples):
        text, answer, _ = input_output(budget, num_example_words, incremental)
        length = count(text) + tokens_to_generate
        prompt, prefix = split_answer_prefix(family, text)
        out.append(RulerSample(index, prompt, tuple(answer), length, prefix))
    return out

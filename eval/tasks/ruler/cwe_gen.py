"""RULER's common-words generator (NVIDIA/RULER ``c3f5e3b4``,
``scripts/data/synthetic/common_words_extraction.py``), draw for draw.

A numbered list of words in which ``num_cw`` words appear ``freq_cw`` times and the rest
``freq_ucw`` times (below 4096 tokens: 6 and 1), after ``num_fewshot`` solved examples; the answer
is the common words. Words are wonderwords' nouns, adjectives and verbs (``text.cwe_words``);
a list longer than those (about 100k tokens and up) draws from RULER's ``json/english_words.json``,
which is read from ``english_words`` (a local copy) — refused in one line without it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from ..prompts import PromptError
from .spec import FAMILIES, RulerSample, binary_search, fitting, shrink_until_fits, split_answer_prefix
from .text import Draws, cwe_words

__all__ = ["generate_cwe", "load_english_words"]


def load_english_words(path: str | Path) -> list[str]:
    """The values of RULER's ``json/english_words.json`` (a JSON object), in file order."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise PromptError(f"{path}: not RULER's english_words.json (a JSON object of words)")
    return list(data.values())


def generate_cwe(*, count: Callable[[str], int], template: str, max_seq_length: int, num_samples: int, seed: int,
                 tokens_to_generate: int = 120, freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10,
                 num_fewshot: int = 1, english_words: str | None = None, what: str = "cwe",
                 max_draws: int | None = None) -> list[RulerSample]:
    """``common_words_extraction.py``'s samples (see ``niah_gen.generate_niah``)."""
    d = Draws(seed)
    words = cwe_words(seed)
    randle: list[str] | None = None

    def get_example(num_words: int, common_repeats: int, uncommon_repeats: int, common_nums: int,
                    blank: bool = False):
        nonlocal randle
        if blank:  # every word left out: the numbered list every draw of this size holds
            full = [""] * num_words
        elif num_words <= len(words):
            full = d.py.sample(words, num_words)
        else:
            if randle is None:
                if english_words is None:
                    raise PromptError(f"{what} at {max_seq_length} tokens: a list of {num_words} words needs more than "
                                      f"wonderwords' {len(words)}; RULER then draws from its json/english_words.json: "
                                      "give a local copy as english_words")
                randle = load_english_words(english_words)
            full = d.py.sample(randle, num_words)
        common, uncommon = full[:common_nums], full[common_nums:]
        word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(seed).shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

    def input_output(num_words: int, blank: bool = False) -> tuple[str, list[str]]:
        if max_seq_length < 4096:
            shots = [get_example(20, 3, 1, num_cw, blank) for _ in range(num_fewshot)]
            context, answer = get_example(num_words, 6, 1, num_cw, blank)
        else:
            shots = [get_example(40, 10, 3, num_cw, blank) for _ in range(num_fewshot)]
            context, answer = get_example(num_words, freq_cw, freq_ucw, num_cw, blank)
        texts = [template.format(num_cw=num_cw, context=c, query="") + " "
                 + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in shots]
        return "\n".join(texts) + "\n" + template.format(num_cw=num_cw, context=context, query=""), answer

    incremental = 10
    sample_text, _ = input_output(4096)
    per_word = count(sample_text) / 4096
    estimated = int(max_seq_length // per_word) * 2
    found = binary_search(lambda n: count(input_output(n)[0]) + tokens_to_generate, incremental,
                          max(estimated, incremental * 2), max_seq_length)
    num_words = found if found is not None else incremental

    attempt = fitting(input_output, count, tokens_to_generate, max_seq_length)

    def floor(size: int) -> int:  # the words left out (each at least one token of a real draw): nothing drawn
        return count(input_output(size, blank=True)[0]) + tokens_to_generate

    family = FAMILIES["common_words_extraction"]
    out = []
    for index in range(num_samples):
        text, answer, length = shrink_until_fits(attempt, num_words, incremental, what=f"{what} at {max_seq_length} "
                                                 "tokens", floor=floor, max_draws=max_draws)
        prompt, prefix = split_answer_prefix(family, text)
        out.append(RulerSample(index, prompt, tuple(answer), length, prefix))
    return out

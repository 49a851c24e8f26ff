"""Needle in a haystack on real text, RULER's ``niah_single`` (Hsieh et al. 2024, arXiv:2404.06654).

The haystack is sentences of the harness's data source (held-out KJV books by default; PG-19
and the like for real users), from a seeded starting sentence per example; the needle is a
magic-number line for a random word, under RULER's header line (``HEADER``: the task stated
before the haystack); the question asks for that word's number. Scored as RULER
does (the number appears in the greedy output) and by candidate log-likelihood
(``eval.tasks.retrieval``).
"""

from __future__ import annotations

import logging
import random
from functools import cached_property
from typing import Any

from pydantic import Field

from ropescale.runs.data import DataError

from .prompts import Prompt, build_prompt, cycle_units, random_key, sentence_units
from .retrieval import RetrievalOptions, RetrievalTask, contains_match

__all__ = ["HEADER", "NEEDLE", "QUESTION", "WORDS", "Needle", "NeedleOptions", "make_prompt"]

HEADER = ("A special magic number is hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the number afterwards.")  # RULER niah_single's first line
NEEDLE = "One of the special magic numbers for {word} is: {number}."
MIN_SENTENCES = 10  # distinct sentences a haystack needs: twice passkey's five filler lines
QUESTION = ("What is the special magic number for {word} mentioned in the provided text? "
            "The special magic number for {word} mentioned in the provided text is")
WORDS = ("apple", "river", "candle", "mountain", "garden", "silver", "window", "harbor", "lantern", "meadow",
         "copper", "violin", "forest", "island", "pepper", "mirror", "thunder", "feather", "saddle", "marble",
         "anchor", "basket", "cherry", "dragon", "engine", "falcon", "glacier", "helmet", "jacket", "kettle",
         "ladder", "magnet", "needle", "orange", "pillow", "quartz", "rocket", "spider", "tunnel", "walnut")


def make_prompt(tokenizer, units, *, length: int, depth: float, word: str, number: str,
                header: bool = True) -> Prompt:
    """A needle prompt of ``length`` tokens (answer included): ``HEADER`` (unless ``header`` is
    false), then the haystack ``units`` with the needle at ``depth``, then the question."""
    return build_prompt(tokenizer, units, length=length, depth=depth, needle=NEEDLE.format(word=word, number=number),
                        question=QUESTION.format(word=word), answer=number, head=HEADER if header else None)


class NeedleOptions(RetrievalOptions):
    """The needle task's options: the retrieval options (depths, trials, candidates …) and the magic number's digits."""

    digits: int = Field(7, ge=1, le=12, description="digits of the magic number (RULER: 7)")

    def key(self) -> dict[str, Any]:
        # prompts open with HEADER now: a folder of cells scored without it holds another experiment
        return super().key() | {"prompt": "ruler_header"}


class Needle(RetrievalTask):
    """Needle in a haystack of real text (RULER niah_single): a magic number for a word."""

    name = "needle"
    Options = NeedleOptions
    match = staticmethod(contains_match)
    uses_data = True

    @cached_property
    def units(self) -> list[list[int]]:
        """The haystack's sentences; ``DataError`` naming the source when it has fewer than
        ``MIN_SENTENCES`` distinct ones (a few lines repeated are passkey's filler, not a
        haystack of real text: the task would not measure what it says)."""
        units = sentence_units(self.tokenizer, [d.tolist() for d in self.documents])
        distinct = {tuple(u) for u in units}
        if len(distinct) < MIN_SENTENCES:
            sample = self.tokenizer.decode(max(distinct, key=len)).strip()
            raise DataError(f"{self.source or 'the data source'}: the needle haystack needs real text, but it has only "
                            f"{len(distinct)} distinct sentence{'s' * (len(distinct) != 1)} ({len(units)} in all, "
                            f"e.g. {sample[:60]!r}); a few lines repeated are passkey's filler (use task: passkey) — "
                            f"give a text with at least {MIN_SENTENCES} distinct sentences")
        self._distinct_tokens = sum(map(len, distinct))
        return units

    def examples(self, length: int) -> list:
        units = self.units
        if length > self._distinct_tokens and not getattr(self, "_warned_repeat", False):
            self._warned_repeat = True
            logging.getLogger("ropescale").warning(
                "%s: its %d distinct sentences hold %d tokens, so the needle haystack at %d tokens repeats "
                "the text (the needle is still the one odd line; a longer text makes a harder haystack)",
                self.source or "the data source", len({tuple(u) for u in units}), self._distinct_tokens, length)
        return super().examples(length)

    def make_prompt(self, length: int, depth: float, rng: random.Random) -> Prompt:
        """One needle prompt: a random key sentence at ``depth`` in the haystack, ``length`` tokens in all.

        Args:
            length: the prompt's length with its answer [tokens].
            depth: where the needle sits, 0 (start) to 1 (end).
            rng: the random source (the word and the key).

        Returns:
            The ``Prompt`` (ids and answer ids).
        """
        return make_prompt(self.tokenizer, cycle_units(self.units, rng.randrange(len(self.units))), length=length,
                           depth=depth, word=rng.choice(WORDS), number=random_key(rng, self.options.digits))

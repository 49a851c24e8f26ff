"""Passkey retrieval (Mohtashami & Jaggi 2023, arXiv:2305.16300), in the format of YaRN's and
LongLM's evaluations (jquesnelle/yarn ``eval/passkey.py``).

Filler sentences repeated to the target length L, the information line at a chosen depth, then
the question; the model should answer with the key. Scored by greedy generation (the first
integer generated equals the key, as YaRN scores it) and by candidate log-likelihood
(``eval.tasks.retrieval``).
"""

from __future__ import annotations

import random

from pydantic import Field

from .prompts import Prompt, build_prompt, cycle_units, encode, random_key
from .retrieval import RetrievalOptions, RetrievalTask, first_integer_match

__all__ = ["FILLER", "INFO", "PREAMBLE", "QUESTION", "Passkey", "PasskeyOptions", "filler_units", "make_prompt"]

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
INFO = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
            "I will quiz you about the important information there.")


def filler_units(tokenizer) -> list[list[int]]:
    """The five filler sentences, each as it reads after a space: ``[n_tokens]`` each."""
    return [encode(tokenizer, " " + s) for s in FILLER]


def make_prompt(tokenizer, units, *, length: int, depth: float, key: str, preamble: bool = False) -> Prompt:
    """A passkey prompt of ``length`` tokens (answer included) over the filler ``units``."""
    return build_prompt(tokenizer, units, length=length, depth=depth, needle=INFO.format(key=key),
                        question=QUESTION, answer=key, head=PREAMBLE if preamble else None)


class PasskeyOptions(RetrievalOptions):
    """The passkey task's options: the retrieval options (depths, trials, digits …) and the landmark-attention line."""

    preamble: bool = Field(False, description="start with the landmark-attention task line")


class Passkey(RetrievalTask):
    """Passkey retrieval: a key hidden at a depth of repeated filler, asked for at the end."""

    name = "passkey"
    Options = PasskeyOptions
    match = staticmethod(first_integer_match)

    def make_prompt(self, length: int, depth: float, rng: random.Random) -> Prompt:
        return make_prompt(self.tokenizer, cycle_units(filler_units(self.tokenizer)), length=length, depth=depth,
                           key=random_key(rng, self.options.digits), preamble=self.options.preamble)

"""RULER's needle-in-a-haystack generator (NVIDIA/RULER ``c3f5e3b4``, ``scripts/data/synthetic/niah.py``),
draw for draw: for a seed, tokenizer and haystack it writes the samples ``niah.py`` writes.

A run seeds its streams (``Draws``), probes haystack sizes (each probe draws a full example, as
RULER's does), then draws ``num_samples`` examples, each at the size found, shrinking by the size
step while one is too long. The eight niah tasks are settings of it (``scripts/synthetic.yaml``):
the haystack (``noise``: RULER's filler sentence repeated, one per line; ``essay``: a long text's
sentences, from nltk's Punkt; ``needle``: other needles, one per line), the kinds of keys and values
(7-digit ``numbers``, wonderwords adjective-noun ``words``, ``uuids``) and how many keys, values per
key and queried keys.

At the smallest size RULER draws until an example fits, and so does this port (same samples, draw
for draw); a length is refused (``PromptError``) only where no draw can fit: the text every draw
holds — the haystack, the template, the needles' words with their keys and values left out
(``_Blank``) — is already too long, or the needles cannot be placed in that haystack.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .spec import FAMILIES, RulerSample, binary_search, fitting, shrink_until_fits, split_answer_prefix
from .text import DEPTHS, NOISE, Draws, niah_words, sent_tokenize

__all__ = ["NEEDLE", "NiahConfig", "generate_niah"]

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
Kind = Literal["numbers", "words", "uuids"]


@dataclass(frozen=True)
class NiahConfig:
    """One niah task's settings (``scripts/synthetic.yaml``)."""

    type_haystack: Literal["noise", "essay", "needle"]
    type_needle_k: Kind
    type_needle_v: Kind
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


class _Niah:
    def __init__(self, cfg: NiahConfig, draws: Draws, template: str, seed: int, essay: list[str] | None):
        self.cfg, self.d, self.template, self.seed = cfg, draws, template, seed
        self.num_needle_k = max(cfg.num_needle_k, cfg.num_needle_q)
        self.essay = essay
        if cfg.type_haystack == "essay" and not essay:
            raise ValueError("the essay haystack needs a text")
        self.words = niah_words() if "words" in (cfg.type_needle_k, cfg.type_needle_v) else ()

    def random(self, kind: Kind) -> str:
        rng = self.d.py
        if kind == "numbers":
            return str(rng.randint(10 ** (7 - 1), 10**7 - 1))
        if kind == "words":
            return rng.choice(self.words)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def input_output(self, num_haystack: int) -> tuple[str, list[str]]:
        cfg, rng = self.cfg, self.d.py
        keys, values, needles = [], [], []
        for _ in range(self.num_needle_k):
            keys.append(self.random(cfg.type_needle_k))
            value = []
            for _ in range(cfg.num_needle_v):
                value.append(self.random(cfg.type_needle_v))
                needles.append(NEEDLE.format(type_needle_v=cfg.type_needle_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(self.seed).shuffle(needles)

        if cfg.type_haystack == "essay":
            hay = self.essay
            if num_haystack <= len(hay):
                text = " ".join(hay[:num_haystack])
            else:
                repeats = (num_haystack + len(hay) - 1) // len(hay)
                text = " ".join((hay * repeats)[:num_haystack])
            sents = sent_tokenize(text.strip())
            positions = [0] + sorted(int(len(sents) * (depth / 100)) for depth in rng.sample(DEPTHS, len(needles))) \
                + [len(sents)]
            parts = []
            for i in range(1, len(positions)):
                parts.append(" ".join(sents[positions[i - 1]:positions[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if cfg.type_haystack == "noise":
                sentences = [NOISE] * num_haystack
            else:
                sentences = [NEEDLE.format(type_needle_v=cfg.type_needle_v, key=self.random(cfg.type_needle_k),
                                           value=self.random(cfg.type_needle_v)) for _ in range(num_haystack)]
            indexes = sorted(rng.sample(range(num_haystack), len(needles)), reverse=True)
            for index, element in zip(indexes, needles):
                sentences.insert(index, element)
            context = "\n".join(sentences)

        indices = rng.sample(range(self.num_needle_k), cfg.num_needle_q)
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_needle_v = self.template, cfg.type_needle_v
        if cfg.num_needle_q * cfg.num_needle_v == 1:  # RULER makes the template singular, model template included
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            template = template.replace("answers", "answer")
            type_needle_v = type_needle_v[:-1]
        return template.format(type_needle_v=type_needle_v, context=context, query=query), answers


class _Blank(_Niah):
    """The text every draw at a size holds: keys and values (of the needles, the query and a needle
    haystack) left out, the rest as drawn (needle depths from the blank's own streams, so the
    real ones are not drawn from). Each left-out item is at least one token of a real draw."""

    def random(self, kind: Kind) -> str:
        return ""


def generate_niah(cfg: NiahConfig, *, count: Callable[[str], int], template: str, max_seq_length: int,
                  num_samples: int, seed: int, tokens_to_generate: int = 128, essay: list[str] | None = None,
                  what: str = "niah", max_draws: int | None = None) -> list[RulerSample]:
    """``niah.py``'s samples. ``count``: a text's token count (``len(tokenizer.tokenize(text))``);
    ``template``: the model template joined with the task's (``spec.join_template``);
    ``essay``: the essay haystack's words (``text.essay_words``). Raises ``PromptError``
    where nothing fits ``max_seq_length``."""
    gen = _Niah(cfg, Draws(seed), template, seed, essay)
    if cfg.type_haystack == "essay":
        incremental = 500
    else:
        incremental = 5 if max_seq_length < 4096 else 25

    sample_text, _ = gen.input_output(incremental)
    per_item = count(sample_text) / incremental
    estimated = int((max_seq_length / per_item) * 3)
    found = binary_search(lambda n: count(gen.input_output(n)[0]) + tokens_to_generate, incremental,
                          max(estimated, incremental * 2), max_seq_length)
    num_haystack = found if found is not None else incremental

    attempt = fitting(gen.input_output, count, tokens_to_generate, max_seq_length)

    blank = _Blank(cfg, Draws(seed), template, seed, essay)

    def floor(size: int) -> int:  # the fewest tokens any draw at this size has, with the budget
        return count(blank.input_output(size)[0]) + tokens_to_generate

    family = FAMILIES["niah"]
    out = []
    for _ in range(num_samples):
        text, answer, length = shrink_until_fits(attempt, num_haystack, incremental, what=f"{what} at {max_seq_length} "
                                                 "tokens", floor=floor, max_draws=max_draws)
        prompt, prefix = split_answer_prefix(family, text)
        at = prompt.find(answer[0])  # niah.py writes this character position as the sample's "index"
        out.append(RulerSample(at, prompt, tuple(answer), length, prefix, count(prompt[:at])))
    return out

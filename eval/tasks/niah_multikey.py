"""Multi-key needle in a haystack, RULER's ``niah_multikey_1`` (Hsieh et al. 2024, arXiv:2404.06654;
NVIDIA/RULER ``scripts/data/synthetic/niah.py`` with ``scripts/synthetic.yaml``'s ``niah_multikey_1``:
``type_haystack: essay``, ``num_needle_k: 4``, ``num_needle_v: 1``, ``num_needle_q: 1``).

``keys`` needles (RULER: 4) "One of the special magic numbers for {key} is: {value}." with distinct
keys and distinct ``digits``-digit values (RULER: 7) are hidden in real text; the question asks for
the value of one of them, so the others are distractors of the same form. The prompt is RULER's
``base`` template (``scripts/data/synthetic/constants.py`` ``TASKS['niah']``: template + answer
prefix, made singular as ``niah.py`` does when one value is asked for)::

    A special magic number is hidden within the following text. Make sure to memorize it. \
I will quiz you about the number afterwards.
    {context}
    What is the special magic number for {key} mentioned in the provided text? \
The special magic number for {key} mentioned in the provided text is

and the context is built as ``niah.py`` builds an essay haystack: the text with every run of
whitespace made one space, cut into sentences; needle ``i`` goes before sentence
``int(n_sentences × depth_i)``; the sentence runs and needles between those positions are joined
with one space — RULER's quirks kept: a needle at depth 0 follows the header line after a space, a
needle at depth 1 is followed by a space before the question's newline, and two needles at one
position are two spaces apart.

Where it differs from RULER, and why:

- the haystack is the harness's data source (held-out KJV books by default), decoded, from a seeded
  starting sentence per example (RULER always starts at the first word of Paul Graham's essays);
  sentences are cut after ``.``, ``!`` or ``?`` (optionally closed by a quote or bracket) followed
  by a space — RULER uses nltk's punkt, which is not a dependency here;
- the queried needle sits at the task's ``depth`` (the depth axis of tables and heatmaps); the
  distractors at distinct depths drawn from RULER's grid (``DEPTHS``: 40 rounded points of
  0–100%), where RULER draws every needle's depth from that grid;
- keys are the words of ``eval.tasks.needle.WORDS`` (those the bundled model was trained to
  retrieve), where RULER draws adjective-noun pairs from wonderwords;
- lengths are in tokens and count the prompt *and* the answer exactly (``eval.tasks.prompts``):
  the haystack's last sentence is cut at a token; RULER fills ``max_seq_length`` minus 128
  generated tokens by a search over the haystack's word count.

Metrics (``eval.tasks.retrieval``): **accuracy**, RULER's ``string_match_all``
(``scripts/eval/synthetic/constants.py``: per example the share of expected values found,
case-insensitively, in the prediction; with one value asked, 1 when the value appears in the greedy
output, else 0), averaged over examples as a fraction (RULER prints it ×100); greedy decoding runs
for the answer's token count + ``greedy_extra_tokens`` (RULER: 128 tokens), so a model that first
names a distractor's value is scored wrong here where RULER's longer output could still hold the
right one. **candidate_accuracy**: the answer scores strictly highest by log-likelihood among
``candidates`` values — the distractor needles' values first (the ones a model that confuses keys
picks), then random values with as many digits; chance = 1 / candidates.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from pydantic import Field, model_validator

from ropescale.runs.data import DataError

from .needle import HEADER, MIN_SENTENCES, NEEDLE, QUESTION, WORDS
from .prompts import Prompt, PromptError, continuation, cycle_units, distractor_keys, encode, random_key
from .retrieval import Example, RetrievalOptions, RetrievalTask, contains_match

__all__ = [
    "DEPTHS",
    "MultikeyPrompt",
    "NiahMultikey",
    "NiahMultikeyOptions",
    "assemble",
    "make_prompt",
    "sentence_pairs",
    "split_sentences",
]

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER niah.py: np.round(np.linspace(0, 100, 40)).astype(int), %
_SENTENCE_END = re.compile(r"(?<=[.!?])(?:[\"')\]]*) (?=\S)")


def split_sentences(text: str) -> list[str]:
    """``text`` with every run of whitespace made one space (as RULER reads its essays), cut
    into sentences after ``.``/``!``/``?`` (and any closing quotes or brackets) and a space."""
    text = re.sub(r"\s+", " ", text).strip()
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start:m.end() - 1])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def sentence_pairs(tokenizer, sentences: list[str]) -> list[tuple[str, list[int]]]:
    """Each sentence with its tokens as it reads after a space: ``(text, ids)``."""
    ids = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    return list(zip(sentences, ids))


@dataclass(frozen=True)
class MultikeyPrompt(Prompt):
    """A ``Prompt`` whose needle span is the queried needle's; ``others``: the distractor needles'
    values; ``haystack``: haystack tokens (as they read after a space) the prompt holds."""

    others: tuple[str, ...] = ()
    haystack: int = 0


def assemble(tokenizer, units: list[tuple[str, list[int]]], *, depths: list[float], keys: list[str],
             values: list[str], query: int) -> MultikeyPrompt:
    """RULER's prompt (without the answer) over exactly these haystack ``units`` (``(text, ids)``,
    ids as the unit reads after a space): needle ``i`` (``keys[i]``, ``values[i]``) before unit
    ``int(len(units) × depths[i])``, needles in order of depth (then index) — RULER's shuffled
    needles laid on its sorted depths — and the question asks for ``keys[query]``. Built piece by
    piece at spaces, the tokens are the whole text's for tokenizers that split at spaces before
    merging (byte-level BPE; checked on the bundled tokenizer)."""
    n = len(units)
    pos = [int(n * d) for d in depths]
    order = sorted(range(len(keys)), key=lambda i: (depths[i], i))  # positions ascending, as RULER's
    head = encode(tokenizer, HEADER + "\n")
    ids, start, end = list(head), 0, 0
    cuts = [0] + [pos[i] for i in order] + [n]
    for j in range(len(cuts) - 1):
        seg = units[cuts[j]:cuts[j + 1]]
        if j == 0 and seg:  # the context's first element: no space before it
            ids += encode(tokenizer, seg[0][0])
            seg = seg[1:]
        elif j > 0 and not seg:  # an empty run of sentences still brings its joining space
            ids += encode(tokenizer, " ")
        for _, u in seg:
            ids += u
        if j < len(order):
            i = order[j]
            if i == query:
                start = len(ids)
            ids += encode(tokenizer, " " + NEEDLE.format(word=keys[i], number=values[i]))
            if i == query:
                end = len(ids)
    question = "\n" + QUESTION.format(word=keys[query])
    q_ids, a_ids = continuation(tokenizer, question, values[query])
    return MultikeyPrompt(ids + q_ids, values[query], a_ids, start, end, depths[query], question,
                          others=tuple(v for i, v in enumerate(values) if i != query),
                          haystack=sum(len(u) for _, u in units))


def make_prompt(tokenizer, units: Iterator[tuple[str, list[int]]], *, length: int, depths: list[float],
                keys: list[str], values: list[str], query: int) -> MultikeyPrompt:
    """``assemble`` over the first tokens of ``units`` (which must not run out), as many as make
    the prompt + answer exactly ``length`` tokens; the last unit is cut at a token. Raises
    ``PromptError`` when ``length`` cannot hold the header, needles, question and answer."""
    if not (len(keys) == len(values) == len(depths)) or not 0 <= query < len(keys):
        raise ValueError("keys, values and depths must have one entry per needle, and query index one of them")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"depths must lie in [0, 1]; got {bad}")
    q_ids, a_ids = continuation(tokenizer, "\n" + QUESTION.format(word=keys[query]), values[query])
    fixed = len(encode(tokenizer, HEADER + "\n")) + len(q_ids) + len(a_ids) + sum(
        len(encode(tokenizer, " " + NEEDLE.format(word=k, number=v))) for k, v in zip(keys, values))
    budget = length - fixed
    if budget < 1:
        raise PromptError(f"length {length} is too short for this prompt: the header, {len(keys)} needles, "
                          f"question and answer alone take {fixed} tokens")
    pool: list[tuple[str, list[int]]] = []
    held = 0
    while held < budget + 2:
        pool.append(next(units))
        held += len(pool[-1][1])
    # separators and the first sentence's missing space move the total by a few tokens: try
    # haystack sizes around the budget, nearest first, smaller before larger
    span = 2 * len(keys) + 4
    for h in sorted(range(max(1, budget - span), budget + 3), key=lambda h: (abs(h - budget), h)):
        p = assemble(tokenizer, _first_tokens(tokenizer, pool, h), depths=depths, keys=keys, values=values, query=query)
        if p.length == length:
            return p
    if budget <= span:  # a haystack of a few tokens puts needles together, with RULER's spaces between them
        raise PromptError(f"length {length} is too short for this prompt: the header, {len(keys)} needles, question "
                          f"and answer take {fixed} tokens, and the {budget} left cannot hold a haystack with "
                          "the spaces between needles")
    raise PromptError(f"length {length}: no haystack size gives a prompt of exactly {length} tokens")


def _first_tokens(tokenizer, pool: list[tuple[str, list[int]]], h: int) -> list[tuple[str, list[int]]]:
    """The units holding the first ``h`` tokens, the last one cut (its text: what its tokens say)."""
    out, used = [], 0
    for text, ids in pool:
        if used >= h:
            break
        if used + len(ids) > h:
            ids = ids[: h - used]
            text = tokenizer.decode(ids).removeprefix(" ")
        out.append((text, ids))
        used += len(ids)
    return out


class NiahMultikeyOptions(RetrievalOptions):
    """niah_multikey_depths' options: the retrieval options, the keys and the depths."""

    digits: int = Field(7, ge=1, le=12, description="digits of each magic number (RULER: 7)")
    keys: int = Field(4, ge=2, le=len(WORDS), description="needles in the haystack, each with its own key and "
                                                           "value; one is asked for (RULER niah_multikey_1: 4)")

    @model_validator(mode="after")
    def _enough_values(self) -> NiahMultikeyOptions:
        if self.keys + self.candidates - 1 > 9 * 10 ** (self.digits - 1):
            raise ValueError(f"keys={self.keys} values and candidates={self.candidates} need more distinct "
                             f"{self.digits}-digit numbers than there are")
        return self

    def min_words(self) -> int:
        """Words of the header, the needles, the question and the answer: every tokenizer the
        harness loads splits at spaces, so a prompt takes at least this many tokens."""
        needle = NEEDLE.format(word=WORDS[0], number="0" * self.digits)
        return len(" ".join([HEADER, *[needle] * self.keys, QUESTION.format(word=WORDS[0]), "0" * self.digits]).split())

    def check_lengths(self, lengths: list[int]) -> None:
        words = self.min_words()
        if min(lengths) < words:
            raise ValueError(f"length {min(lengths)} cannot hold a niah_multikey prompt: its header, {self.keys} "
                             f"needles, question and answer are {words} words, at least one token each")


class NiahMultikey(RetrievalTask):
    """Multi-key needle in a haystack of real text (RULER niah_multikey_1): the value of one of
    several keys."""

    name = "niah_multikey_depths"  # "niah_multikey" is RULER's niah_multikey_1 (eval.tasks.ruler.niah)
    Options = NiahMultikeyOptions
    match = staticmethod(contains_match)
    uses_data = True

    @cached_property
    def units(self) -> list[tuple[str, list[int]]]:
        """The data source's sentences; repeated from the start when a prompt needs more, as RULER
        repeats its essays. ``DataError`` when it has no text, or — as ``needle`` — fewer than
        ``MIN_SENTENCES`` distinct sentences (a few lines tiled are passkey's filler, not a haystack
        of real text: the task would not measure what it says)."""
        source = getattr(self, "source", None) or "the data source"
        text = " ".join(self.tokenizer.decode(d.tolist()) for d in self.documents or [])
        sentences = split_sentences(text)
        if not sentences:
            raise DataError(f"{source}: no text for the niah_multikey haystack")
        distinct = set(sentences)
        if len(distinct) < MIN_SENTENCES:
            sample = max(distinct, key=len)
            raise DataError(f"{source}: the {self.name} haystack needs real text, but it has only {len(distinct)} "
                            f"distinct sentence{'s' * (len(distinct) != 1)} ({len(sentences)} in all, e.g. "
                            f"{sample[:60]!r}); a few lines repeated are passkey's filler (use task: passkey) — give "
                            f"a text with at least {MIN_SENTENCES} distinct sentences")
        return sentence_pairs(self.tokenizer, sentences)

    def make_prompt(self, length: int, depth: float, rng: random.Random) -> MultikeyPrompt:
        o = self.options
        keys = rng.sample(WORDS, o.keys)
        values: list[str] = []
        while len(values) < o.keys:
            v = random_key(rng, o.digits)
            if v not in values:
                values.append(v)
        depths = [depth] + [d / 100 for d in rng.sample(DEPTHS, o.keys - 1)]  # needle 0 is asked for
        return make_prompt(self.tokenizer, cycle_units(self.units, rng.randrange(len(self.units))), length=length,
                           depths=depths, keys=keys, values=values, query=0)

    def examples(self, length: int) -> list[Example]:
        """As ``RetrievalTask.examples``, with the distractor needles' values first among the
        candidates."""
        o = self.options
        out = []
        for di, depth in enumerate(o.depths):
            for trial in range(o.trials):
                rng = random.Random(f"{self.name}:{o.seed}:{length}:{depth}:{trial}")
                prompt = self.make_prompt(length, depth, rng)
                others = list(prompt.others[: o.candidates - 1])
                fill = [k for k in distractor_keys(rng, prompt.answer, o.candidates - 1 + len(prompt.others))
                        if k not in prompt.others][: o.candidates - 1 - len(others)]
                cands = [prompt.answer_ids] + [continuation(self.tokenizer, prompt.question, k)[1]
                                               for k in others + fill]
                out.append(Example(prompt, cands, di))
        return out

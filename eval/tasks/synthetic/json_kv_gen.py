"""HELMET's JSON key-value retrieval, generated (Yen et al. 2025, HELMET, arXiv:2410.02694; princeton-nlp/HELMET
``4526dfb``, MIT). Written from the format, not from a generator (HELMET ships its data pre-built):

- **Prompt** (``data.py::load_json_kv``, ``configs/recall.yaml``: no chat template): HELMET's
  ``user_template + "\\n" + system_template`` =
  ``"{context}\\n\\nExtract the value corresponding to the specified key in the JSON object below.\\n\\n{demos}Key:
  {question}\\nCorresponding value:"``; the demos are ``"Key: {key}\\nCorresponding value: {value}"`` (the first
  ``shots`` pairs, joined by a blank line, a blank line after; none and no blank line for 0 shots).
- **Context**: the JSON object as lost-in-the-middle renders it (nelson-liu/lost-in-the-middle,
  ``prompting.py::get_kv_retrieval_prompt``, which HELMET's ``load_json_kv`` names as its source):
  ``{"k1": "v1",\\n "k2": "v2",\\n … "kn": "vn"}`` — valid JSON, one pair a line. The question is the bare key.
- **Keys and values**: UUID-4 strings (lowercase 8-4-4-4-12 hex: ``uuid.UUID(int=getrandbits(128), version=4)``,
  as lost-in-the-middle's ``uuid4`` keys look), from the sample's own seeded ``random.Random``: the demos' pairs
  first, then the context's pairs (a key drawn again is redrawn: keys are distinct), then the gold pair's position,
  uniform.
- **Size**: the number of pairs fills L with the model's tokenizer (``base.fill``); or ``pairs`` fixed (HELMET's
  files: 50, 105, 220, 440, 900, 1800 pairs at 4k … 128k), the context then cut from its end where the prompt and
  the budget exceed L, as HELMET's ``model_utils.py::tokenize`` cuts it: at the start of the context's
  ``excess``-th token from the end (its offsets; a slow tokenizer: its tokens decoded; the context's tokens without
  special tokens, HELMET's with them: the same cut for a tokenizer that adds only a BOS), and cut again while a
  boundary merge still leaves it over (HELMET cuts once).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..prompts import PromptError
from ..ruler.spec import RulerSample
from .base import fill, sample_rng

__all__ = ["ANSWER_PREFIX", "INSTRUCTION", "KvDraft", "cut_from_end", "draw_kv", "generate_json_kv", "render_context",
           "render_input", "uuid_string"]

INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
ANSWER_PREFIX = "Corresponding value:"  # HELMET's system_template


def uuid_string(rng) -> str:
    """A UUID-4 string from 128 random bits of ``rng`` (``getrandbits(128)``, version and variant bits set)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def render_context(pairs: list[tuple[str, str]]) -> str:
    """The JSON object of ``pairs``, one pair a line as lost-in-the-middle writes it."""
    return "{" + ",\n ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"


def render_input(context: str, demos: list[tuple[str, str]], question: str) -> str:
    """HELMET's user template filled, with the newline before its system template: the prompt up to the answer
    prefix (``ANSWER_PREFIX``)."""
    shots = "\n\n".join(f"Key: {k}\n{ANSWER_PREFIX} {v}" for k, v in demos) + ("\n\n" if demos else "")
    return f"{context}\n\n{INSTRUCTION}\n\n{shots}Key: {question}\n"


@dataclass(frozen=True)
class KvDraft:
    """One drawn sample: ``pairs`` (the context's, in order), ``demos``, the gold pair's index ``gold`` and the
    context as the prompt holds it (``context``: rendered, or cut)."""

    pairs: list[tuple[str, str]]
    demos: list[tuple[str, str]]
    gold: int
    context: str

    @property
    def prompt(self) -> str:
        """What the model reads: the input and the answer prefix."""
        return render_input(self.context, self.demos, self.pairs[self.gold][0]) + ANSWER_PREFIX

    def sample(self, length: int) -> RulerSample:
        """As a cached sample: ``index`` = the gold pair's position among the context's pairs, ``outputs`` = its
        value, ``length`` = the prompt's tokens with the budget."""
        return RulerSample(self.gold, render_input(self.context, self.demos, self.pairs[self.gold][0]),
                           (self.pairs[self.gold][1],), length, ANSWER_PREFIX)


def draw_kv(seed: int, length: int, index: int, pairs: int, shots: int) -> KvDraft:
    """Sample ``index`` at ``length`` drawn with ``pairs`` context pairs and ``shots`` demos (its own stream:
    ``base.sample_rng("json_kv", seed, length, index)``)."""
    rng = sample_rng("json_kv", seed, length, index)
    demos = [(uuid_string(rng), uuid_string(rng)) for _ in range(shots)]
    used = {k for k, _ in demos}
    out = []
    for _ in range(pairs):
        key = uuid_string(rng)
        while key in used:
            key = uuid_string(rng)
        used.add(key)
        out.append((key, uuid_string(rng)))
    gold = rng.randrange(pairs)
    return KvDraft(out, demos, gold, render_context(out))


def cut_from_end(tokenizer, text: str, excess: int) -> str:
    """``text`` without its last ``excess`` tokens, as HELMET cuts a context: at the start offset of the
    ``excess``-th token from the end (a fast tokenizer), else the kept tokens decoded; "" when ``excess`` is all of
    them."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text[:offsets[-excess][0]] if excess < len(offsets) else ""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:-excess]) if excess < len(ids) else ""


def _cut(draft: KvDraft, total: Callable[[str], int], tokenizer, limit: int, what: str) -> tuple[KvDraft, int]:
    """``draft`` with its context cut from the end until its prompt and the budget fit ``limit``."""
    tokens = total(draft.prompt)
    empty = total(KvDraft(draft.pairs, draft.demos, draft.gold, "").prompt)
    if empty > limit:
        raise PromptError(f"{what}: no example fits: the prompt without its context ({len(draft.demos)} demos and the "
                          f"question) takes {empty} tokens with the generation budget, more than {limit}")
    while tokens > limit:
        context = cut_from_end(tokenizer, draft.context, tokens - limit)
        draft = KvDraft(draft.pairs, draft.demos, draft.gold, context)
        tokens = total(draft.prompt)
    return draft, tokens


def generate_json_kv(*, total: Callable[[str], int], tokenizer, length: int, num_samples: int, seed: int,
                     shots: int, pairs: int | None = None) -> list[RulerSample]:
    """The samples of a length.

    Args:
        total: a prompt's tokens as the model reads them, with the generation budget.
        tokenizer: the model's tokenizer (cuts a fixed-size context).
        length: L [tokens].
        num_samples: how many samples.
        seed: the run's seed.
        shots: demos per prompt (HELMET: 2).
        pairs: fixed context pairs per sample (cut to L); None: as many as fill L.

    Returns:
        The samples (``KvDraft.sample``).

    Raises:
        PromptError: no sample fits L, or ``pairs`` is more than L tokens.
    """
    what = f"json_kv at {length} tokens"
    if pairs is not None and pairs > length:  # each pair is several tokens: drawing and tokenizing them all only to cut
        raise PromptError(f"{what}: pairs={pairs} is more than {length} tokens can hold (a pair takes several); give "
                          f"at most {length}, or leave pairs out to fill L")
    if pairs is not None:
        out = [_cut(draw_kv(seed, length, i, pairs, shots), total, tokenizer, length, what) for i in range(num_samples)]
    else:
        out = fill(lambda i, n: draw_kv(seed, length, i, n, shots), lambda d: total(d.prompt),
                   num_samples=num_samples, limit=length, lower=1, what=what,
                   smallest=f"one pair, {shots} demo{'s' * (shots != 1)} and the question")
    return [d.sample(tokens) for d, tokens in out]

"""RULER's variable-tracking generator (NVIDIA/RULER ``c3f5e3b4``,
``scripts/data/synthetic/variable_tracking.py``), draw for draw.

Chains ``VAR A = 12345``, ``VAR B = VAR A``, … (``num_chains`` chains of ``num_hops`` hops, 5-letter
names) are scattered through a haystack; the question asks for every variable holding the first
chain's value. A run first makes one in-context example (at 500 tokens, 3-letter names, value
12345, no generation budget), then each sample: the example, with fresh names and value, goes
before the task template.
"""

from __future__ import annotations

import heapq
import string
from collections.abc import Callable
from typing import Literal

from .spec import FAMILIES, RulerSample, binary_search, fitting, shrink_until_fits, split_answer_prefix
from .text import DEPTHS, NOISE, Draws, sent_tokenize

__all__ = ["generate_vt"]


class _VT:
    def __init__(self, draws: Draws, template: str, num_chains: int, num_hops: int,
                 type_haystack: Literal["noise", "essay"], essay: list[str] | None):
        self.d, self.template, self.num_chains, self.num_hops = draws, template, num_chains, num_hops
        self.type_haystack, self.essay = type_haystack, essay
        family = FAMILIES["variable_tracking"]
        self.bare = family.template + family.answer_prefix

    def chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        rng = self.d.py
        k = 3 if is_icl else 5
        num_hops = min(10, self.num_hops) if is_icl else self.num_hops
        n = (num_hops + 1) * self.num_chains
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range(n)]
        while len(set(names)) < n:
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        out_vars, out_chains = [], []
        for i in range(0, len(names), num_hops + 1):
            these = names[i:i + num_hops + 1]
            out_vars.append(these)
            chain = [f"VAR {these[0]} = 12345" if is_icl
                     else f"VAR {these[0]} = {self.d.np.randint(10000, 99999)!s}"]
            for j in range(num_hops):
                chain.append(f"VAR {these[j + 1]} = VAR {these[j]} ")
            out_chains.append(chain)
        return out_vars, out_chains

    def shuffle_sublists_heap(self, lst: list[list[str]]) -> list[str]:
        rng, heap, out = self.d.py, [], []
        for i in range(len(lst)):
            heapq.heappush(heap, (rng.random(), i, 0))
        while heap:
            _, li, ei = heapq.heappop(heap)
            out.append(lst[li][ei])
            if ei + 1 < len(lst[li]):
                heapq.heappush(heap, (rng.random(), li, ei + 1))
        return out

    def input_output(self, num_noises: int, is_icl: bool) -> tuple[str, list[str]]:
        rng = self.d.py
        names, chains = self.chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        if self.type_haystack == "essay":
            sents = sent_tokenize(" ".join(self.essay[:num_noises]).strip())
            flat = self.shuffle_sublists_heap(chains)
            positions = [0] + sorted(int(len(sents) * (depth / 100)) for depth in rng.sample(DEPTHS, len(flat))) \
                + [len(sents)]
            parts = []
            for i in range(1, len(positions)):
                parts.append(" ".join(sents[positions[i - 1]:positions[i]]))
                if i - 1 < len(flat):
                    parts.append(flat[i - 1].strip() + ".")
            context = " ".join(parts)
        else:
            sentences = [NOISE] * num_noises
            for chain in chains:
                positions = sorted(rng.sample(range(len(sentences)), len(chain)))
                for insert_pi, j in zip(positions, range(len(chain))):
                    sentences.insert(insert_pi + j, chain[j])
            context = "\n".join(sentences)
        context = context.replace(". \n", ".\n")
        template = self.template
        if is_icl and template != self.bare:  # the in-context example leaves the model template out
            template = self.bare
        return template.format(context=context, query=value, num_v=self.num_hops + 1), names[0]

    def randomize_icl(self, example: str) -> str:
        for item in example.strip().split()[-self.num_hops - 1:]:
            new = "".join(self.d.py.choices(string.ascii_uppercase, k=len(item))).upper()
            example = example.replace(item, new)
        return example.replace("12345", str(self.d.np.randint(10000, 99999)))


class _Blank(_VT):
    """The text every draw at a size holds: variable names and values left out (``VAR  = VAR``
    kept), in the chains and in the in-context example's answer; chain positions from the blank's
    own streams, so the real ones are not drawn from. Each left-out item is at least one token of
    a real draw."""

    def chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        num_hops = min(10, self.num_hops) if is_icl else self.num_hops
        first = "VAR  = 12345" if is_icl else "VAR  = "
        names = [[""] * (num_hops + 1) for _ in range(self.num_chains)]
        return names, [[first] + ["VAR  = VAR  "] * num_hops for _ in range(self.num_chains)]

    def randomize_icl(self, example: str) -> str:
        for item in example.strip().split()[-self.num_hops - 1:]:
            example = example.replace(item, "")
        return example.replace("12345", "")


def _run(gen: _VT, blank: _VT, count: Callable[[str], int], *, num_samples: int, max_seq_length: int,
         max_seq_length_arg: int, icl_example: dict | None, tokens_to_generate: int, what: str,
         max_draws: int | None = None) -> list[dict]:
    """``sys_vartrack_w_noise_random`` (``add_fewshot`` left at its default, True); ``blank``: the
    same settings with nothing drawn (``_Blank``), for the fewest tokens a draw can have."""
    ttg = tokens_to_generate if icl_example is not None else 0
    if icl_example:
        incremental = 500 if gen.type_haystack == "essay" else 10
        if gen.type_haystack != "essay" and max_seq_length_arg < 4096:
            incremental = 5
    else:
        incremental = 50 if gen.type_haystack == "essay" else 5
    example_tokens = 0
    if icl_example is not None:
        icl_text = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n"
        example_tokens = count(icl_text)
    is_icl = icl_example is None

    sample_text, _ = gen.input_output(incremental, is_icl)
    per_item = count(sample_text) / incremental
    estimated = int((max_seq_length / per_item) * 3)
    found = binary_search(lambda n: count(gen.input_output(n, is_icl)[0]) + example_tokens + ttg, incremental,
                          max(estimated, incremental * 2), max_seq_length)
    num_noises = found if found is not None else incremental

    def text_of(g: _VT, size: int) -> tuple[str, list[str]]:
        text, answer = g.input_output(size, is_icl)
        if icl_example is not None:
            cutoff = text.index(FAMILIES["variable_tracking"].template[:20])
            text = text[:cutoff] + g.randomize_icl(icl_text) + "\n" + text[cutoff:]
        return text, answer

    attempt = fitting(lambda size: text_of(gen, size), count, ttg, max_seq_length)

    def floor(size: int) -> int:
        return count(text_of(blank, size)[0]) + ttg

    out = []
    for index in range(num_samples):
        text, answer, length = shrink_until_fits(attempt, num_noises, incremental, what=what, floor=floor,
                                                 max_draws=max_draws)
        out.append({"index": index, "input": text, "outputs": answer, "length": length})
    return out


def generate_vt(*, count: Callable[[str], int], template: str, max_seq_length: int, num_samples: int, seed: int,
                tokens_to_generate: int = 30, num_chains: int = 1, num_hops: int = 4,
                type_haystack: Literal["noise", "essay"] = "noise", essay: list[str] | None = None,
                what: str = "vt", max_draws: int | None = None) -> list[RulerSample]:
    """``variable_tracking.py``'s samples (see ``niah_gen.generate_niah`` for the arguments)."""
    if type_haystack == "essay" and not essay:
        raise ValueError("the essay haystack needs a text")
    gen = _VT(Draws(seed), template, num_chains, num_hops, type_haystack, essay)
    blank = _Blank(Draws(seed), template, num_chains, num_hops, type_haystack, essay)
    icl = _run(gen, blank, count, num_samples=1, max_seq_length=500, max_seq_length_arg=max_seq_length,
               icl_example=None, tokens_to_generate=tokens_to_generate,
               what=f"{what}: its in-context example at 500 tokens", max_draws=max_draws)[0]
    rows = _run(gen, blank, count, num_samples=num_samples, max_seq_length=max_seq_length,
                max_seq_length_arg=max_seq_length, icl_example=icl, tokens_to_generate=tokens_to_generate,
                what=f"{what} at {max_seq_length} tokens", max_draws=max_draws)
    family = FAMILIES["variable_tracking"]
    out = []
    for r in rows:
        prompt, prefix = split_answer_prefix(family, r["input"])
        out.append(RulerSample(r["index"], prompt, tuple(r["outputs"]), r["length"], prefix))
    return out

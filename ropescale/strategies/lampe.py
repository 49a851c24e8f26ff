"""LaMPE: length-aware multi-grained positional encoding — a three-region rule whose middle region
maps the prompt's positions onto a length that grows with the prompt.

Notation: N the prompt length the rule is built for (``prompt_length``) [tokens], U(N) the mapped length,
m(p) = ⌊p·U/(N − 1)⌋ the mapped position of position p, H = ``head``, r = ``tail``, i, j query and key
positions (j ≤ i).

    U(N) = c / (1 + e^−(a·N + b))  (the authors' logistic fit per model, truncated to an integer; their
    Llama-3 fit is a = 1.0493e-4, b = −2.46664, c = 6204.41 and U = 1536 below N = 8192)

Three distance regions, merged by log-sum-exp (``ropescale.attention.regions``):

- head, i − j < H: the true distance (the nearest H keys);
- middle, H ≤ i − j < N − R: queries at m(i) + β₁ and keys at m(j), β₁ = H − m(H) − 1;
- tail, i − j ≥ N − R: queries at i − β₂ and keys at j (unit spacing, offset), β₂ = (N − 1 − R) −
  m(N − 1 − R) − β₁, where R ≥ r is the last position of the run of equal m(·) holding r;

cos and sin × 0.1·ln 2 + 1 everywhere. A prompt shorter than 2H is plain RoPE with that factor.

Source: "LaMPE: Length-aware Multi-grained Positional Encoding for Adaptive Long-context Scaling Without
Training" (ACL 2026), arXiv:2508.02308; reference code github.com/scar-on/LaMPE ``llama_cache1.py``
(``forward``, ``map_ids``, ``find_chunk_last_index``, ``remap_uselen``) @ 4e3c91f (MIT). Their prefill
differs from the rule above in two ways, which ``prefill="authors"`` reproduces: its head window is
inclusive (flash-attn ``window_size=[H, 0]``) and its middle window ends at distance N − R inclusive, so in
a forward whose keys are its queries the keys at distance exactly H and exactly N − R enter the softmax
twice (once in each neighbouring region); and it computes m(p) in float32 (⌊fl(fl(U/(N − 1))·p)⌋), which
moves a few positions by one at long N (20 of 131,072 at U = 6204). Their decoding keeps the prompt's map
and slides the middle region's keys, so it is not their prefill's rule at the longer length; ropescale's
rule is one function of (i, j) for the given N, so cached decoding equals a full forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ropescale.errors import InvalidInput
from ropescale.strategies.registry import Param, register
from ropescale.strategies.relative import Region, RelativeRule

__all__ = ["LAMPE_FITS", "lampe", "lampe_bounds", "lampe_use_length"]

# remap_uselen @ 4e3c91f: (a, b, c, U below N = 8192 or None)
LAMPE_FITS: dict[str, tuple[float, float, float, int | None]] = {
    "llama3": (0.00010493097327094324, -2.466638011138158, 6204.409324666837, 1536),
    "llama3.1": (4.505261149632588e-05, -2.788576860718702, 82358.52413056031, None),
    "llama2": (8.673006440952035e-05, -0.648012322406978, 2489.1055552214357, 1536),
    "mistral": (0.00010493097327094324, -2.466638011138158, 24576.0, 1536),
}
SHORT = 8192  # remap_uselen: below this prompt length the fits give 1536 [tokens]


def lampe_use_length(n: int, fit: str, a: float | None = None, b: float | None = None, c: float | None = None) -> int:
    """U(N) [tokens]: ``int(c / (1 + e^−(a·N + b)))`` with the fit's a, b, c where not given, or the fit's short
    length below N = 8192 (``remap_uselen``)."""
    fa, fb, fc, short = LAMPE_FITS[fit]
    if short is not None and n < SHORT:
        return short
    a, b, c = fa if a is None else a, fb if b is None else b, fc if c is None else c
    return int(c / (1 + math.exp(-(a * n + b))))


def _mapping(use: int, n: int, authors: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """m(p) = ⌊p·U/(N − 1)⌋ for float positions ``[b, s]`` (exact, in float64), or ``authors``' float32
    ⌊fl(fl(U/(N − 1))·p)⌋ (``map_ids``)."""
    if authors:
        ratio = torch.tensor(float(use), dtype=torch.float32) / torch.tensor(float(n - 1), dtype=torch.float32)
        return lambda p: torch.floor(p.float() * ratio.to(p.device)).to(p.dtype)
    return lambda p: torch.div(p.double() * use, n - 1, rounding_mode="floor").to(p.dtype)


def lampe_bounds(n: int, use: int, head: int, tail: int, authors: bool = False) -> tuple[int, int, int]:
    """(β₁, β₂, N − R) for a prompt of N tokens mapped onto U: the middle region's query offset, the tail's,
    and the distance where the tail starts [tokens] (``forward``'s bias_1, bias_2 and kv_seq_len − re_size_2)."""
    m = _mapping(use, n, authors)
    ids = m(torch.arange(n, dtype=torch.float64)).long().tolist()
    run = min(tail, n - 1)  # find_chunk_last_index: the end of the run of equal m holding `tail`
    while run + 1 < n and ids[run] == ids[run + 1]:
        run += 1
    bias_1 = head - (ids[head] + 1)
    bias_2 = (n - 1 - run) - ids[n - 1 - run] - bias_1
    return bias_1, bias_2, n - run


@register("lampe", kind="attention", params=(
    Param("prompt_length", kind=int, low=2, high=2**24, auto="length", log=True,
          help="N: the prompt length the map is built for [tokens]; a sweep uses L"),
    Param("head", 512, kind=int, low=1, high=2**24, log=True,
          help="H: the nearest H keys keep true distances [tokens]"),
    Param("tail", 200, kind=int, low=1, high=2**24, log=True,
          help="r: the farthest ≈ r keys keep unit spacing [tokens] (extended to the end of m's run)"),
    Param("fit", "llama3", kind=str, choices=tuple(LAMPE_FITS),
          help="the authors' U(N) fit (remap_uselen) whose a, b, c apply where not given"),
    Param("a", None, low=1e-8, high=1e-2, log=True, help="a of U(N) = c / (1 + e^−(a·N + b)) [1/token]"),
    Param("b", None, low=-20.0, high=20.0, help="b of U(N)"),
    Param("c", None, low=1.0, high=2.0**24, log=True, help="c of U(N): the mapped length's ceiling [tokens]"),
    Param("use_length", None, kind=int, low=1, high=2**24, log=True,
          help="U given directly instead of U(N) [tokens] (their LongBench and InfiniteBench scripts)"),
    Param("attention_factor", None, low=0.5, high=2.0, help="cos/sin scale in every region; default 0.1·ln 2 + 1"),
    Param("prefill", "paper", kind=str, choices=("paper", "authors"),
          help="paper: each key once, m exact; authors: a prefill counts keys at distance H and N − R twice and "
               "maps in float32, as their forward does"),
), source="LaMPE: Length-aware Multi-grained Positional Encoding (ACL 2026), arXiv:2508.02308 "
          "(github.com/scar-on/LaMPE llama_cache1.py::forward and ::remap_uselen @ 4e3c91f)")
def lampe(prompt_length: int, head: int, tail: int, fit: str, a: float | None, b: float | None, c: float | None,
          use_length: int | None, attention_factor: float | None, prefill: str = "paper") -> RelativeRule:
    """LaMPE: p(i, j) = i − j below H; m(i) + β₁ − m(j) up to N − R; i − β₂ − j beyond (m(p) = ⌊p·U/(N − 1)⌋).

    U = ``use_length`` or U(N) from the fit (Llama-3's by default); cos and sin × ``attention_factor``
    (0.1·ln 2 + 1). A prompt of N < 2H tokens gets plain RoPE with that factor, as the authors' forward.
    ``prefill="authors"``: keys at distance H and N − R counted twice in a prefill, m in float32 (their
    ``forward``). Raises ``InvalidInput`` when the tail would start inside the head (N − R ≤ H).
    """
    length = prompt_length
    factor = 0.1 * math.log(2) + 1 if attention_factor is None else attention_factor
    if length < 2 * head:
        return RelativeRule((Region(0, None),), factor)
    use = lampe_use_length(length, fit, a, b, c) if use_length is None else use_length
    authors = prefill == "authors"
    bias_1, bias_2, start = lampe_bounds(length, use, head, tail, authors)
    if start <= head:
        raise InvalidInput(f"lampe: the tail starts at distance {start}, inside the head (head={head}) for "
                           f"prompt_length={length}, tail={tail} and U={use}: use a shorter tail or head")
    m = _mapping(use, length, authors)
    regions = (Region(0, head), Region(head, start, lambda i: m(i) + bias_1, m), Region(start, None,
                                                                                        lambda i: i - bias_2, None))
    if not authors:
        return RelativeRule(regions, factor)
    extra = (Region(head, head + 1), Region(start, start + 1, lambda i: m(i) + bias_1, m))
    return RelativeRule(regions, factor, prefill_extra=extra)

"""The request-length profiles' rule (``ropescale.serving.profiles`` writes the exports): which of a
set of static scale factors serves a request of a given length.

A profile of factor s reaches ⌊s · T⌋ tokens (T: the training window). A request of P prompt tokens
asking for at most N new tokens is served by the smallest s whose reach covers P + N; past the largest
reach, by the largest. Sweeps score a strategy with ``profiles`` this way
(``ropescale.runs.config.StrategySpec.resolve``).
"""

from __future__ import annotations

import math
from typing import Any

from ropescale.errors import InvalidInput

__all__ = ["RULE", "check_factors", "factor_text", "select_factor"]

RULE = ("the smallest factor s whose reach floor(s·T) covers prompt + max_new_tokens; past the largest reach, "
        "the largest profile")


def check_factors(factors: Any, where: str = "profiles") -> list[float]:
    """The factors sorted, as floats: a non-empty list of distinct finite numbers ≥ 1. ``InvalidInput``
    (one line) otherwise."""
    if not isinstance(factors, (list, tuple)) or not factors:
        raise InvalidInput(f"{where}: a non-empty list of scale factors (e.g. [1, 2, 4]), got {factors!r}")
    out = []
    for f in factors:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise InvalidInput(f"{where}: {f!r} is not a scale factor (a finite number >= 1)")
        out.append(float(f))
    if len(set(out)) != len(out):
        raise InvalidInput(f"{where}: {factors!r} names a factor twice")
    return sorted(out)


def factor_text(factor: float) -> str:
    """A scale factor written exactly: Python's shortest text that reads back as the same float
    (``repr``), a whole number without its ``.0`` (``1.0000001``, ``2``, ``1e+16``). Two distinct factors
    never share a text (``f"{f:g}"`` writes 1.0000001 and 1.0000002 both as ``1``)."""
    text = repr(float(factor))
    return text[:-2] if text.endswith(".0") else text


def select_factor(factors: list[float], train_length: int, tokens: int) -> float:
    """The rule: the smallest factor s with ⌊s · ``train_length``⌋ ≥ ``tokens`` (prompt + new tokens),
    else the largest."""
    for f in sorted(factors):
        if math.floor(f * train_length) >= tokens:
            return f
    return max(factors)

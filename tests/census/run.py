"""The census of the installed transformers, computed once per process.

``result(name)`` runs (and caches) every check of one causal-LM type; ``results()`` all of them,
in catalog order. Outcomes of types without RoPE: ``vanilla`` must be refused, every other check
is ``n/a``; a type that cannot be built gets ``build`` = ``not built: …`` and ``n/a`` elsewhere.
"""

from __future__ import annotations

import functools
import warnings

import torch

from tests.census.catalog import CausalLMType, causal_lm_types
from tests.census.checks import CHECKS, TypeResult, run_type

__all__ = ["ALL_CHECKS", "result", "results", "types"]

ALL_CHECKS = ("build", *CHECKS)


@functools.cache
def types() -> dict[str, CausalLMType]:
    return {t.name: t for t in causal_lm_types()}


@functools.cache
def result(name: str) -> TypeResult:
    """Type ``name``'s result, with an outcome for every check of ``ALL_CHECKS``."""
    from transformers.utils import logging

    verbosity, threads = logging.get_verbosity(), torch.get_num_threads()
    logging.set_verbosity_error()  # tiny configs trip warnings meant for real checkpoints
    torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other (CPU time × 4 on 2 cores)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_type(types()[name])
    finally:
        logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
    out = {"build": "exact" if res.build == "built" else res.build}
    for check in CHECKS:
        if res.build != "built":
            out[check] = "n/a: not built"
        elif not res.rope:
            out[check] = res.outcomes.get(check, f"n/a: no RoPE ({res.why})")
        else:
            out[check] = res.outcomes[check]
    res.outcomes = out
    return res


def results() -> list[TypeResult]:
    return [result(n) for n in types()]

"""Serving engines on the harness side: one package per engine, one registry of what each offers.

Each engine of the library (``ropescale.serving.engines``: its export and its rope re-implemented) has, where the
harness does more with it than export, one package here, ``eval/engines/<engine>/``:

- ``__init__.py``: its ``Environment`` when it runs in its own Python (``eval.engines.process``);
- ``parity.py``: its parity driver (``eval.engines.base.EngineDriver``: how ``ropescale parity`` gets the engine's
  own numbers);
- ``scoring.py``: its scoring engine (``eval.engines.scoring.ScoringEngine``: what answers a sweep's and a
  search's requests) and its config options;
- ``scripts/``: what runs in the engine's own Python (package data, never imported, never importing ropescale).

Their roles are registered by engine name in one registry (``eval.engines.registry.ROLES``); the harness —
sweep, search, parity, conformance — asks it by name and names no engine. Bundled: ``transformers`` (in this
process), ``vllm``, ``llama_cpp`` (``llama.cpp``), ``mlx``, ``sglang`` (re-implemented only: it does not run on
a CPU). A plugin adds its roles through the ``ropescale.engines`` entry points.
"""

from __future__ import annotations

from .process import (
    EngineAbsent,
    EngineFailed,
    Environment,
    engine_python,
    engine_status,
    environment,
    require_engine,
    run_engine,
)
from .registry import ROLES, EngineRoles, role_names, role_of

__all__ = ["ROLES", "EngineAbsent", "EngineFailed", "EngineRoles", "Environment", "driver_class", "engine_python",
           "engine_status", "environment", "require_engine", "role_names", "role_of", "run_engine"]


def driver_class(engine: str) -> type | None:
    """The parity driver class registered for ``engine`` (after discovering every engine), or None."""
    return role_of(engine, "driver")

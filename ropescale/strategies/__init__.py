"""Rotary strategies and their registry. Importing this package registers them all: every module
here (but ``registry``) is imported and registers its strategies with ``register`` — a new strategy
module edits nothing else — and installed plugins (entry-point group ``ropescale.strategies``) are
loaded on the first lookup (``strategy_names``, ``get_strategy``; ``ropescale.registry``)."""

from ropescale.strategies.registry import (
    BASELINE,
    REGISTRY,
    Param,
    RopeFrequencies,
    Strategy,
    UnknownStrategyError,
    get_strategy,
    register,
    strategy_names,
)

REGISTRY.import_package()  # the bundled strategies, registered on import as they always were

__all__ = ["BASELINE", "REGISTRY", "Param", "RopeFrequencies", "Strategy", "UnknownStrategyError",
           "get_strategy", "register", "strategy_names"]

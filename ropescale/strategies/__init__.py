"""Rotary strategies and their registry. Importing this package registers them all."""

from ropescale.strategies import by_parts, cope, frequency, truncation  # noqa: F401  (registers them)
from ropescale.strategies.registry import (
    REGISTRY,
    Param,
    RopeFrequencies,
    Strategy,
    UnknownStrategyError,
    get_strategy,
    register,
    strategy_names,
)

__all__ = ["REGISTRY", "Param", "RopeFrequencies", "Strategy", "UnknownStrategyError",
           "get_strategy", "register", "strategy_names"]

"""ropescale — swap the rotary position embedding of a Hugging Face causal LM and measure
how far past its training window it still models text."""

from ropescale._version import __version__
from ropescale.errors import RopescaleError, UnknownNameError
from ropescale.models import load_model, save_patched
from ropescale.patching import (
    NoRotaryEmbeddingError,
    PatchHandle,
    current_patch,
    find_rotary_modules,
    patch,
    unpatch,
)
from ropescale.serving import export_for
from ropescale.strategies import (
    REGISTRY,
    Param,
    RopeFrequencies,
    UnknownStrategyError,
    get_strategy,
    register,
    strategy_names,
)

__all__ = [
    "REGISTRY",
    "NoRotaryEmbeddingError",
    "Param",
    "PatchHandle",
    "RopeFrequencies",
    "RopescaleError",
    "UnknownNameError",
    "UnknownStrategyError",
    "__version__",
    "current_patch",
    "export_for",
    "find_rotary_modules",
    "get_strategy",
    "load_model",
    "patch",
    "register",
    "save_patched",
    "strategy_names",
    "unpatch",
]

"""Names that moved between the transformers releases ropescale supports (see ``pyproject.toml``).

transformers 5.24 renamed the KV-cache argument and output field ``past_key_values`` → ``cache``
(the old name is deprecated, removed in 5.40); a hook that reads only one name silently loses the
cache on the other releases. Everything in ropescale that reads or passes a cache goes through
these helpers, so it works on both sides of the rename — and on a user's remote-code model that
still takes the old name.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

__all__ = ["CACHE_KWARGS", "cache_from_kwargs", "cache_kwarg", "output_cache", "peft_wrapping"]

CACHE_KWARGS = ("cache", "past_key_values")  # new name first (transformers >= 5.24), then the old one


def cache_from_kwargs(kwargs: dict[str, Any]) -> Any:
    """The KV cache among a forward's keyword arguments, whichever name the caller used (None if none)."""
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def output_cache(output: Any) -> Any:
    """The KV cache a model's forward returned (``output.cache`` from 5.24, ``past_key_values`` before)."""
    for name in CACHE_KWARGS:
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None


def _release_name() -> str:
    """The cache keyword of the installed transformers' own models."""
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwarg(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache under: the one its signature names
    (``cache`` from transformers 5.24, ``past_key_values`` before; a user's remote-code model may keep
    the old one), else — a wrapper taking ``**kwargs`` — the installed transformers' name. Read once
    per call site, not per step."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        params = {}
    for name in CACHE_KWARGS:
        if name in params:
            return name
    return _release_name()


@contextlib.contextmanager
def peft_wrapping():
    """Around PEFT's wrapping of a model: PEFT (0.21) reads ``model.is_gradient_checkpointing``,
    which transformers >= 5.24 deprecates on every read (a FutureWarning naming a property
    ropescale's users never touched). Only that warning is silenced; ropescale itself calls
    ``activation_checkpointing_enable`` where the model has it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield

"""What ``ropescale conformance`` refuses before it writes anything (one line each).

A config's ``name`` names its two folders in the output folder (``models/<name>``, ``<name>``): it is a
plain file name (``NAME``), not one of the command's own entries there (``RESERVED``), and one config's
alone; every path the command writes is checked to resolve inside the output folder (``inside``),
symbolic links followed. Lengths are whole numbers of tokens, engines registered ones, and llama.cpp,
where installed, has the converter its rows need.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ropescale.errors import InvalidInput, OutputError, UnknownNameError

__all__ = ["MIN_LENGTH", "NAME", "RESERVED", "check_drivers_ready", "check_engines", "check_name", "check_tokens",
           "inside", "unique_names"]

NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")  # a config's name: one plain file-name component
RESERVED = ("models", "conformance.md", "conformance.csv", "conformance.json")  # the command's own entries in -o
MIN_LENGTH = 2  # the shortest served length a rotation is compared at [tokens] (as ``ropescale parity``)


def check_name(name: Any, where: str) -> str:
    """``name`` when it is a config name that can name a folder in the output folder; else
    ``InvalidInput`` (one line, starting with ``where``)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidInput(f"{where}: name {name!r} is not a plain file name (letters, digits, '.', '_', '-', at most "
                           "100, not '.' or '..'): a config's name names its folders in the output folder")
    if name.casefold() in RESERVED:
        raise InvalidInput(f"{where}: name {name!r} is taken by the command's own {name.casefold()!r} in the "
                           "output folder; give the config another name")
    return name


def check_tokens(value: Any, where: str, *, at_most: int | None = None) -> int:
    """``value`` when it is a whole number of tokens >= ``MIN_LENGTH`` (and <= ``at_most``); else
    ``InvalidInput`` (one line, starting with ``where``) — a bool or a string (``"4096"``) is not one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_LENGTH or \
            (at_most is not None and value > at_most):
        bound = f">= {MIN_LENGTH}" + ("" if at_most is None else f" and <= {at_most}")
        kind = "" if type(value) is int else " (a string)" if isinstance(value, str) else f" (a {type(value).__name__})"
        raise InvalidInput(f"{where}: {value!r}{kind} is not a whole number of tokens {bound}")
    return value


def check_engines(engines: list[str]) -> list[str]:
    """The registered engines' one names for ``engines``, once each; ``InvalidInput`` (one line)
    for an unknown engine or none."""
    from ropescale.serving.engines import engine_names, get_engine

    names, bad = [], []
    for e in engines:
        try:
            names.append(get_engine(e, stacklevel=5).name)  # the warning names run_conformance's caller
        except UnknownNameError:
            bad.append(e)
    if bad or not names:
        raise InvalidInput(f"--engines {','.join(map(str, bad)) or '(none)'}: choose from {', '.join(engine_names())}")
    return list(dict.fromkeys(names))


def check_drivers_ready(engines: list[str]) -> None:
    """``InvalidInput`` (one line) when an engine's parity driver lacks what it needs besides the engine's Python
    (``EngineDriver.not_ready``: llama.cpp installed without its converter, which its rows of a model without a
    GGUF need)."""
    from ..engines import driver_class

    for engine in engines:
        cls = driver_class(engine)
        why = cls.not_ready() if cls is not None else None
        if why:
            raise InvalidInput(f"--engines {engine}: {why}")


def unique_names(names: list[str], sources: list[str]) -> None:
    """``InvalidInput`` (one line) when two configs share a name (letter case aside: one folder on a
    case-insensitive disk); ``sources``: what named each (its ``--config``)."""
    seen: dict[str, str] = {}
    for name, source in zip(names, sources):
        if name.casefold() in seen:
            first = seen[name.casefold()]
            raise InvalidInput(f"--config {source}: the name {name!r} is already that of --config {first}: each "
                               "config writes the folders of its name; give each its own name")
        seen[name.casefold()] = source


def inside(output: Path, *parts: str) -> Path:
    """``output/parts…``, once it is known to resolve (symbolic links followed) to a path strictly
    inside ``output``; ``OutputError`` (one line) otherwise."""
    path = output.joinpath(*parts)
    try:
        root, real = output.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a loop of symbolic links
        raise OutputError(f"output {output}: cannot resolve {path}: {e}") from None
    if real == root or not real.is_relative_to(root):
        raise OutputError(f"output {output}: {Path(*parts)} leads out of it (to {real}); nothing is written outside "
                          "the output folder")
    return path

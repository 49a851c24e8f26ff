"""The one registry mechanism: named entries of one kind — strategies, evaluation tasks,
training recipes — each added by its own module, looked up by name with a one-line error.

A ``Registry`` is a dict (name → entry) that refuses a name given twice (``ValueError``: a
programming mistake, two modules claiming one name) and answers an unknown name with its
``error`` type, a close match and the known names. With ``package`` set, every module of that
package (but those starting with ``_`` and those in ``skip``) is imported on first lookup, so a
new entry is one module dropped in the folder: it registers itself on import.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """``kind`` names one entry ("strategy"), ``plural`` several ("strategies"); ``error`` is
    raised for an unknown name (a ``RopescaleError`` subclass, one line)."""

    def __init__(self, kind: str, plural: str, error: type[Exception], *, package: str | None = None,
                 skip: tuple[str, ...] = ()):
        super().__init__()
        self.kind, self.plural, self.error = kind, plural, error
        self.package, self.skip = package, skip
        self._discovered = package is None

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name``; ``ValueError`` when another entry holds the name."""
        if name in self and self[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = entry
        return entry

    def discover(self) -> None:
        """Import every module of ``package`` once (each registers its entries)."""
        if self._discovered:
            return
        self._discovered = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if not mod.name.startswith("_") and mod.name not in self.skip:
                importlib.import_module(f"{self.package}.{mod.name}")

    def names(self) -> list[str]:
        self.discover()
        return sorted(self)

    def lookup(self, name: str) -> T:
        """The entry ``name``; ``error`` (one line: a close match and the known names) otherwise."""
        self.discover()
        try:
            return self[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML)
            hint = difflib.get_close_matches(str(name), list(self), n=1)
            raise self.error(f"unknown {self.kind} {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             + f"; known {self.plural}: {', '.join(sorted(self))}") from None

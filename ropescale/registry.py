"""The one registry mechanism: named entries of one kind — strategies, evaluation tasks,
training recipes — each added by its own module, looked up by name with a one-line error.

A ``Registry`` is a dict (name → entry) that refuses a name given twice (``ValueError``: a
programming mistake, two modules claiming one name) and answers an unknown name with its
``error`` type (an ``UnknownNameError``), a close match and the known names. Entries are found
two ways, both on first lookup (``names``, ``lookup``; ``discover`` does it at once):

- with ``package`` set, every module of that package (but those starting with ``_`` and those in
  ``skip``) is imported, so a new entry is one module dropped in the folder: it registers itself
  on import;
- with ``plugins`` set (an entry-point group: ``ropescale.strategies``, ``ropescale.tasks``,
  ``ropescale.recipes``), every ``importlib.metadata`` entry point of that group is loaded, so an
  installed package adds entries without touching ropescale: importing its module registers them
  with the usual decorator or base class. A plugin that fails to load is skipped with one
  ``PluginWarning`` line naming the plugin and the error; ropescale goes on without it.

A plugin package declares, in its ``pyproject.toml``::

    [project.entry-points."ropescale.strategies"]
    my_strategies = "my_package.strategies"   # the module that registers them
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import pkgutil
import warnings
from typing import Generic, TypeVar

__all__ = ["PluginWarning", "Registry", "loading_plugin"]

T = TypeVar("T")


class PluginWarning(UserWarning):
    """An entry-point plugin could not be loaded (it is skipped)."""


class Registry(dict, Generic[T]):
    """Entries by name, discovered on first lookup (see the module docstring).

    Args:
        kind: how one entry is named ("strategy").
        plural: how several are named ("strategies").
        error: raised for an unknown name (an ``UnknownNameError`` subclass, one line).
        package: the package whose modules are imported on first lookup (None: none).
        skip: modules of ``package`` left out.
        plugins: the entry-point group loaded on first lookup (None: none).
    """

    def __init__(self, kind: str, plural: str, error: type[Exception], *, package: str | None = None,
                 skip: tuple[str, ...] = (), plugins: str | None = None) -> None:
        super().__init__()
        self.kind, self.plural, self.error = kind, plural, error
        self.package, self.skip, self.plugins = package, skip, plugins
        self._imported = package is None
        self._plugged = plugins is None

    def add(self, name: str, entry: T) -> T:
        """Register an entry.

        Args:
            name: its name.
            entry: the entry (a class, a ``Strategy``).

        Returns:
            ``entry``.

        Raises:
            ValueError: another entry holds the name.
        """
        if name in self and self[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = entry
        return entry

    def add_class(self, cls: T) -> None:
        """Register a class under the ``name`` its own body sets (what a base class's ``__init_subclass__``
        calls: subclassing registers); a class without its own ``name`` (an abstract base) is not registered.

        Args:
            cls: the class.

        Raises:
            ValueError: another entry holds the name.
        """
        name = cls.__dict__.get("name")
        if name:
            self.add(name, cls)

    def discover(self) -> None:
        """Import every module of ``package``, then load every plugin of the ``plugins`` group, once."""
        self.import_package()
        self.load_plugins()

    def import_package(self) -> None:
        """Import every module of ``package`` once, in its sub-packages too (a family of entries in a folder
        of its own: RULER's tasks in ``eval/tasks/ruler/``); each registers its entries. Names starting with
        ``_`` and those in ``skip`` are left out."""
        if self._imported:
            return
        self._imported = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.walk_packages(pkg.__path__, f"{self.package}."):
            parts = mod.name[len(self.package) + 1:].split(".")
            if not any(p.startswith("_") for p in parts) and parts[0] not in self.skip:
                importlib.import_module(mod.name)

    def load_plugins(self) -> None:
        """Load every entry point of the ``plugins`` group once (importing its module registers
        its entries). One that fails — an import error, a name already registered, any exception
        — is skipped with one ``PluginWarning`` line naming it and the error."""
        if self._plugged:
            return
        self._plugged = True
        for ep in importlib.metadata.entry_points(group=self.plugins):
            _load_entry_point(ep)

    def names(self) -> list[str]:
        """The registered names, bundled and plugins'.

        Returns:
            The names, sorted.
        """
        self.discover()
        return sorted(self)

    def lookup(self, name: str) -> T:
        """An entry by name.

        Args:
            name: its name.

        Returns:
            The entry.

        Raises:
            Exception: the registry's ``error`` for an unknown name (one line: a close match and the
                known names).
        """
        self.discover()
        try:
            return self[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML)
            hint = difflib.get_close_matches(str(name), list(self), n=1)
            raise self.error(f"unknown {self.kind} {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             + f"; known {self.plural}: {', '.join(sorted(self))}") from None


_LOADING: list[importlib.metadata.EntryPoint] = []  # the plugins being imported now, innermost last


def loading_plugin(module: str) -> str | None:
    """The plugin being imported now that ``module`` (an entry's ``__module__``) belongs to — the same
    top-level package as the plugin's module —, as messages name it (``plugin 'my_strategies'
    (my_package.strategies)``); None for any other module (ropescale's own, imported on the way)."""
    top = module.split(".")[0]
    ep = next((ep for ep in reversed(_LOADING) if ep.module.split(".")[0] == top), None)
    return None if ep is None else f"plugin {ep.name!r} ({ep.value})"


@functools.cache
def _load_entry_point(ep: importlib.metadata.EntryPoint) -> None:
    """Import one plugin entry point, once per process: two registries reading one group (the
    library's engines and the harness's engine drivers) import it once, and a broken one is one
    ``PluginWarning`` line, not one per registry."""
    _LOADING.append(ep)
    try:
        ep.load()
    except Exception as e:  # noqa: BLE001  (any failure of a plugin skips it, never stops ropescale)
        error = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        # warn_explicit with line 0 of a pseudo-file: the warning prints as one line, no source line
        warnings.warn_explicit(f"{ep.group} plugin {ep.name!r} ({ep.value}) not loaded: {error}",
                               PluginWarning, filename=f"<plugin {ep.name}>", lineno=0)
    finally:
        _LOADING.pop()

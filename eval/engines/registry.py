"""The harness's one registry of engines: by engine name, the roles the engine offers the harness.

An engine has one home on each side of the layers: its library module (``ropescale/serving/engines/<engine>.py``:
export, translation, its rope re-implemented; the library's registry ``ropescale.serving.engines.ENGINES``) and
its harness package (``eval/engines/<engine>/``), whose modules register its roles here by subclassing:

- ``driver``: its parity driver (``eval.engines.base.EngineDriver``): how ``ropescale parity`` and
  ``ropescale conformance`` get the engine's own numbers;
- ``scorer``: its scoring engine (``eval.engines.scoring.ScoringEngine``): what answers a sweep's and a search's
  requests, with its config section (``ScoringEngine.Options``);
- ``environment``: where its own Python lives and the scripts run in it (``eval.engines.process.Environment``),
  carried by its driver and scorer.

``ROLES`` (engine name → ``EngineRoles``) imports every module of this package on first lookup — a script run in
an engine's own Python lives in a ``scripts/`` folder, which is no package and is never imported, so nothing is
skipped by name — and every module of the ``ropescale.engines`` entry-point group (a plugin's engine: its library
module and, in the same group, the modules of its harness roles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ropescale.registry import Registry
from ropescale.serving.engines import UnknownEngineError

__all__ = ["ROLES", "ROLE_NAMES", "EngineRoles", "add_role", "environments", "remove_role", "role_names", "role_of"]

ROLE_NAMES = {"driver": "parity driver", "scorer": "scoring engine"}


@dataclass
class EngineRoles:
    """What one engine offers the harness: ``driver`` (its ``EngineDriver`` subclass, or None: compared through its
    library re-implementation), ``scorer`` (its ``ScoringEngine`` subclass, or None: it scores nothing) and
    ``environment`` (its ``Environment``, or None: it runs in this process or not at all)."""

    name: str
    driver: type | None = None
    scorer: type | None = None
    environment: Any = None


ROLES: Registry[EngineRoles] = Registry("engine", "engines", UnknownEngineError, package=__package__,
                                        plugins="ropescale.engines")


def add_role(cls: type, role: str) -> None:
    """Register ``cls`` as the ``role`` (``"driver"``, ``"scorer"``) of the engine its own ``name`` names, with the
    ``environment`` it carries; what a base class's ``__init_subclass__`` calls (a class without its own ``name``,
    an abstract base, is not registered). ``ValueError`` for a role, or an environment, given twice."""
    name = cls.__dict__.get("name")
    if not name:
        return
    roles = ROLES.get(name) or ROLES.add(name, EngineRoles(name))
    held = getattr(roles, role)
    if held is not None and held is not cls:
        raise ValueError(f"the {ROLE_NAMES[role]} of engine {name!r} is already registered ({held.__qualname__})")
    setattr(roles, role, cls)
    env = getattr(cls, "environment", None)
    if env is not None:
        if roles.environment is not None and roles.environment != env:
            raise ValueError(f"engine {name!r}: {cls.__qualname__} declares another environment than its other roles")
        roles.environment = env


def remove_role(name: str, role: str) -> None:
    """Take ``role`` of engine ``name`` out again (a test's engine, registered for one test); the entry goes with
    its last role."""
    roles = ROLES.get(name)
    if roles is None:
        return
    setattr(roles, role, None)
    if roles.driver is None and roles.scorer is None:
        ROLES.pop(name)


def role_of(name: str, role: str) -> type | None:
    """The ``role`` class of engine ``name`` (after discovering every engine), or None when it has none."""
    ROLES.discover()
    roles = ROLES.get(name)
    return None if roles is None else getattr(roles, role)


def role_names(role: str) -> list[str]:
    """The engines offering ``role`` (bundled and plugins), sorted."""
    return [name for name in ROLES.names() if getattr(ROLES[name], role) is not None]


def environments() -> dict[str, Any]:
    """Engine name → its ``Environment``, for every engine that runs in its own Python."""
    ROLES.discover()
    return {name: r.environment for name, r in ROLES.items() if r.environment is not None}

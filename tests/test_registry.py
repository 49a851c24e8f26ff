"""The one registry mechanism (strategies, tasks, recipes): ropescale.registry.Registry."""

from __future__ import annotations

import sys

import pytest

from ropescale.errors import RopescaleError
from ropescale.registry import Registry


class Unknown(RopescaleError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def test_add_lookup_and_errors():
    reg: Registry[int] = Registry("widget", "widgets", Unknown)
    one = object()
    reg.add("alpha", one)
    reg.add("alpha", one)  # the same entry again (a module imported twice): fine
    with pytest.raises(ValueError, match="^widget 'alpha' is already registered$"):
        reg.add("alpha", object())
    reg.add("beta", 2)
    assert reg.lookup("alpha") is one and reg.names() == ["alpha", "beta"]
    with pytest.raises(Unknown) as err:
        reg.lookup("alpah")
    assert str(err.value) == "unknown widget 'alpah' (did you mean 'alpha'?); known widgets: alpha, beta"
    with pytest.raises(Unknown) as err:
        reg.lookup(["alpha"])  # a list from YAML is not hashable
    assert str(err.value) == "unknown widget ['alpha'] (did you mean 'alpha'?); known widgets: alpha, beta"


def test_modules_of_the_package_register_themselves_on_first_lookup(tmp_path, monkeypatch):
    pkg = tmp_path / "widgets_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ropescale.registry import Registry\nREG = Registry('widget', 'widgets', "
                                     "KeyError, package=__name__, skip=('helpers',))\n", encoding="utf-8")
    (pkg / "gear.py").write_text("from widgets_pkg import REG\nREG.add('gear', 1)\n", encoding="utf-8")
    (pkg / "helpers.py").write_text("raise RuntimeError('skipped modules are not imported')\n", encoding="utf-8")
    (pkg / "_private.py").write_text("raise RuntimeError('nor are private ones')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import widgets_pkg

        assert dict(widgets_pkg.REG) == {}  # nothing imported yet
        assert widgets_pkg.REG.names() == ["gear"] and widgets_pkg.REG.lookup("gear") == 1
    finally:
        for name in [m for m in sys.modules if m.startswith("widgets_pkg")]:
            del sys.modules[name]


def test_strategies_tasks_and_recipes_share_it():
    from eval.tasks.base import TASKS
    from ropescale.strategies import REGISTRY
    from ropescale.training.recipes import RECIPES

    assert all(isinstance(r, Registry) for r in (REGISTRY, TASKS, RECIPES))
    assert {"perplexity", "passkey", "needle", "niah_multikey"} <= set(TASKS.names())
    assert {"full", "lora", "longlora"} <= set(RECIPES.names())

"""``pytest.approx`` over nested records: pytest >= 9.2 refuses ``approx`` of a dict holding lists (the
harness's records carry Wilson intervals as lists), so each number is wrapped on its own."""

from __future__ import annotations

import pytest


def nested_approx(expected, **tolerance):
    """``expected`` with every float replaced by ``pytest.approx(value, **tolerance)``, through dicts,
    lists and tuples; compare with ``==`` as with ``pytest.approx``."""
    if isinstance(expected, dict):
        return {k: nested_approx(v, **tolerance) for k, v in expected.items()}
    if isinstance(expected, (list, tuple)):
        return type(expected)(nested_approx(v, **tolerance) for v in expected)
    if isinstance(expected, float):
        return pytest.approx(expected, **tolerance)
    return expected

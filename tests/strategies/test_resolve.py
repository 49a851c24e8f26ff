"""Strategy.resolve: the one auto-fill rule, its human text, and validation without a length."""

from __future__ import annotations

import math

import pytest

from ropescale.errors import RopescaleError
from ropescale.runs.config import StrategySpec
from ropescale.strategies import REGISTRY, Param, get_strategy, register

AUTO_PARAMS = [(s.name, p) for s in REGISTRY.values() for p in s.params if p.auto]
# (L, T) pairs: below, at and above the window; an odd T (floor of T / 2)
LENGTHS = [(64, 128), (128, 128), (1000, 128), (4096, 129), (300, 7)]


GIVEN = {"longrope": {"short_factor": [1.0], "long_factor": [2.0]}}  # required, never filled


def _evaluate(text: str, L: int, T: int) -> float:
    """The listing's formula, evaluated as written (the oracle for what resolve fills)."""
    return eval(text, {"__builtins__": {}}, {"L": L, "T": T, "max": max, "floor": math.floor})


def test_every_auto_kind_is_used_somewhere():
    assert {p.auto for _, p in AUTO_PARAMS} == {"scale", "length", "half_train"}


@pytest.mark.parametrize("name,param", AUTO_PARAMS, ids=[f"{n}.{p.name}" for n, p in AUTO_PARAMS])
@pytest.mark.parametrize("L,T", LENGTHS)
def test_auto_text_is_what_resolve_fills(name, param, L, T):
    strat = get_strategy(name)
    resolved = strat.resolve(GIVEN.get(name, {}), length=L, train_length=T)
    assert resolved[param.name] == _evaluate(param.auto_text, L, T)


def test_known_values():
    # written out by hand: factor = L / T above the window, 1 below; window = T / 2; n_max = L
    assert get_strategy("yarn").resolve({}, length=1024, train_length=128)["factor"] == 8.0
    assert get_strategy("linear").resolve({}, length=100, train_length=128)["factor"] == 1.0
    assert get_strategy("rerope").resolve({}, length=4096, train_length=128)["window"] == 64
    assert get_strategy("self_extend").resolve({}, length=4096, train_length=129)["window"] == 64
    assert get_strategy("pi_over_2n").resolve({}, length=777, train_length=128)["n_max"] == 777.0


def test_truncation_window_is_half_the_training_window_not_the_length():
    # the listing printed "sweep: L" for the window; it is T / 2
    assert get_strategy("rerope").param("window").auto_text == "floor(T / 2)"
    assert get_strategy("yarn").param("factor").auto_text == "max(1, L / T)"
    assert get_strategy("pi_over_2n").param("n_max").auto_text == "L"
    assert get_strategy("yarn").param("beta_fast").auto_text is None


def test_given_values_win_over_auto_and_are_checked():
    assert get_strategy("yarn").resolve({"factor": 2.0}, length=4096, train_length=128)["factor"] == 2.0
    with pytest.raises(ValueError, match=r"factor=0\.5 is out of range"):
        get_strategy("yarn").resolve({"factor": 0.5}, length=4096, train_length=128)


@pytest.mark.parametrize("kw,message", [
    ({"length": 0, "train_length": 128}, "length=0 must be a whole number of tokens >= 2"),
    ({"length": 512, "train_length": 1.5}, "train_length=1.5 must be a whole number of tokens >= 2"),
    ({"length": True, "train_length": 128}, "length=True must be"),
])
def test_bad_lengths_are_one_line_user_errors(kw, message):
    with pytest.raises(RopescaleError, match=message) as e:
        get_strategy("yarn").resolve({}, **kw)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_plain_validation_requires_auto_params_and_says_how_they_are_filled():
    with pytest.raises(ValueError, match=r"factor is required \(a sweep sets it to max\(1, L / T\)"):
        get_strategy("linear").validate({})


def test_partial_validation_leaves_auto_params_to_the_length():
    out = get_strategy("yarn").validate({"beta_fast": 16}, partial=True)
    assert "factor" not in out and out["beta_fast"] == 16.0 and out["beta_slow"] == 1.0
    # everything else is still checked: ranges, unknown names, cross-parameter checks
    with pytest.raises(ValueError, match="out of range"):
        get_strategy("yarn").validate({"beta_fast": -1}, partial=True)
    with pytest.raises(ValueError, match="no parameter 'factr'"):
        get_strategy("yarn").validate({"factr": 2}, partial=True)
    with pytest.raises(ValueError, match="beta_fast=1.0 must be greater than beta_slow=2.0"):
        get_strategy("yarn").validate({"beta_fast": 1, "beta_slow": 2}, partial=True)
    # a required parameter that no length fills is still required
    with pytest.raises(ValueError, match="short_factor is required"):
        get_strategy("longrope").validate({"long_factor": [1.0]}, partial=True)


def test_strategy_spec_accepts_auto_params_left_out_and_checks_the_rest():
    assert StrategySpec(name="linear").params == {}
    with pytest.raises(ValueError, match="beta_fast"):
        StrategySpec(name="yarn", params={"beta_fast": 1, "beta_slow": 2})


def test_kind_and_auto_are_closed():
    with pytest.raises(TypeError, match="kind='frequncy'"):
        register("never_registered", kind="frequncy", source="-")
    with pytest.raises(TypeError, match="auto='scales'"):
        Param("factor", auto="scales")
    assert "never_registered" not in REGISTRY
    assert {s.kind for s in REGISTRY.values()} == {"frequency", "attention"}

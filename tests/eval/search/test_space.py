"""The search space derived from strategies' ``Param`` declarations: expectations written from
the strategies' documented ranges (README's strategy tables), not from the code's output."""

from __future__ import annotations

import math

import pytest

from eval.search.space import Dimension, _inside, search_space
from ropescale.runs.config import ConfigError
from ropescale.strategies import get_strategy
from ropescale.strategies.registry import Param


def test_log_scale_is_declared_where_the_natural_scale_is_a_ratio_or_a_length():
    yarn = get_strategy("yarn")
    assert yarn.param("factor").log and yarn.param("beta_fast").log and yarn.param("beta_slow").log
    assert not yarn.param("attention_factor").log  # a multiplier near 1: linear
    assert get_strategy("rerope").param("window").log
    assert get_strategy("self_extend").param("group_size").log


def test_yarn_ranges_are_the_users_within_the_params_with_declared_log_scale():
    dims = search_space("yarn", {"beta_fast": [2, 128], "beta_slow": [0.125, 8], "attention_factor": [0.8, 1.6]},
                        {"factor": 8})
    assert dims == [Dimension("beta_fast", "float", 2.0, 128.0, True),
                    Dimension("beta_slow", "float", 0.125, 8.0, True),
                    Dimension("attention_factor", "float", 0.8, 1.6, False)]


def test_an_open_bound_moves_just_inside():
    # beta_slow > 0 (open): with only an upper bound given, the low end is the smallest positive float
    (dim,) = search_space("yarn", {"beta_slow": {"high": 4}})
    assert dim.low == 5e-324 and dim.high == 4.0 and dim.log
    # whole numbers: the next one in
    p = Param("w", 5, kind=int, low=1, high=10, low_open=True, high_open=True)
    assert _inside(p) == (2, 9)
    q = Param("x", 1.0, low=0.0, high=1.0, high_open=True)
    assert _inside(q) == (0.0, math.nextafter(1.0, 0.0))


def test_integer_parameters_are_integer_dimensions():
    assert search_space("rerope", {"window": [8, 256]}) == [Dimension("window", "int", 8.0, 256.0, True)]
    assert search_space("self_extend", {"group_size": [2, 32], "window": [16, 64]}) == [
        Dimension("group_size", "int", 2.0, 32.0, True), Dimension("window", "int", 16.0, 64.0, True)]


def test_a_bounded_param_needs_no_user_range_and_the_user_may_override_log():
    # llama3's factor has low 1 and no high: the user gives the high only
    (dim,) = search_space("llama3", {"factor": {"high": 16}})
    assert dim == Dimension("factor", "float", 1.0, 16.0, True)
    (dim,) = search_space("yarn", {"attention_factor": {"low": 0.8, "high": 1.6, "log": True}})
    assert dim.log


@pytest.mark.parametrize(("strategy", "search", "fixed", "words"), [
    ("nonesuch", None, {}, "nonesuch"),                                   # unknown strategy
    ("vanilla", None, {}, "no numeric parameter"),                        # nothing to search
    ("rerope", None, {"window": 64}, "no numeric parameter"),             # everything fixed
    ("longrope", ["long_factor"], {}, "not searchable"),                  # a list parameter
    ("yarn", ["beta_fast"], {}, "no upper bound"),                        # unbounded, no range given
    ("yarn", {"beta_fast": [-1, 4]}, {}, "out of range"),                 # outside the Param's range
    ("yarn", {"beta_fast": [8, 4]}, {}, "empty range"),
    ("yarn", {"beta_fast": [4, 64]}, {"beta_fast": 32}, "either searched or fixed"),
    ("yarn", {"beta_fst": [4, 64]}, {}, "no parameter 'beta_fst'"),
    ("self_extend", {"window": [4, 100.5]}, {}, "whole number"),
    ("yarn", {"attention_factor": {"low": 0.8, "high": 2, "log": "yes"}}, {}, "true or false"),
    ("yarn", {"beta_fast": [4, 64, 5]}, {}, "[low, high]"),
])
def test_bad_spaces_are_one_line(strategy, search, fixed, words):
    with pytest.raises(ConfigError) as e:
        search_space(strategy, search, fixed)
    assert words in str(e.value) and "\n" not in str(e.value)

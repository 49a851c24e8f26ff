import numpy as np
import pytest

from ropescale.errors import InvalidInput
from ropescale.strategies import REGISTRY, UnknownStrategyError, get_strategy, register
from ropescale.strategies.registry import Param, RopeFrequencies


def test_unknown_strategy_lists_known_and_close_match():
    with pytest.raises(UnknownStrategyError) as err:
        get_strategy("yran")
    msg = str(err.value)
    assert "did you mean 'yarn'" in msg
    for name in ("vanilla", "linear", "ntk", "dynamic_ntk", "yarn"):
        assert name in msg


@pytest.mark.parametrize("params,match", [
    ({"factor": 0.5}, r"factor=0.5 is out of range; allowed: >= 1"),
    ({"factor": "big"}, r"factor='big' must be a number"),
    ({"factor": float("inf")}, r"factor=inf must be a finite number; allowed: >= 1"),
    ({"factor": 2, "beta_fast": 0}, r"beta_fast=0 is out of range; allowed: > 0"),
    ({"factor": 2, "beta_fast": 1, "beta_slow": 2}, r"beta_fast=1.0 must be greater than beta_slow=2.0"),
    ({"factor": 2, "betafast": 3}, r"no parameter 'betafast'.*did you mean 'beta_fast'"),
    ({"factor": True}, r"must be a number"),
])
def test_bad_parameters_name_parameter_value_and_range(params, match):
    with pytest.raises(ValueError, match=match):
        get_strategy("yarn").validate(params)


def test_every_strategy_documents_formula_source_and_params():
    for s in REGISTRY.values():
        assert s.summary and s.source
        assert all(p.help for p in s.params), s.name


def test_register_rejects_signature_param_mismatch():
    with pytest.raises(TypeError, match="declared"):
        @register("broken_test_only", params=(Param("alpha", 1.0),), source="test")
        def broken(dim, rope_theta, beta):
            return RopeFrequencies(None, 1.0)
    assert "broken_test_only" not in REGISTRY


def test_dynamic_flag_follows_signature():
    assert get_strategy("dynamic_ntk").dynamic
    assert not get_strategy("yarn").dynamic


# --- hostile numbers: inf, nan, numpy scalars, booleans, integral floats -----------------------

def _numeric_params():
    return [(s.name, p) for s in REGISTRY.values() for p in s.params if p.kind in (int, float)]


def _in_range(p):
    """A value inside the parameter's range, exact in float32 (so a numpy float32 holds it)."""
    low = 0.0 if p.low is None else p.low
    return int(low) + 2 if p.kind is int else low + 1.5


@pytest.mark.parametrize("name,param", _numeric_params(), ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), np.float32("nan"), np.float64("inf")],
                         ids=["inf", "-inf", "nan", "np.float32-nan", "np.float64-inf"])
def test_inf_and_nan_are_one_line_naming_parameter_and_range(name, param, bad):
    """Every numeric parameter of every strategy: one InvalidInput line with the strategy, the
    parameter and its allowed range (on main an int parameter raised OverflowError for inf and a
    bare "cannot convert float NaN to integer" for NaN)."""
    with pytest.raises(InvalidInput) as e:
        param.check(name, bad)
    msg = str(e.value)
    whole = "whole " if param.kind is int else ""
    assert msg == (f"{name}: parameter {param.name}={float(bad)!r} must be a finite {whole}number; "
                   f"allowed: {param.range_text()}")


@pytest.mark.parametrize("name,param", _numeric_params(), ids=lambda x: getattr(x, "name", x))
def test_numpy_numbers_are_numbers_and_come_back_as_python_ones(name, param):
    value = _in_range(param)
    want = param.check(name, value)
    for np_value in (np.int64(value), np.int32(value)) if param.kind is int else (np.float32(value), np.float64(value)):
        got = param.check(name, np_value)
        assert got == want and type(got) is param.kind  # plain Python: JSON-serialisable records
    if param.kind is float:  # an integer where a float is expected
        assert param.check(name, np.int64(int(value) + 1)) == float(int(value) + 1)


@pytest.mark.parametrize("name,param", _numeric_params(), ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("flag", [True, False, np.bool_(True)], ids=["True", "False", "np.bool_"])
def test_booleans_are_not_numbers(name, param, flag):
    with pytest.raises(InvalidInput, match=rf"^{name}: parameter {param.name}={bool(flag)!r} must be a "
                                           rf"(whole )?number \((int|float)\); allowed: "):
        param.check(name, flag)


def test_whole_number_parameters_take_integral_floats_and_refuse_fractions():
    """16.0 is 16 (YAML, JSON and float-valued searches write whole numbers so); 16.5 is not a
    whole number; a float beyond 2^53 is no exact integer."""
    dca = get_strategy("dca")
    for v in (16.0, np.float64(16.0), np.float32(16.0)):
        got = dca.validate({"chunk_size": v})["chunk_size"]
        assert got == 16 and type(got) is int
    with pytest.raises(InvalidInput, match=r"^dca: parameter chunk_size=16.5 must be a whole number; allowed: >= 2$"):
        dca.validate({"chunk_size": 16.5})
    with pytest.raises(InvalidInput, match=r"chunk_size=1e\+300 is too large: whole numbers must be at most 2\^53"):
        dca.validate({"chunk_size": 1e300})
    with pytest.raises(InvalidInput, match=r"^yarn: parameter factor=1000000000000000000000000000000000000\.\.\. "
                                           r"must be a finite number; allowed: >= 1$"):
        get_strategy("yarn").validate({"factor": 10**400})  # beyond a float: one short line


def test_bool_parameters_take_numpy_booleans_and_refuse_numbers():
    assert get_strategy("dca").validate({"vllm_temperature": np.bool_(True)})["vllm_temperature"] is True
    with pytest.raises(InvalidInput, match="vllm_temperature=1 must be true or false"):
        get_strategy("dca").validate({"vllm_temperature": 1})


def test_lengths_take_numpy_integers():
    got = get_strategy("yarn").resolve({}, length=np.int64(512), train_length=np.int32(128))
    assert got["factor"] == 4.0 and type(got["factor"]) is float


def test_factor_lists_take_numpy_arrays_and_refuse_non_finite_entries():
    got = get_strategy("longrope").validate({"short_factor": np.array([1.0, 2.5], dtype=np.float32),
                                             "long_factor": [np.int64(3)], "factor": 2})
    assert got["short_factor"] == [1.0, 2.5] and got["long_factor"] == [3.0]
    assert all(type(x) is float for x in got["short_factor"] + got["long_factor"])
    with pytest.raises(InvalidInput, match=r"^longrope: parameter long_factor=nan must be a finite number; "
                                           r"allowed: > 0$"):
        get_strategy("longrope").validate({"short_factor": [1.0], "long_factor": [1.0, float("nan")], "factor": 2})

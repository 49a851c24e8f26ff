import pytest

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
    ({"factor": float("inf")}, r"must be finite"),
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

import numpy as np
import pytest
import torch

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


def test_how_a_dynamic_strategy_is_served_is_declared_at_register():
    """Engines serve one static rotation: dynamic NTK can be frozen at a length, LongRoPE's two static sets are
    picked by the served length, other dynamic rules have no static form; the serving code reads this, never
    a strategy's name. An unknown value is refused when registering."""
    served = {s.name: s.served for s in REGISTRY.values() if s.dynamic}
    assert served.pop("dynamic_ntk") == "freeze" and served.pop("longrope") == "sets"
    assert served and set(served.values()) == {None}
    assert {s.served for s in REGISTRY.values() if not s.dynamic} == {None}
    with pytest.raises(TypeError, match=r"served='later'; choose one of freeze, sets or None"):
        @register("served_test_only", source="test", served="later")
        def bad(dim, rope_theta):
            return RopeFrequencies(None, 1.0)
    assert "served_test_only" not in REGISTRY


def test_a_freezable_strategy_declares_its_static_form_as_a_hook():
    """``served="freeze"`` needs the strategy's own ``freeze`` hook (the serving code holds no formula), and a
    hook without it is refused: both when registering."""
    with pytest.raises(TypeError, match=r"and a freeze hook go together \(served='freeze', freeze=None"):
        register("freeze_test_only", source="test", served="freeze")(lambda dim, rope_theta, seq_len: None)
    with pytest.raises(TypeError, match=r"served=None, freeze=given"):
        register("freeze_test_only", source="test", freeze=lambda p, at, t: ("vanilla", {}))(lambda dim: None)
    assert "freeze_test_only" not in REGISTRY
    with pytest.raises(InvalidInput, match=r"strategy 'ntk' has no static form to freeze at a length"):
        get_strategy("ntk").frozen({"factor": 2.0}, at=128, train_length=64)


@pytest.mark.parametrize(("factor", "at"), [(1.0, 64), (2.0, 64), (1.0, 256), (2.0, 256), (3.0, 1000)])
def test_dynamic_ntk_frozen_at_a_length_rotates_as_it_does_there(factor, at):
    """The hook's static strategy, computed, equals dynamic NTK computed at seq_len = F (T = 64): the two
    functions meet only in the frozen parameters."""
    dynamic = get_strategy("dynamic_ntk")
    static, params = dynamic.frozen({"factor": factor}, at=at, train_length=64)
    assert static.name == ("vanilla" if at <= 64 else "ntk")
    ctx = {"dim": 16, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
    want = dynamic.compute({**ctx, "seq_len": at}, {"factor": factor}).inv_freq
    torch.testing.assert_close(static.compute(ctx, params).inv_freq, want, rtol=1e-6, atol=0)


# --- hostile numbers: inf, nan, numpy scalars, booleans, integral floats -----------------------

def _numeric_params():
    return [(s.name, p) for s in REGISTRY.values() for p in s.params if p.kind in (int, float)]


def _in_range(p):
    """A value inside the parameter's range, exact in float32 (so a numpy float32 holds it)."""
    low = 0.0 if p.low is None else p.low
    value = int(low) + 2 if p.kind is int else low + 1.5
    if p.kind is float and p.high is not None and value > p.high:  # a narrow range (LaMPE's a: [1e-8, 1e-2])
        value = float(np.float32((low + p.high) / 2))
    return value


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
    if param.kind is float and (param.high is None or int(value) + 1 <= param.high):  # an integer for a float
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


# --- what a strategy returns, checked where it enters the patch ---------------------------------

def _plain_inv_freq(dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim).float()  # [d/2]


def _registered(name, fn, **kw):
    """``fn`` registered under ``name`` for one test (removed by the caller's ``finally``)."""
    register(name, source="test", **kw)(fn)
    return get_strategy(name)


CTX = {"dim": 16, "rope_theta": 10000.0, "original_max_position_embeddings": 64, "seq_len": 64}


@pytest.mark.parametrize(("result", "message"), [
    (lambda d: RopeFrequencies(_plain_inv_freq(d) * float("nan"), 1.0), r"returned inv_freq\[0\] = nan; frequencies "
                                                                         r"are finite and >= 0 \[radians per token\]"),
    (lambda d: RopeFrequencies(-_plain_inv_freq(d), 1.0), r"returned inv_freq\[0\] = -1.0; frequencies are finite"),
    (lambda d: RopeFrequencies(_plain_inv_freq(d), float("nan")), r"returned attention_factor = nan; expected a finite "
                                                                  r"number > 0 \(it multiplies cos and sin\)"),
    (lambda d: RopeFrequencies(_plain_inv_freq(d), 0.0), r"returned attention_factor = 0.0; expected a finite"),
    (lambda d: RopeFrequencies(_plain_inv_freq(d), "1"), r"returned attention_factor = '1'; expected a finite"),
    (lambda d: RopeFrequencies(_plain_inv_freq(2 * d), 1.0), r"returned inv_freq of shape \[16\]; expected \[8\] "
                                                              r"\(d/2 for rotary dim d = 16\)"),
    (lambda d: RopeFrequencies(_plain_inv_freq(d).tolist(), 1.0),
     r"returned inv_freq as a list; a frequency strategy returns a torch tensor of shape \[8\]"),
    (lambda d: RopeFrequencies(torch.ones(d // 2, dtype=torch.long), 1.0),
     r"returned inv_freq of dtype torch.int64; expected a floating dtype"),
    (_plain_inv_freq, r"returned Tensor, not RopeFrequencies\(inv_freq, attention_factor\)"),
], ids=["nan_inv_freq", "negative", "nan_factor", "zero_factor", "str_factor", "shape_d", "list", "int", "bare"])
def test_a_strategys_output_is_checked(result, message):
    """NaN frequencies or factor were accepted (the sweep recorded PPL nan), inv_freq of shape [d]
    failed with a RuntimeError deep inside attention, a list with an AttributeError: ``compute``,
    through which every use gets a strategy's frequencies, refuses them in one line naming the
    strategy and where it was registered."""
    try:
        strat = _registered("bad_output_test_only", lambda dim: result(dim))  # noqa: PLW0108 (names the context)
        with pytest.raises(InvalidInput, match=r"^strategy 'bad_output_test_only' \(module tests\.strategies\."
                                               r"test_registry\) " + message):
            strat.compute(CTX, {})
    finally:
        REGISTRY.pop("bad_output_test_only", None)


def test_a_bad_output_is_refused_at_patch_time_and_leaves_the_model_as_it_was(tiny_llama):
    import ropescale

    x = torch.arange(8)[None]
    want = tiny_llama(x).logits
    try:
        _registered("long_inv_freq_test_only", lambda dim: RopeFrequencies(_plain_inv_freq(2 * dim), 1.0))
        with pytest.raises(InvalidInput, match=r"long_inv_freq_test_only.* returned inv_freq of shape \[16\]; "
                                               r"expected \[8\]"):  # head_dim 16: a RuntimeError in attention before
            ropescale.patch(tiny_llama, "long_inv_freq_test_only")
        assert torch.equal(tiny_llama(x).logits, want)
        # a dynamic rule that goes wrong only past T is refused when it does
        _registered("late_nan_test_only", lambda dim, seq_len: RopeFrequencies(
            _plain_inv_freq(dim) * (float("nan") if seq_len > 64 else 1.0), 1.0))
        with (ropescale.patch(tiny_llama, "late_nan_test_only", original_max_position_embeddings=64),  # fine at T
              pytest.raises(InvalidInput, match=r"late_nan_test_only.* returned inv_freq\[0\] = nan")):
            tiny_llama(torch.arange(80)[None] % 200)
    finally:
        REGISTRY.pop("long_inv_freq_test_only", None)
        REGISTRY.pop("late_nan_test_only", None)


def test_builtin_strategies_pass_the_output_check():
    ctx = {"dim": 64, "rope_theta": 10000.0, "original_max_position_embeddings": 128, "seq_len": 512,
           "model_inv_freq": _plain_inv_freq(64), "model_attention_scaling": 1.0}
    for s in REGISTRY.values():
        if s.kind == "frequency" and not s.origin and s.name not in ("longrope", "base_truncation"):
            inv_freq, factor = s.compute(ctx, s.resolve({}, length=512, train_length=128))
            assert inv_freq.shape == (32,) and type(factor) is float, s.name


@pytest.mark.parametrize(("param", "shown"), [
    (Param("p", 0.5, low=1.0), r"p=0.5 is out of range; allowed: >= 1"),
    (Param("p", 2.5, kind=int, low=1), r"p=2.5 must be a whole number"),
    (Param("p", float("nan")), r"p=nan must be a finite number"),
])
def test_a_param_default_outside_its_own_range_is_refused_at_register(param, shown):
    """Such a default was used whenever the parameter was left out, without a word."""
    with pytest.raises(TypeError, match=rf"^default_test_only: parameter {shown}.* \(its default\)$"):
        _registered("default_test_only", lambda dim, p: RopeFrequencies(_plain_inv_freq(dim), 1.0), params=(param,))
    assert "default_test_only" not in REGISTRY


def test_a_parameter_named_as_a_patch_option_is_refused_at_register():
    # patch() splits its keywords by name: block_size=8 went to the patch ("does not use block_size=8"), never to
    # the strategy whose parameter it was
    with pytest.raises(TypeError, match=r"^reserved_test_only: parameter 'block_size' is the name of a patch option"):
        _registered("reserved_test_only", lambda dim, block_size: RopeFrequencies(_plain_inv_freq(dim), 1.0),
                    params=(Param("block_size", 4, kind=int, low=1),))
    assert "reserved_test_only" not in REGISTRY


def test_the_reserved_names_cover_every_patch_option():
    from dataclasses import fields

    from ropescale.patching.options import PatchOptions
    from ropescale.strategies.registry import RESERVED_PARAMS

    assert {f.name for f in fields(PatchOptions)} <= set(RESERVED_PARAMS)

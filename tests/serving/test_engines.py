"""ropescale.serving.engines: the registry of serving engines. A stub engine registered in a test (one
class, no driver) is what export_for, check_export and run_parity use, with no edit anywhere else;
the bundled engines are discovered by module; old names resolve with one warning."""

import json
import warnings

import pytest
import torch

import ropescale
from eval.parity import run_parity
from ropescale.errors import InvalidInput
from ropescale.runs.config import parse_strategy
from ropescale.serving import ENGINES, Engine, ExportRefused, engine_names, export_for, get_engine
from ropescale.serving.output import staged
from ropescale.serving.plan import served_rope_parameters
from ropescale.serving.rope import EngineRope


@pytest.fixture
def stub_engine():
    """An engine serving plain RoPE with a linear factor, written as stub.json; its rope computes
    θ_i = b^(−2i/d)/s itself. Removed from the registry afterwards."""

    class Stub(Engine):
        name = "stub"
        label = "Stub"
        folder = False
        rope_source = "tests.serving.test_engines.Stub.rope"

        def translate(self, handle, serve_length, *, freeze_dynamic_at=None):
            served = served_rope_parameters(handle, self.label, serve_length, freeze_dynamic_at=freeze_dynamic_at)
            if served.rope_parameters["rope_type"] not in ("default", "linear"):
                raise ExportRefused(f"Stub: no {served.rope_parameters['rope_type']}")
            return served

        def write(self, model, tokenizer, translation, output, *, gguf=None):
            with staged(output) as stage:
                (stage / "stub.json").write_text(json.dumps(translation.rope_parameters))
            return output / "stub.json", ["written by the stub"]

        def rope(self, translation, length, context):
            rp, d = translation.rope_parameters, context["dim"]
            inv = rp["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) / rp.get("factor", 1.0)
            return EngineRope(inv, 1.0)

        def serve_command(self, translation, path, serve_length):
            return f"stub {path} {serve_length}"

    yield Stub
    del ENGINES["stub"]


def test_the_bundled_engines_are_discovered_by_module():
    assert {"transformers", "vllm", "llama.cpp"} <= set(engine_names())
    assert {ENGINES[n].__module__ for n in ("transformers", "vllm", "llama.cpp")} == {
        "ropescale.serving.engines.transformers", "ropescale.serving.engines.vllm",
        "ropescale.serving.engines.llama_cpp"}
    assert [n for n in engine_names() if ENGINES[n].reads_gguf] == ["llama.cpp"]
    assert not ENGINES["transformers"].static and ENGINES["vllm"].static and ENGINES["llama.cpp"].static


def test_gguf_is_llama_cpp_with_a_future_warning_and_a_name_is_taken_once(stub_engine):
    with pytest.warns(FutureWarning, match="^engine 'gguf' is deprecated; use 'llama.cpp'$"):
        assert get_engine("gguf").name == "llama.cpp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_engine("llama.cpp").name == "llama.cpp"
    with pytest.raises(ValueError, match="engine 'stub' is already registered"):
        type("Again", (Engine,), {"name": "stub"})


def test_a_registered_stub_engine_is_used_by_export_for(tiny_model_dir, tmp_path, stub_engine):
    model, _ = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "linear", factor=2.0)
    result = export_for(model, "stub", 64, tmp_path / "out")  # no tokenizer: the stub writes no folder
    assert result.engine == "stub" and result.path == tmp_path / "out" / "stub.json"
    assert json.loads(result.path.read_text()) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert result.notes == ["written by the stub"] and result.usage == f"serve it with: stub {result.path} 64"
    with pytest.raises(InvalidInput, match="^the stub engine serves one static rotation: give the length"):
        export_for(model, "stub", None, tmp_path / "x")
    ropescale.unpatch(model)
    ropescale.patch(model, "yarn", factor=2.0)
    with pytest.raises(ExportRefused, match="^Stub: no yarn$"):
        export_for(model, "stub", 64, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_stub_engine_without_a_driver_is_compared_through_its_rope(tiny_model_dir, tmp_path, stub_engine):
    """No driver of its own: run_parity's rows come from the engine's ``rope`` and say so. Its
    linear rope is ropescale's linear at any L, its default rope NTK's raised base (both same)."""
    rows, meta = run_parity(str(tiny_model_dir), [parse_strategy(s) for s in ("linear:factor=2", "ntk:factor=4",
                                                                               "yarn:factor=2")],
                            [64], engines=["stub"], output=tmp_path / "p")
    linear, ntk, yarn = rows
    assert linear.verdict == "same" and linear.source == "re-implementation (tests.serving.test_engines.Stub.rope)"
    assert ntk.verdict == "same"  # NTK is a raised base: rope_type default with rope_theta b·s^(d/(d−2))
    assert yarn.verdict == "refused: Stub: no yarn" and yarn.same is False
    assert meta["engines"] == ["Stub (in process)"]

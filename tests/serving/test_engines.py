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


# Issue 54, item 3: what each engine reads is declared (ropescale.serving.tables), never an if-chain over rope types.
ROPE_TABLES = {"vllm": ("ROPE_TYPES",), "sglang": ("ROPE_TYPES",), "mlx": ("ROPE_TYPES",),
               "llama_cpp": ("ROPE_TYPES", "SCALING_TYPES")}
# module (under ropescale/serving/engines/) → its re-implementation and export-translation functions
REIMPLEMENTATIONS = {"vllm_ropes.py": ("vllm_rope",), "vllm.py": ("_translate",),
                     "sglang.py": ("sglang_rope", "_translate"), "mlx.py": ("mlx_rope", "_translate"),
                     "llama_cpp.py": ("llama_cpp_rope",), "llama_cpp_keys.py": ("kind_keys",)}


def rope_type_branches(path, names) -> list[str]:
    """``file:line test`` for every ``if``/``elif``/conditional expression in the functions ``names`` of ``path``
    whose test compares a rope type (a name ``kind``/``rope_type``, or an expression reading ``"rope_type"``)
    with a string literal or a literal collection of strings."""
    import ast
    from pathlib import Path

    def literal(node) -> bool:
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return bool(items) and all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items)

    def rope_type(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("kind", "rope_type")) or (
            not isinstance(node, ast.Name) and "'rope_type'" in ast.unparse(node))

    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    bad = []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in names):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.If | ast.IfExp | ast.While):
                continue
            for cmp in ast.walk(node.test):
                ops = [cmp.left, *cmp.comparators] if isinstance(cmp, ast.Compare) else []
                if any(rope_type(o) for o in ops) and any(literal(o) for o in ops):
                    bad.append(f"{Path(path).name}:{node.lineno} {ast.unparse(cmp)}")
    return bad


def test_every_engine_declares_its_rope_types_and_families_with_sources():
    import importlib

    from ropescale.serving.tables import Family, RopeRow

    for name, tables in ROPE_TABLES.items():
        module = importlib.import_module(f"ropescale.serving.engines.{name}")
        for table in tables:
            rows = getattr(module, table)
            assert rows and all(isinstance(r, RopeRow) and kind in r.kinds for kind, r in rows.items()), (name, table)
            assert all(r.source and (r.compute or r.translate) for r in rows.values()), (name, table)
        assert module.FAMILIES and all(isinstance(f, Family) and f.source and f.members and f.does
                                       for f in module.FAMILIES.values()), name


def test_no_engine_reimplementation_branches_on_a_rope_type_name():
    from pathlib import Path

    import ropescale.serving.engines as engines

    folder = Path(engines.__file__).parent
    assert [b for file, names in REIMPLEMENTATIONS.items() for b in rope_type_branches(folder / file, names)] == []


def test_the_rope_type_branch_check_sees_one(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f(rp, kind):\n    if kind == 'yarn':\n        pass\n    elif rp['rope_type'] in ('a', 'b'):\n"
                 "        pass\n    x = 1 if kind != 'default' else 2\n    if kind in TABLE or rp.get('x') == 'y':\n"
                 "        pass\n\n\ndef g(kind):\n    if kind == 'yarn':\n        pass\n")
    assert rope_type_branches(a, ("f",)) == ["a.py:2 kind == 'yarn'", "a.py:4 rp['rope_type'] in ('a', 'b')",
                                             "a.py:6 kind != 'default'"]

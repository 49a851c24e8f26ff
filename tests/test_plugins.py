"""Plugins: an installed package adds a strategy, a task, a recipe and a serving engine through
importlib.metadata entry points (groups ``ropescale.strategies``, ``ropescale.tasks``,
``ropescale.recipes``, ``ropescale.engines``) without touching ropescale; a broken one is skipped
with one warning line. And the registries' shared face: one base of the unknown-name errors,
``register`` and ``Param`` exported from ``ropescale``.

The plugin is built in ``tmp_path`` as an installed distribution looks to ``importlib.metadata``: a
package beside a ``*.dist-info`` folder holding ``METADATA`` and ``entry_points.txt``, put on
``PYTHONPATH`` of a fresh interpreter (the registries are loaded once per process)."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ropescale
from eval.tasks import UnknownTaskError, get_task
from ropescale.errors import RopescaleError, UnknownNameError
from ropescale.serving.engines import UnknownEngineError, get_engine
from ropescale.strategies import REGISTRY, UnknownStrategyError, get_strategy
from ropescale.training.recipes import UnknownRecipeError, get_recipe

ROOT = Path(__file__).resolve().parents[1]

STRATEGIES = '''
import torch

import ropescale


@ropescale.register("plugin_shift", params=(ropescale.Param("shift", 1.0, low=1.0),), source="a test plugin")
def plugin_shift(dim: int, rope_theta: float, shift: float) -> ropescale.RopeFrequencies:
    """The RoPE base multiplied by shift (a test plugin)."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    return ropescale.RopeFrequencies((1.0 / (rope_theta * shift) ** (i / dim)).float(), 1.0)
'''

# in a checkout the harness is the package `eval` (`python cli.py`); installed, `ropescale_eval`
TASKS = '''
from eval.tasks import Metric, Task


class PluginProbe(Task):
    """A probe from a test plugin."""

    name = "plugin_probe"
    metrics = (Metric(key="probe", label="probe", higher_is_better=True),)
'''

RECIPES = '''
from ropescale.training.recipes import Recipe


class PluginRecipe(Recipe):
    name = "plugin_recipe"

    def prepare(self, model, cfg, source="config"):
        return model
'''


# an engine: one library module (check/translate/write/rope/serve command) ...
ENGINE = '''
import json

import torch

from ropescale.serving.engines import Engine
from ropescale.serving.output import staged
from ropescale.serving.plan import served_rope_parameters
from ropescale.serving.rope import EngineRope, ExportRefused


class RopeJson(Engine):
    """Serves plain RoPE with the base written in rope.json (a test plugin)."""

    name = "ropejson"
    label = "RopeJSON"
    folder = False  # writes no weights: no tokenizer needed
    rope_source = "rs_plugin.engine.RopeJson.rope"

    def translate(self, handle, serve_length, *, freeze_dynamic_at=None):
        served = served_rope_parameters(handle, self.label, serve_length, freeze_dynamic_at=freeze_dynamic_at)
        if served.rope_parameters["rope_type"] != "default":
            raise ExportRefused(f"RopeJSON: only a base, not rope type {served.rope_parameters['rope_type']}")
        return served

    def write(self, model, tokenizer, translation, output, *, gguf=None):
        with staged(output) as stage:
            (stage / "rope.json").write_text(json.dumps({"rope_theta": translation.rope_parameters["rope_theta"],
                                                         "dim": translation.context["dim"]}))
        return output / "rope.json", []

    def rope(self, translation, length, context):
        d, b = context["dim"], translation.rope_parameters["rope_theta"]
        return EngineRope(1.0 / b ** (torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0)

    def serve_command(self, translation, path, serve_length):
        return f"ropejson-serve {path} --ctx {serve_length}"
'''

# ... and its parity driver: the engine's own numbers, here its file read back
DRIVER = '''
import json

import torch

from eval.engines.base import EngineDriver, fill
from ropescale.serving.rope import EngineRope


class RopeJsonDriver(EngineDriver):
    name = "ropejson"

    def serve(self, row, case, translation):
        path, _ = self.engine.write(None, None, translation, self.run.exports / "ropejson" / case.slug)
        written = json.loads(path.read_text())
        i = torch.arange(0, written["dim"], 2, dtype=torch.float64)
        theirs = EngineRope(written["rope_theta"] ** (-i / written["dim"]), 1.0)
        fill(row, case.ours, theirs, case.length, "RopeJSON file read back")
'''


def _distribution(site: Path, name: str, entry_points: str) -> None:
    """A minimal installed distribution ``name`` 1.0 in ``site`` with these entry points."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points), encoding="utf-8")


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _plugin(site: Path) -> None:
    """The package ``rs_plugin`` installed in ``site``: a strategy, a task, a recipe and an engine (its
    library module and its parity driver)."""
    pkg = site / "rs_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    for module, text in (("strategies", STRATEGIES), ("tasks", TASKS), ("recipes", RECIPES), ("engine", ENGINE),
                         ("engine_driver", DRIVER)):
        (pkg / f"{module}.py").write_text(text, encoding="utf-8")
    _distribution(site, "rs_plugin", """\
        [ropescale.strategies]
        shift = rs_plugin.strategies

        [ropescale.tasks]
        probe = rs_plugin.tasks

        [ropescale.recipes]
        noop = rs_plugin.recipes

        [ropescale.engines]
        ropejson = rs_plugin.engine
        ropejson_driver = rs_plugin.engine_driver
        """)


def test_a_plugin_package_adds_a_strategy_a_task_and_a_recipe(tmp_path):
    _plugin(tmp_path)
    probe = textwrap.dedent("""\
        import json, sys
        from eval.tasks import task_names
        from ropescale import get_strategy, strategy_names
        from ropescale.training.recipes import recipe_names
        names = {"strategies": strategy_names(), "tasks": task_names(), "recipes": recipe_names()}
        freqs = get_strategy("plugin_shift").compute({"dim": 8, "rope_theta": 100.0}, {"shift": 4.0})
        names["inv_freq"] = freqs.inv_freq.tolist()
        print(json.dumps(names))
        """)
    done = _run(tmp_path, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    got = json.loads(done.stdout)
    assert "plugin_shift" in got["strategies"] and "yarn" in got["strategies"]
    assert "plugin_probe" in got["tasks"] and "passkey" in got["tasks"]
    assert "plugin_recipe" in got["recipes"] and "lora" in got["recipes"]
    # the plugin's function is what runs: (100 · 4)^(−2i/8), i = 0 … 3, written out
    assert got["inv_freq"] == pytest.approx([400.0 ** -(2 * i / 8) for i in range(4)], rel=1e-6)

    listed = _run(tmp_path, "cli.py", "strategies")
    assert listed.returncode == 0, listed.stderr
    assert "plugin_shift" in listed.stdout and "a test plugin" in listed.stdout


def test_a_broken_plugin_is_one_warning_line_and_ropescale_still_works(tmp_path):
    (tmp_path / "rs_broken.py").write_text("import rs_no_such_module\n", encoding="utf-8")
    _distribution(tmp_path, "rs_broken", """\
        [ropescale.strategies]
        broken = rs_broken
        """)
    done = _run(tmp_path, "cli.py", "strategies")
    assert done.returncode == 0, done.stderr
    assert "yarn" in done.stdout  # the bundled strategies are all there
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback
    assert "PluginWarning" in lines[0] and "'broken'" in lines[0] and "rs_broken" in lines[0]
    assert "ModuleNotFoundError: No module named 'rs_no_such_module'" in lines[0]


BAD_STRATEGIES = '''
import torch

import ropescale


@ropescale.register("plugin_nan", source="a test plugin")
def plugin_nan(dim: int) -> ropescale.RopeFrequencies:
    """NaN frequencies (a broken test plugin)."""
    return ropescale.RopeFrequencies(torch.full((dim // 2,), float("nan")), 1.0)
'''

BAD_DEFAULT = '''
import ropescale


@ropescale.register("plugin_bad_default", params=(ropescale.Param("shift", 0.5, low=1.0),), source="a test plugin")
def plugin_bad_default(dim: int, rope_theta: float, shift: float) -> ropescale.RopeFrequencies:
    """A default outside its own range (a broken test plugin)."""
'''


def test_a_plugins_bad_strategy_is_refused_naming_the_plugin(tmp_path, monkeypatch, recwarn):
    """In process (``Registry.load_plugins``'s loader on two entry points): a plugin strategy's NaN
    output is refused naming the plugin and its module; a plugin whose Param default is outside its
    own range is not loaded (one warning line) instead of running with that default."""
    import importlib.metadata

    from ropescale.errors import InvalidInput
    from ropescale.registry import PluginWarning, _load_entry_point

    (tmp_path / "rs_bad_plugin").mkdir()
    (tmp_path / "rs_bad_plugin" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "rs_bad_plugin" / "nan.py").write_text(BAD_STRATEGIES, encoding="utf-8")
    (tmp_path / "rs_bad_plugin" / "default.py").write_text(BAD_DEFAULT, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for name in ("nan", "default"):
            _load_entry_point(importlib.metadata.EntryPoint(f"rs_{name}", f"rs_bad_plugin.{name}",
                                                            "ropescale.strategies"))
        with pytest.raises(InvalidInput, match=r"^strategy 'plugin_nan' \(plugin 'rs_nan' \(rs_bad_plugin.nan\)\) "
                                               r"returned inv_freq\[0\] = nan; frequencies are finite and >= 0"):
            get_strategy("plugin_nan").compute({"dim": 16}, {})
        assert "plugin_bad_default" not in REGISTRY
        (warning,) = [w for w in recwarn if issubclass(w.category, PluginWarning)]
        assert str(warning.message) == (
            "ropescale.strategies plugin 'rs_default' (rs_bad_plugin.default) not loaded: TypeError: "
            "plugin_bad_default: parameter shift=0.5 is out of range; allowed: >= 1 (its default)")
    finally:
        for name in ("plugin_nan", "plugin_bad_default"):
            REGISTRY.pop(name, None)
        for module in ("rs_bad_plugin", "rs_bad_plugin.nan", "rs_bad_plugin.default"):
            sys.modules.pop(module, None)


def test_a_broken_engine_plugin_warns_once_though_two_registries_read_its_group(tmp_path):
    # the library's engines and the harness's engine roles both read ropescale.engines
    (tmp_path / "rs_broken_engine.py").write_text("import rs_no_such_module\n", encoding="utf-8")
    _distribution(tmp_path, "rs_broken_engine", """\
        [ropescale.engines]
        broken = rs_broken_engine
        """)
    probe = ("from ropescale.serving.engines import engine_names\n"
             "from eval.engines import ROLES\n"
             "print(engine_names(), ROLES.names())\n")
    done = _run(tmp_path, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert "vllm" in done.stdout and "llama.cpp" in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "ropescale.engines plugin 'broken'" in lines[0]


def test_a_plugin_package_adds_an_engine_for_export_patch_and_parity(tmp_path, tiny_model_dir):
    """The plugin's engine, by its name, in export_for, `ropescale patch --engine` and `ropescale parity`
    (its own driver), with no change to ropescale. Oracle: NTK's base b·s^(d/(d−2)) written out, d = 16,
    b = 10000, s = 4 (the tiny model), and the driver's θ_i = b'^(−2i/d) from the file it wrote."""
    _plugin(tmp_path)
    out = tmp_path / "cli"
    probe = textwrap.dedent(f"""\
        import json, sys
        import ropescale
        from eval.parity import run_parity
        from ropescale.runs.config import parse_strategy
        from ropescale.serving import engine_names, export_for
        model, tok = ropescale.load_model({str(tiny_model_dir)!r}, device="cpu")
        ropescale.patch(model, "ntk", factor=4.0)
        result = export_for(model, "ropejson", 128, {str(tmp_path / "lib")!r})
        rows, meta = run_parity({str(tiny_model_dir)!r}, [parse_strategy("ntk:factor=4"), parse_strategy("yarn")],
                                [64], engines=["ropejson"], output={str(tmp_path / "par")!r})
        from click.testing import CliRunner  # the CLI in the same fresh process: one interpreter start, not three
        from cli import main
        patched = CliRunner().invoke(main, ["patch", "--model", {str(tiny_model_dir)!r}, "--strategy", "ntk:factor=4",
                                            "--engine", "ropejson", "--serve-length", "128", "-o", {str(out)!r}])
        parity = CliRunner().invoke(main, ["parity", "--model", {str(tiny_model_dir)!r}, "--strategy", "ntk:factor=4",
                                           "--lengths", "64", "--engines", "ropejson", "-o",
                                           {str(tmp_path / "cli-parity")!r}])
        print(json.dumps({{"engines": engine_names(), "path": str(result.path), "command": result.command,
                          "written": json.loads(result.path.read_text()),
                          "rows": [[r.engine, r.verdict, r.source, r.max_rel_freq_diff] for r in rows],
                          "meta": meta["engines"], "patch": [patched.exit_code, patched.output],
                          "parity": [parity.exit_code, parity.output]}}))
        """)
    done = _run(tmp_path, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert {"ropejson", "llama.cpp", "transformers", "vllm"} <= set(got["engines"])
    assert got["path"] == str(tmp_path / "lib" / "rope.json")
    assert got["written"] == {"rope_theta": pytest.approx(10000.0 * 4.0 ** (16 / 14), rel=1e-12), "dim": 16}
    assert got["command"] == f"ropejson-serve {tmp_path / 'lib' / 'rope.json'} --ctx 128"
    (engine, verdict, source, diff), refused = got["rows"]
    assert (engine, verdict, source) == ("ropejson", "same", "RopeJSON file read back") and diff < 1e-6
    assert refused[:3] == ["ropejson", "refused: RopeJSON: only a base, not rope type yarn", "ropescale export"]
    assert got["meta"] == ["RopeJSON (in process)"]

    code, output = got["patch"]
    assert code == 0, output
    assert f"serve it with: ropejson-serve {out / 'rope.json'} --ctx 128" in output
    assert json.loads((out / "rope.json").read_text())["rope_theta"] == pytest.approx(10000.0 * 4.0 ** (16 / 14))
    code, output = got["parity"]
    assert code == 0, output
    assert "ropejson  ntk:factor=4" in output and "same" in output


@pytest.mark.parametrize(("lookup", "error", "builtin"), [
    (get_strategy, UnknownStrategyError, KeyError),
    (get_task, UnknownTaskError, KeyError),
    (get_recipe, UnknownRecipeError, ValueError),
    (get_engine, UnknownEngineError, ValueError),
])
def test_unknown_names_share_one_base(lookup, error, builtin):
    with pytest.raises(UnknownNameError) as caught:
        lookup("no_such_name")
    err = caught.value
    assert type(err) is error and isinstance(err, builtin) and isinstance(err, RopescaleError)
    assert str(err).startswith("unknown ") and "'no_such_name'" in str(err)  # one line, not KeyError's repr
    assert "\n" not in str(err)


def test_register_and_param_are_exported():
    from ropescale.strategies import Param, register

    assert ropescale.register is register and ropescale.Param is Param
    assert {"register", "Param", "UnknownNameError"} <= set(ropescale.__all__)


def test_every_strategy_module_is_discovered():
    """Each module of ropescale.strategies (but the registry) registers strategies on import."""
    modules = {f"ropescale.strategies.{m.name}" for m in pkgutil.iter_modules(ropescale.strategies.__path__)}
    assert {s.fn.__module__ for s in REGISTRY.values()} == modules - {"ropescale.strategies.registry"}

"""The folder tree is the layer diagram, and it stays true.

The module import graph is built statically from the source (every ``import``, also those inside
functions): the library (``ropescale/``) never imports the harness (``eval/``) or the CLI, no
module imports itself back through others (no cycles), and no module imports a layer above its own
(``LAYERS``: the library's own order, then the harness, then the CLI). An edge goes to the most specific module an
import names (``from ropescale.runs.config import X`` → ``ropescale.runs.config``; ``from ropescale
import geometry`` → ``ropescale.geometry``), not to the parent packages Python also runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP = ("ropescale", "eval", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / "ropescale").rglob("*.py"), *(ROOT / "eval").rglob("*.py"), ROOT / "cli.py"]
    return {_module_name(p): p for p in files}


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of this project it imports}`` from the source text."""
    mods = _sources()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # ``from pkg import sub`` names the submodule when there is one
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] in TOP:
                    while t not in mods and "." in t:  # ``import a.b.c`` of an attribute path
                        t = t.rpartition(".")[0]
                    if t in mods and t != name:
                        edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_library_never_imports_the_harness_or_the_cli():
    graph = import_graph()
    bad = sorted(f"{a} → {b}" for a, deps in graph.items() if a.startswith("ropescale")
                 for b in deps if not b.startswith("ropescale"))
    assert bad == []


def test_there_are_no_import_cycles():
    assert _cycles(import_graph()) == []


# The layers of the project, bottom first (docs/architecture.md): a layer is groups of modules, each
# group named by module prefixes (a module belongs to the group of its longest matching prefix; a
# name ending in ``$`` is that module alone: ``ropescale$``, the package face). A module may import
# its own group and any group of a layer below; an import of a layer above, or of another group of
# its own layer (training ↔ serving), is a violation. A new module under a listed prefix
# (ropescale/serving/engines/, ropescale/runs/lifecycle.py) fits without an edit; one under no
# prefix fails the test.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"errors": ("ropescale.errors",), "version": ("ropescale._version",), "compat": ("ropescale.compat",),
     "registry": ("ropescale.registry",)},
    {"strategies": ("ropescale.strategies",), "reference corpus": ("ropescale.reference",)},
    {"model primitives": ("ropescale.rope_config", "ropescale.temperature", "ropescale.geometry", "ropescale.lm_head")},
    {"attention": ("ropescale.attention",)},
    {"model side": ("ropescale.rotary",)},
    {"patching": ("ropescale.patching",)},
    {"save and load": ("ropescale.models", "ropescale.pip_models")},
    {"runs": ("ropescale.runs",)},
    {"training": ("ropescale.training",), "serving": ("ropescale.serving",)},
    {"package face": ("ropescale$",)},
    {"harness": ("eval",)},
    {"cli": ("cli",)},
]
# (importer, imported) → why this upward or sideways edge is deliberate; none today
EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(module: str, layers=None) -> tuple[int, str] | None:
    """``(layer index, group)`` of ``module`` by its longest matching prefix; None when unlisted."""
    best = None
    for i, groups in enumerate(layers or LAYERS):
        for group, prefixes in groups.items():
            for p in prefixes:
                exact = p.endswith("$")
                p = p.removesuffix("$")
                if (module == p or (not exact and module.startswith(p + "."))) and (best is None or len(p) > best[0]):
                    best = (len(p), i, group)
    return best and best[1:]


def layer_violations(graph: dict[str, set[str]], layers=None, exceptions=None) -> list[str]:
    """Every edge to a higher layer or to another group of the same layer, not in ``exceptions``."""
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    bad = []
    for a, deps in sorted(graph.items()):
        la = layer_of(a, layers)
        for b in sorted(deps):
            lb = layer_of(b, layers)
            if la is None or lb is None or (a, b) in exceptions or la[1] == lb[1] or lb[0] < la[0]:
                continue
            how = "up" if lb[0] > la[0] else "sideways"
            bad.append(f"{a} ({la[1]}) → {b} ({lb[1]}): {how}")
    return bad


def test_every_module_has_a_layer():
    assert sorted(m for m in import_graph() if layer_of(m) is None) == []


def test_no_import_goes_up_a_layer_or_sideways():
    """The library's own order (strategies → rotary/attention → patching → save/load → runs →
    training, serving) was documented but only the library → harness edge and cycles were tested."""
    assert layer_violations(import_graph()) == []


def test_every_exception_is_a_real_edge_with_a_reason():
    graph = import_graph()
    assert all(b in graph.get(a, ()) and reason.strip() for (a, b), reason in EXCEPTIONS.items())


def test_the_layer_check_sees_a_violation():
    layers = [{"low": ("p.low",)}, {"a": ("p.a",), "b": ("p.b",)}, {"face": ("p$",)}]
    graph = {"p.low.x": {"p.a.y"}, "p.a.y": {"p.low.x", "p.b"}, "p.b": set(), "p": {"p.a.y"}, "p.a.z": {"p"}}
    assert layer_of("p.a.y.z", layers) == (1, "a") and layer_of("p", layers) == (2, "face")
    assert layer_of("q", layers) is None and layer_of("p.lowest", layers) is None
    assert layer_violations(graph, layers, {}) == [
        "p.a.y (a) → p.b (b): sideways", "p.a.z (a) → p (face): up", "p.low.x (low) → p.a.y (a): up"]
    assert layer_violations(graph, layers, {("p.a.z", "p"): "why", ("p.a.y", "p.b"): "why"}) == [
        "p.low.x (low) → p.a.y (a): up"]
    # on the real graph: a made-up edge from a strategy to the patching module is seen
    graph = import_graph()
    graph["ropescale.strategies.frequency"] = graph["ropescale.strategies.frequency"] | {"ropescale.patching"}
    assert layer_violations(graph) == [
        "ropescale.strategies.frequency (strategies) → ropescale.patching (patching): up"]


def test_the_checks_see_a_violation():
    """The graph and the cycle search on a made-up graph and on the real source: they can fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "ropescale.runs.config" in graph["eval.config"]  # an absolute import
    assert "eval.tasks.base" in graph["eval.tasks.retrieval"]  # a relative one
    assert "ropescale.geometry" in graph["eval.inspect"]  # ``from ropescale import geometry``


def test_installed_packages_are_namespaced_and_complete():
    """pyproject lists every package folder, maps eval/ to ``ropescale_eval`` and cli.py into
    ``ropescale_cli``: nothing installs as a generic top-level ``eval`` or ``cli``."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs = setup["package-dir"]
    assert dirs == {"ropescale": "ropescale", "ropescale_eval": "eval", "ropescale_cli": "."}
    listed = set(setup["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("ropescale", "eval")
               for p in (ROOT / top).rglob("__init__.py")}
    expected = {("ropescale_eval" + f.removeprefix("eval")) if f.split(".")[0] == "eval" else f for f in folders}
    assert listed == expected | {"ropescale_cli"}
    assert {p.split(".")[0] for p in listed} == {"ropescale", "ropescale_eval", "ropescale_cli"}
    assert setup.get("py-modules") is None
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts == {"ropescale": "ropescale_cli.cli:main"}


@pytest.mark.slow
def test_the_wheel_holds_no_generic_top_level_names(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"  # a copy: setuptools writes build/ beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "cli.py"):
        shutil.copy(ROOT / name, src / name)
    for name in ("ropescale", "eval"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("ropescale-*.whl"))
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"ropescale", "ropescale_eval", "ropescale_cli", wheel.name.split("-py3")[0] + ".dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "ropescale_cli/cli.py" in names and "ropescale_eval/tasks/passkey.py" in names
    assert "ropescale/reference/kjv-llama/config.json" in names


def test_the_rotary_modules_fields_are_written_only_by_the_module():
    """State belongs to its owner: no other library module assigns a field of a rotary module's
    ``FrequencyPatch`` (the training loop wrote ``target_length``, the cache hooks ``cache``/``history``/
    ``n_new``; now ``set_target_length``, ``use_watch`` and ``ropescale.rotary.cache.CacheWatch`` own them)."""
    rotary = ast.parse((ROOT / "ropescale" / "rotary" / "frequencies.py").read_text(encoding="utf-8"))
    cls = next(n for n in ast.walk(rotary) if isinstance(n, ast.ClassDef) and n.name == "FrequencyPatch")
    fields = {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              for t in (t.elts if isinstance(t, ast.Tuple) else [t])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert {"target_length", "watch", "entries"} <= fields
    writes = []
    for path in (ROOT / "ropescale").rglob("*.py"):
        if path == ROOT / "ropescale" / "rotary" / "frequencies.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            for x in (x for tgt in targets for x in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])):
                if (isinstance(x, ast.Attribute) and x.attr in fields
                        and not (isinstance(x.value, ast.Name) and x.value.id == "self")):
                    writes.append(f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(x)}")
    assert writes == []


def private_crossings(sources: dict[str, Path] | None = None) -> list[str]:
    """Every ``from <project module> import _name`` (and ``<imported project module>._name``) in a module
    other than the one that defines it: a private name is its module's own."""
    sources = _sources() if sources is None else sources
    bad = []
    for name, path in sorted(sources.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()  # names bound to a project module here
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                if origin.split(".")[0] not in TOP:
                    continue
                for a in node.names:
                    if f"{origin}.{a.name}" in sources:
                        aliases.add(a.asname or a.name)
                    elif a.name.startswith("_") and not a.name.startswith("__") and origin != name:
                        bad.append(f"{name}:{node.lineno} from {origin} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in TOP}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_crosses_modules():
    """A name with a leading underscore is used only in the module that defines it (issue 40: patching.py
    imported ``_buffer``, ``_config_of``, ``_Entry`` and called ``entry._compute``; the probe imported
    attention's ``_base_attention``)."""
    assert private_crossings() == []


def test_the_private_crossing_check_sees_one(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from eval.x import _hidden\nfrom eval import y\ny._inner()\nfrom eval.x import shown\n")
    b.write_text("import os\nos._exit\n")
    assert private_crossings({"eval.a": a, "eval.b": b, "eval.y": b}) == [
        "eval.a:1 from eval.x import _hidden", "eval.a:3 y._inner"]


def _outside_strategies(sources: dict[str, Path] | None):
    """``(module name, ast node)`` of every node of ``sources`` (default: the project's) outside
    ``ropescale/strategies/``, module by module in name order."""
    for name, path in sorted((_sources() if sources is None else sources).items()):
        if not name.startswith("ropescale.strategies"):
            yield from ((name, node) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def name_literal_branches(sources: dict[str, Path] | None = None, names: set[str] | None = None) -> list[str]:
    """Every comparison outside ``ropescale/strategies/`` of a value with a registered strategy's name: behaviour
    chosen by a strategy's name instead of a capability it declares at ``register(...)``. A comparison of a
    rope type (an operand naming ``kind`` or ``rope_type``: transformers' and the engines' vocabulary, which
    shares names such as ``yarn``) is not one."""
    from ropescale.strategies import strategy_names

    names = set(strategy_names()) if names is None else names
    bad = []
    for name, node in _outside_strategies(sources):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        consts = [c for o in operands for c in (o.elts if isinstance(o, ast.Tuple | ast.List | ast.Set) else [o])
                  if isinstance(c, ast.Constant) and c.value in names]
        if consts and not any(w in ast.unparse(o) for o in operands for w in ("kind", "rope_type")):
            bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_strategy_name_literal_outside_the_strategies():
    """Issue 40: 12 comparisons with "native", "dynamic_ntk", "longrope" in six files outside
    ``ropescale/strategies/``; the last two (the evolution's longrope, RULER's vanilla baseline) are a
    ``long_factor`` list parameter and ``ropescale.strategies.BASELINE``."""
    assert name_literal_branches() == []


def test_the_name_literal_check_sees_one(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("if spec.name == 'yarn':\n    pass\nif rp['rope_type'] == 'yarn':\n    pass\n"
                 "if s in ('native', 'x'):\n    pass\n")
    assert name_literal_branches({"eval.a": a}, {"yarn", "native"}) == [
        "eval.a:1 spec.name == 'yarn'", "eval.a:5 s in ('native', 'x')"]


def param_name_reads(sources: dict[str, Path] | None = None, names: set[str] | None = None) -> list[str]:
    """Every read outside ``ropescale/strategies/`` of a strategy parameter *by its name* from a strategy's
    parameters (an expression naming ``params``): ``params["factor"]``, ``params.get("window")``, ``"factor" in
    spec.params``. Behaviour picks a parameter by the role it declares (``Strategy.scale_param``,
    ``Strategy.exact_below``, ``Strategy.frozen``), so a strategy whose scale is called ``scale`` (DCA) or
    whose window is ``local_window`` (STRING) is read right."""
    from ropescale.strategies import REGISTRY

    names = {p.name for s in REGISTRY.values() for p in s.params} if names is None else names
    bad = []
    for name, node in _outside_strategies(sources):
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target, key = node.func.value, (node.args or [None])[0]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            target, key = node.comparators[0], node.left
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in names and "params" in ast.unparse(target):
            bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_strategy_parameter_is_read_by_its_name_outside_the_strategies():
    """Issue 54, item 4: the sweep read ``params.get("window")`` (missing STRING's and DCA's ``local_window``),
    profiles and lm-eval read ``factor``, the serving plan held dynamic NTK's freeze formula. They read roles."""
    assert param_name_reads() == []


def test_the_param_name_check_sees_one(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("w = params.get('window', 0)\ns = handle.params['factor']\nif 'factor' in spec.params:\n    pass\n"
                 "t = rp['factor']\nu = base.get('window')\n")
    assert param_name_reads({"eval.a": a}, {"window", "factor"}) == [
        "eval.a:1 params.get('window', 0)", "eval.a:2 handle.params['factor']", "eval.a:3 'factor' in spec.params"]


def _command_bodies(source: str) -> dict[str, list[ast.stmt]]:
    """Each click command function of ``source`` → its statements after the docstring."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("command", "group")
                for d in node.decorator_list):
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else node.body
            out[node.name] = body
    return out


def _logic(body: list[ast.stmt]) -> bool:
    """Anything but one call of ``commands.<name>(...)`` (a group's body may be empty)."""
    return not (body == [] or (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Call)
                                and ast.unparse(body[0].value.func).startswith("commands.")))


def test_cli_py_declares_commands_and_calls_the_harness_for_each():
    """cli.py is the entry point and stays thin (issue 40, item 5): options and one call per command into
    ``eval/commands.py``, imported plainly (the layer test sees the edge), no ``importlib`` lookup."""
    source = (ROOT / "cli.py").read_text(encoding="utf-8")
    bodies = _command_bodies(source)
    assert len(bodies) >= 14 and "patch_cmd" in bodies and "reference_card" in bodies
    assert [name for name, body in bodies.items() if _logic(body)] == []
    assert "importlib" not in source
    assert "eval.commands" in import_graph()["cli"]


def test_the_thin_cli_check_sees_logic():
    source = ('@main.command()\ndef a():\n    """doc."""\n    commands.a(1)\n\n'
              '@main.command()\ndef b(x):\n    if x:\n        commands.b()\n\n'
              '@main.group()\ndef c():\n    """doc."""\n')
    assert [n for n, body in _command_bodies(source).items() if _logic(body)] == ["b"]

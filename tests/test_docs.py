"""The documentation stays whole: a short README, every page of docs/ in the site's nav, no relative link
to a file that is not there, and the generated reference pages equal to what the code generates.

Static reads only (no mkdocs import): `mkdocs build --strict` itself runs in CI (`.ci/run`), where it
also checks anchors and the API pages' docstrings.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 300
# the README's test command, which CI (.ci/run) runs as written: it may not drift from the README
TEST_COMMAND = 'pip install -c constraints.txt ".[test]" && ruff check . && python -m pytest'

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images in ``text`` that point into the repository: outside
    fenced code and inline code, not URLs (``scheme:``), not a bare ``#anchor``; anchors dropped."""
    out, fence = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fence = not fence
            continue
        if fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for target in _LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            out.append(target.split("#", 1)[0])
    return out


def broken_links(md: Path) -> list[str]:
    return [t for t in relative_links(md.read_text()) if not (md.parent / t).exists()]


def nav_pages(nav) -> list[str]:
    """Every page file named in a mkdocs ``nav`` (nested lists of ``{title: page or [...]}``)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the site (docs/) holds the details"


def test_the_readme_keeps_the_test_command_ci_runs():
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    assert TEST_COMMAND.split(" && ", 1)[1] in (ROOT / ".ci" / "run").read_text()


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    config = _mkdocs()
    assert config.get("docs_dir", "docs") == "docs" and config.get("strict") is True
    nav = nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages in docs/ missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries with no page in docs/"
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"


@pytest.mark.parametrize("md", [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_files_that_exist(md):
    assert broken_links(md) == []


def test_the_site_pages_link_only_inside_docs():
    """mkdocs cannot serve a link out of docs/ (``../README.md``): strict mode fails on it."""
    for md in DOCS.rglob("*.md"):
        outside = [t for t in relative_links(md.read_text())
                   if not (md.parent / t).resolve().is_relative_to(DOCS)]
        assert outside == [], f"{md.relative_to(ROOT)} links out of docs/: {outside}"


def test_the_link_checks_see_a_violation(tmp_path):
    """The checker on made-up pages: it can fail, and it skips what is not a file link."""
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [gone](missing.md) ![img](gone.png) [web](https://x.org/a.md)\n"
                    "[anchor](#local) `[code](nope.md)`\n```\n[fenced](nope2.md)\n```\n")
    assert broken_links(page) == ["missing.md", "gone.png"]
    assert nav_pages([{"A": "a.md"}, {"B": [{"C": "c.md"}, "d.md"]}]) == ["a.md", "c.md", "d.md"]


def test_the_generated_reference_pages_are_current():
    """docs/cli-reference.md and docs/strategy-parameters.md equal what docs/gen_reference.py writes
    from the click app and the strategy registry now (rerun it after changing either)."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, build in gen.PAGES.items():
        assert (DOCS / name).read_text() == build(), f"docs/{name} is stale: run python docs/gen_reference.py"


def test_ci_builds_the_site_strictly():
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^mkdocs build --strict", run, re.M), ".ci/run must build the docs site strictly"
    assert re.search(r'^python -m pip install -q "\.\[docs\]"', run, re.M)


def _google_gaps(name: str, fn) -> list[str]:
    """What ``fn``'s docstring lacks: an ``Args:`` entry per parameter and a ``Returns:`` (or, for a
    context manager, ``Yields:``) section unless it returns None — read from the signature."""
    import inspect

    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "kwargs", "args")]
    args = doc.split("Args:", 1)[1].split("\n\n", 1)[0] if "Args:" in doc else ""
    missing = [f"{name}: {p}" for p in params if f"\n    {p}:" not in "\n" + args]
    if inspect.signature(fn).return_annotation not in (None, "None") and not ("Returns:" in doc or "Yields:" in doc):
        missing.append(f"{name}: Returns")
    return missing


def test_the_top_level_functions_have_google_style_sections_for_every_parameter():
    """`import ropescale`'s functions: an ``Args:`` entry per parameter (the API pages' parameter tables) and a
    ``Returns:`` section unless they return None, so a new parameter without its line fails."""
    import inspect

    import ropescale

    missing = []
    for name in ropescale.__all__:
        fn = getattr(ropescale, name)
        if inspect.isfunction(fn):
            missing += _google_gaps(name, fn)
    assert missing == []


def test_the_runs_entry_points_and_lifecycle_have_google_style_sections():
    """Each kind of run's entry point (``run_sweep``, ``run_search``, ``finetune``), the protocol and its
    lifecycle steps: the same sections, on the API pages."""
    import inspect

    from eval.search.run import run_search
    from eval.sweep import run_sweep
    from ropescale.runs import lifecycle
    from ropescale.runs.protocol import execute_run
    from ropescale.training import finetune

    fns = {"run_sweep": run_sweep, "run_search": run_search, "finetune": finetune, "execute_run": execute_run,
           **{n: inspect.unwrap(getattr(lifecycle, n)) for n in lifecycle.__all__
              if inspect.isfunction(inspect.unwrap(getattr(lifecycle, n)))}}
    assert len(fns) >= 12
    missing = [gap for name, fn in fns.items() for gap in _google_gaps(name, fn)]
    assert missing == []


def test_the_section_check_can_fail():
    def half(a: int, b: int) -> int:
        """Half documented.

        Args:
            a: documented.
        """
        return a + b

    assert _google_gaps("half", half) == ["half: b", "half: Returns"]


def _api_functions():
    """``(name, function, docstring)`` of every function the API pages render (each ``::: path`` line of
    ``docs/*.md``: a function, a class's public methods, a module's ``__all__``); an ``__init__`` is
    documented by its class's docstring or its own; a dataclass's generated ``__init__`` by the fields."""
    import importlib
    import inspect

    def resolve(path):
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
        raise AssertionError(path)

    def walk(obj, name):
        if inspect.ismodule(obj):
            for n in getattr(obj, "__all__", []):
                yield from walk(getattr(obj, n), f"{name}.{n}")
        elif inspect.isclass(obj):
            for n, member in vars(obj).items():
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if (n.startswith("_") and n != "__init__") or not inspect.isfunction(fn):
                    continue
                if fn.__code__.co_filename.startswith("<"):
                    continue  # generated (a dataclass's __init__)
                doc = inspect.getdoc(fn) or ""
                if n == "__init__":
                    doc = (inspect.getdoc(obj) or "") + "\n\n" + doc
                yield f"{name}.{n}", fn, doc
        elif inspect.isfunction(inspect.unwrap(obj)):
            yield name, inspect.unwrap(obj), inspect.getdoc(inspect.unwrap(obj)) or ""

    paths = sorted({line.split("::: ", 1)[1].strip() for page in ROOT.joinpath("docs").glob("*.md")
                    for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("::: ")})
    for path in paths:
        yield from walk(resolve(path), path)


def test_every_function_on_the_api_pages_has_google_style_sections():
    """What the API pages render gets a parameter table (``Args:``) and a ``Returns:`` / ``Yields:`` section
    wherever it returns something: a new parameter, or a newly rendered function, without them fails."""
    import inspect

    found, missing = 0, []
    for name, fn, doc in _api_functions():
        found += 1
        shown = lambda: None  # carries the signature and the docstring the page shows
        shown.__doc__ = doc
        sig = inspect.signature(fn)
        shown.__signature__ = sig.replace(return_annotation=None) if fn.__name__ == "__init__" else sig
        missing += _google_gaps(name, shown)
    assert found >= 60 and missing == []


def _undocumented(packages: tuple[str, ...] = ("ropescale", "eval")) -> list[str]:
    """Public functions and methods (properties too) of ``packages`` defined there without a docstring of
    their own or of the method they override."""
    import importlib
    import inspect
    import pkgutil

    out = []
    for pkg in packages:
        root = importlib.import_module(pkg)
        mods = [root, *(importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, f"{pkg}."))]
        for mod in mods:
            for name, obj in vars(mod).items():
                if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if inspect.isfunction(obj) and not obj.__doc__:
                    out.append(f"{mod.__name__}.{name}")
                if not inspect.isclass(obj):
                    continue
                for attr, member in vars(obj).items():
                    fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                    fn = fn.fget if isinstance(fn, property) else fn
                    if attr.startswith("_") or not inspect.isfunction(fn) or fn.__doc__:
                        continue
                    if not any(getattr(getattr(base, attr, None), "__doc__", None) for base in obj.__mro__[1:]):
                        out.append(f"{mod.__name__}.{name}.{attr}")
    return out


def test_every_public_function_has_a_docstring():
    """The library's and the harness's public functions and methods say what they do (an override takes its
    base's); 21% of the library's and 38% of the harness's had none at 1132b61."""
    assert _undocumented() == []


def test_the_docstring_walk_finds_an_undocumented_function(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("class A:\n    def f(self):\n        '''Doc.'''\n\n\nclass B(A):\n    def f(self):\n"
                              "        pass\n\n    def g(self):\n        pass\n\n\ndef h():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sorted(_undocumented(("fakepkg",))) == ["fakepkg.m.B.g", "fakepkg.m.h"]

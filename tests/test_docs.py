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

"""The code stays in small pieces: no function longer than 80 lines. ruff's C901 holds McCabe
complexity at 15 (pyproject.toml); length is the other half of the rule, and ruff has no rule for it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
FOLDERS = ("ropescale", "eval", "bench", "docs", "tests")


def long_functions(root: Path = ROOT, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function or method over ``max_lines`` lines in
    ``cli.py`` and the project's folders (decorators excluded, docstring included)."""
    files = [root / "cli.py", *(p for folder in FOLDERS for p in sorted((root / folder).rglob("*.py")))]
    out = []
    for path in files:
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines():
    assert long_functions() == []


def test_the_walk_reports_a_function_of_81_lines(tmp_path):
    (tmp_path / "ropescale").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "ropescale" / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    pass\n", encoding="utf-8")
    assert long_functions(tmp_path) == ["ropescale/m.py:1 f (81 lines)"]
    assert long_functions(tmp_path, max_lines=81) == []

"""Print the transformers versions CI's compatibility jobs test: the oldest pyproject.toml admits, the newest
release it admits, and the newest release on the package index (past the range or not), space-separated.
Reads the releases with `pip index versions`; exits 1 when the index cannot be read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version


def main() -> int:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    spec = next(Requirement(r).specifier for r in project["project"]["dependencies"]
                if Requirement(r).name == "transformers")
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"],
                         capture_output=True, text=True)
    found = re.search(r"Available versions: (.*)", out.stdout)
    if out.returncode or not found:
        return 1
    releases = sorted(Version(v) for v in found.group(1).split(", ") if not Version(v).is_prerelease)
    admitted = [v for v in releases if v in spec]
    if not admitted:
        return 1
    print(admitted[0], admitted[-1], releases[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

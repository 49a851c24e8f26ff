"""A sweep's results file, ``results.jsonl``: one record a line (``eval.schema.Record``), appended as each cell
finishes, read back to resume and to rebuild the reports."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.runs.config import error_parts
from ropescale.runs.manifest import prepare_output

from .report import write_reports
from .schema import Record

__all__ = ["RESULTS", "ResultsFileError", "append_safely", "read_results", "rebuild_reports"]

RESULTS = "results.jsonl"


class ResultsFileError(RopescaleError, ValueError):
    """A file given as results is not a ropescale ``results.jsonl``."""


def read_results(path: str | Path) -> list[dict]:
    """Records of a ``results.jsonl`` (a torn line from a killed run is skipped).

    Raises ``ResultsFileError`` (a ``ValueError``; one line) for a file that is not UTF-8 text or
    holds JSON that is not a result record."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ResultsFileError(f"{path}: not a results file (not UTF-8 text)") from None
    out = []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        try:
            Record.model_validate(record)
        except ValidationError as e:
            key, msg = error_parts(e, Record)[0]
            what = f"{key or 'record'}: {msg}"
            raise ResultsFileError(
                f"{path}: line {i} is not a ropescale result record ({what}; see eval/schema.py)") from None
        out.append(record)
    return out


def rebuild_reports(results: str | Path, output: str | Path | None = None) -> dict[str, Path]:
    """``ropescale plot``: results.csv/md and the task's plots again from a ``results.jsonl``, into
    ``output`` (default: the folder holding it); returns their paths. Raises ``InvalidInput`` (one
    line) for a path that is not a file or a file without records, ``ResultsFileError`` for one
    that is not a results file, and the output folder's refusal (``prepare_output``) — all before
    anything is written."""
    results = Path(results)
    if not results.is_file():
        raise InvalidInput(f"{results}: no such results file (a results.jsonl `ropescale eval` wrote)")
    records = read_results(results)
    if not records:
        raise InvalidInput(f"{results}: no records")
    return write_reports(records, prepare_output(Path(output or results.parent)))


def append_safely(path: Path):
    """Open ``results.jsonl`` for appending; a torn last line (killed mid-write) is ended first."""
    sink = path.open("a+", encoding="utf-8")
    sink.seek(0, 2)
    if sink.tell():
        sink.seek(sink.tell() - 1)
        if sink.read(1) != "\n":
            sink.write("\n")
    return sink

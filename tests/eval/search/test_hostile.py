"""``ropescale search`` against hostile cases, through the CLI (click's runner, or real forked processes
for kill -9 and two processes at once) on a tiny random model (T = 32, lengths 64): every bad input
is one line and exit 1 with nothing written, a search killed anywhere resumes to the uninterrupted
result, two processes on one fresh folder share it."""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import ropescale
from cli import main
from ropescale.models import REFERENCE_MODEL, load_model
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from tests.launch import PROCESSES


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    """A training book (Jonah), not a held-out one: the default held-out data is kjv-heldout."""
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("text") / "jonah.txt"
    path.write_text(dict(kjv.split("train"))["Jonah"], encoding="utf-8")
    return path


@pytest.fixture
def config(tmp_path, tiny_model_dir, train_file):
    """``config(**changes)`` → the path of a search YAML (yarn, factor 2, 4 TPE trials at 64 tokens)."""
    def make(**changes) -> str:
        raw = {"model": str(tiny_model_dir), "data": str(train_file), "strategy": "yarn", "fixed": {"factor": 2},
               "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2]}, "lengths": [64], "budget": 4,
               "max_windows": 2, "threads": 1, **changes}
        path = tmp_path / f"search-{len(list(tmp_path.glob('search-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        return str(path)

    return make


def _search(*args: str):
    return CliRunner().invoke(main, ["search", *args, "-q"])


def _one_error_line(result) -> str:
    """The one line of a refused search (exit 1); transformers' weight-loading progress bar aside."""
    lines = [x for x in result.output.splitlines() if x.strip() and "Loading weights" not in x]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


class _Forked:
    """``tests.eval.search.crash ARGS`` in a forked process — a real process, killed by a real SIGKILL,
    without an interpreter's start-up (torch, transformers and the CLI are already imported here) —
    with ``Popen``'s ``communicate`` and ``returncode``; its output in ``log``."""

    def __init__(self, log: Path, args: tuple[str, ...]):
        self.log = log
        self.proc = multiprocessing.get_context("fork").Process(target=self._run, args=(str(log), list(args)))
        self.proc.start()

    @staticmethod
    def _run(log: str, args: list[str]) -> None:
        import io
        import os

        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
        torch.set_num_threads(1)  # a fresh thread pool: the parent's OpenMP threads did not come along
        from tests.eval.search import crash

        crash.main(args)

    def communicate(self, timeout: float = 600) -> tuple[str, None]:
        self.proc.join(timeout)
        return self.log.read_text(encoding="utf-8", errors="replace"), None

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode


def _crash(log: Path, *args: str) -> _Forked:
    return _Forked(log, args)


def _table(folder: Path) -> list[dict]:
    """trials.csv without the wall-time column."""
    rows = list(csv.DictReader((folder / "trials.csv").open(encoding="utf-8")))
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_killed_during_a_trial_and_while_writing_resumes_to_the_uninterrupted_search(tmp_path, config):
    # three real kill -9s of `ropescale search`: while the manifest is written (on main a cut
    # manifest.json made the folder unusable: "unreadable manifest"), right after Optuna's ask (the
    # trial not yet tagged with its worker: on main it was never failed, and the resumed search ended
    # a trial short), then while trials.csv is written (on main the folder was left with a cut one)
    cfg = config()
    whole = tmp_path / "whole"
    assert _search(cfg, "-o", str(whole)).exit_code == 0
    out = tmp_path / "killed"
    for kill in ("manifest:1", "ask:2", "write:1"):
        proc = _crash(tmp_path / f"{kill}.log", "--kill", kill, "cli", "search", cfg, "-o", str(out), "-q")
        log = proc.communicate(timeout=600)[0]
        assert proc.returncode == -9, (kill, log)
        # whatever the kill left is whole: no cut manifest.json, trials.csv or best.json
        if (out / "manifest.json").exists():
            json.loads((out / "manifest.json").read_text(encoding="utf-8"))
        if (out / "trials.csv").exists():
            assert list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))
        if (out / "best.json").exists():
            json.loads((out / "best.json").read_text(encoding="utf-8"))
    assert not (out / "best.json").exists()  # best.json is written last
    result = _search(cfg, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "best.json").read_text()) == json.loads((whole / "best.json").read_text())
    assert _table(out) == _table(whole)
    assert [r["trial"] for r in _table(out)] == ["0", "1", "2", "3"]  # the killed trial is not a row


@PROCESSES
def test_two_processes_started_together_on_a_fresh_folder_share_it(tmp_path, config):
    # both reach the storage's creation at the same moment (a barrier): on main one of them could die
    # with "table ... already exists" / a UNIQUE constraint traceback
    cfg, out = config(budget=6), tmp_path / "shared"
    procs = [_crash(tmp_path / f"{i}.log", "--barrier", str(tmp_path / "barrier"), "cli", "search", cfg, "-o",
                    str(out), "-q") for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    rows = _table(out)
    assert 6 <= len(rows) <= 7 and all(r["state"] == "complete" for r in rows)
    assert len({r["trial"] for r in rows}) == len(rows)
    best = json.loads((out / "best.json").read_text())
    assert best["evaluations"] == len(rows)


@pytest.mark.parametrize(("damage", "words"), [("cut", "malformed"), ("random", "not a database")])
def test_a_damaged_study_db_is_one_line(tmp_path, config, damage, words):
    cfg, out = config(budget=2), tmp_path / "out"
    assert _search(cfg, "-o", str(out)).exit_code == 0
    db = out / "study.db"
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2] if damage == "cut" else bytes(range(256)) * (len(data) // 256))
    line = _one_error_line(_search(cfg, "--set", "budget=3", "-o", str(out)))
    assert words in line and str(db) in line


def test_a_model_without_rope_is_refused_before_anything_is_written(tmp_path, config):
    # on main each trial loaded the model, found no rotary embedding, was "refused by the strategy",
    # and the search ended blaming the ranges and pointing to a trials.csv it never wrote
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128)).save_pretrained(
        gpt2)
    tok.save_pretrained(gpt2)
    out = tmp_path / "out"
    line = _one_error_line(_search(config(model=str(gpt2)), "-o", str(out)))
    assert "no rotary embedding" in line and not out.exists()


def test_data_shorter_than_a_length_is_refused_before_anything_is_written_with_one_load(tmp_path, config,
                                                                                         monkeypatch):
    import ropescale.models as models  # the run's lifecycle (ropescale.runs.lifecycle) loads through it

    loads = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    out = tmp_path / "out"
    line = _one_error_line(_search(config(lengths=[4096]), "-o", str(out)))
    assert "too short for length 4096" in line and "jonah.txt" in line
    assert not out.exists() and len(loads) == 1


def test_a_search_whose_every_trial_is_refused_says_so_and_writes_the_table_it_names(tmp_path, config):
    # every candidate has beta_fast ≤ beta_slow: yarn refuses each one (a fixed value checked alone is fine)
    out = tmp_path / "out"
    line = _one_error_line(_search(config(fixed={"factor": 2, "beta_fast": 1}, search={"beta_slow": [2, 8]}),
                                   "-o", str(out)))
    assert "no usable trial in 4" in line and "4 refused by yarn" in line and "beta_fast" in line
    table = str(out / "trials.csv")
    assert table in line
    with open(table, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["state"] for r in rows] == ["refused"] * 4 and all(r["invalid"] for r in rows)


def test_a_search_whose_every_trial_is_nan_says_so(tmp_path, config):
    # cos/sin scaled by ≥ 1e20: q·k overflows float32, the attention is NaN, so is every objective.
    # On main such a trial was never counted (Optuna fails a NaN value), and the search never ended
    out = tmp_path / "out"
    line = _one_error_line(_search(config(search={"attention_factor": [1e20, 1e30]}), "-o", str(out)))
    assert "no usable trial in 4" in line and "4 measured a non-finite objective" in line and "nan" in line
    rows = list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))
    assert [r["state"] for r in rows] == ["failed"] * 4
    assert not (out / "best.json").exists()


def test_a_copy_of_the_heldout_data_is_refused_before_anything_is_written(tmp_path, config):
    from ropescale.reference import kjv

    copy = tmp_path / "my-notes.txt"
    copy.write_text(dict(kjv.split("heldout"))["Ruth"], encoding="utf-8")
    out = tmp_path / "out"
    line = _one_error_line(_search(config(data=str(copy)), "-o", str(out)))
    assert "held-out data kjv-heldout" in line and not out.exists()


def test_bad_evolution_options_are_refused_before_the_folder_is_claimed(tmp_path, config):
    # on main the manifest was written first, so the corrected rerun was refused as "another experiment"
    raw = {"strategy": "longrope", "method": "evolution", "fixed": {}, "search": None, "budget": 3}
    out = tmp_path / "out"
    line = _one_error_line(_search(config(**raw, evolution={"population": 4, "elite": 4}), "-o", str(out)))
    assert "elite=4 must be below population=4" in line and not out.exists()
    line = _one_error_line(_search(config(**raw, evolution={"population": True}), "-o", str(out)))
    assert "population=True must be an integer" in line and not out.exists()
    result = _search(config(**raw, evolution={"population": 2, "iterations": 1, "elite": 1}), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "best.json").read_text())["evaluations"] == 3


def test_trials_score_evenly_spaced_windows_as_results_md_says(tmp_path, config, tiny_model_dir, train_file):
    # the objective's windows: max_windows chunk windows of L tokens evenly spaced over all of them
    # (window k·n / max_windows, floored), not the first max_windows; results.md and the docs say so
    out = tmp_path / "out"
    assert _search(config(budget=1, max_windows=3), "-o", str(out)).exit_code == 0
    best = json.loads((out / "best.json").read_text())
    model, tok = load_model(str(tiny_model_dir), device="cpu")
    (ids,) = tokenize_documents(tok, load_documents(DataSpec(source=str(train_file))))
    n = len(ids) // 64  # chunk windows of 64 tokens, the remainder dropped

    def ppl(starts: list[int]) -> float:  # token-weighted: each window scores its 63 tokens after the first
        nll = []
        with ropescale.patch(model, "yarn", original_max_position_embeddings=32, **best["params"]), torch.no_grad():
            for s in starts:
                w = ids[s:s + 64][None]
                nll.append(torch.nn.functional.cross_entropy(model(w).logits[0, :-1].float(), w[0, 1:],
                                                             reduction="sum"))
        return math.exp(float(sum(nll)) / (63 * len(starts)))

    even = ppl([64 * (k * n // 3) for k in range(3)])
    first = ppl([0, 64, 128])
    assert math.isclose(best["ppl"]["64"], even, rel_tol=1e-5)
    assert not math.isclose(best["ppl"]["64"], first, rel_tol=1e-3)
    assert "3 windows per length, evenly spaced over the split" in (out / "results.md").read_text()


def test_an_evolution_whose_every_value_is_nan_says_so(tmp_path, config):
    # the evolution counts a NaN value as +inf; on main it then wrote the "best" of all-NaN candidates
    raw = {"strategy": "longrope", "method": "evolution", "search": None, "budget": 2,
           "fixed": {"attention_factor": 1e25}, "evolution": {"population": 2, "iterations": 1, "elite": 1}}
    out = tmp_path / "out"
    line = _one_error_line(_search(config(**raw), "-o", str(out)))
    assert "no usable evaluation in 2" in line and "evolution.jsonl" in line
    assert not (out / "best.json").exists()


@pytest.mark.parametrize(("output", "words"), [
    (lambda dim, shift: ropescale.RopeFrequencies(torch.full((dim // 2,), float("nan")), 1.0),
     "returned inv_freq[0] = nan"),
    (lambda dim, shift: [shift] * (dim // 2), "returned list, not RopeFrequencies"),
], ids=["nan", "list"])
def test_a_strategy_whose_output_is_not_frequencies_is_refused_before_anything_is_written(tmp_path, config, output,
                                                                                          words):
    """A (plugin) strategy returning NaN frequencies or a list: on main the search claimed its folder (manifest,
    study.db) and was refused at its first trial. Now its output is computed on the model first."""
    from ropescale.strategies.registry import REGISTRY

    try:
        ropescale.register("bad_output_search_test", params=(ropescale.Param("shift", 1.0, low=0.5, high=2.0),),
                           source="a test")(output)
        out = tmp_path / "out"
        line = _one_error_line(_search(config(strategy="bad_output_search_test", fixed={}, search={"shift": None}),
                                       "-o", str(out)))
        assert not out.exists(), line
        assert "strategy: bad_output_search_test, computed on the model before the search" in line and words in line
    finally:
        REGISTRY.pop("bad_output_search_test", None)


def test_an_evolution_whose_initial_individual_the_strategy_refuses_writes_nothing(tmp_path, config):
    # a fixed short_factor of 2 entries for a rotary dim of 16 (8 pairs): longrope refuses it when computed —
    # on main at the first evaluation, after the manifest was written
    raw = {"strategy": "longrope", "method": "evolution", "search": None, "budget": 2,
           "fixed": {"short_factor": [1.0, 1.0]}, "evolution": {"population": 2, "iterations": 1, "elite": 1}}
    out = tmp_path / "out"
    line = _one_error_line(_search(config(**raw), "-o", str(out)))
    assert "short_factor has 2 entries; the model's rotary dim 16 needs 8" in line and not out.exists()

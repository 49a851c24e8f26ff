import json
import math
import re

import pytest
import torch

from eval.config import build_config
from eval.sweep import RESULTS, cell_id, read_results, resolve_cells, run_sweep
from ropescale.errors import InvalidInput
from ropescale.runs.manifest import ExperimentMismatchError
from ropescale.runs.windows import WindowError
from ropescale.strategies import RopeFrequencies


def config(model_dir, data, **kw):
    return build_config({"model": str(model_dir), "data": str(data), "lengths": [32, 64],
                         "strategies": ["vanilla", "yarn", "dynamic_ntk"], "max_windows": 6,
                         "device": "cpu", **kw})


def test_sweep_writes_every_cell_and_reports(tmp_path, tiny_model_dir, text_file):
    records = run_sweep(config(tiny_model_dir, text_file), tmp_path, progress=False)
    assert [(r["strategy"], r["length"]) for r in records] == [
        ("vanilla", 32), ("yarn", 32), ("dynamic_ntk", 32), ("vanilla", 64), ("yarn", 64), ("dynamic_ntk", 64)]
    for r in records:
        for key in ("strategy", "params", "length", "ppl", "nll", "tokens", "mode", "model", "data", "env"):
            assert key in r
        assert math.isclose(r["ppl"], math.exp(r["nll"]))
        assert r["env"]["torch"] and r["env"]["transformers"]
    # the same tokens for every strategy at a length; factor filled as L / L_train
    assert len({r["tokens"] for r in records if r["length"] == 64}) == 1
    assert records[4]["params"]["factor"] == 2.0 and records[1]["params"]["factor"] == 1.0
    assert records[2]["dynamic"].startswith("one scale per window")
    # at L = L_train yarn (factor 1) and dynamic NTK are vanilla
    assert records[2]["ppl"] == records[0]["ppl"]
    assert math.isclose(records[1]["ppl"], records[0]["ppl"], rel_tol=1e-6)
    assert records[3]["ppl"] != records[4]["ppl"]
    for name in ("results.csv", "results.md", "ppl_vs_length.png", "nll_vs_position.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "results.md").read_text()
    assert "| strategy | 32 (T) | 64 (2T) |" in md and "| yarn |" in md


def test_rerun_resumes_and_skips_finished_cells(tmp_path, tiny_model_dir, text_file):
    cfg = config(tiny_model_dir, text_file)
    first = run_sweep(cfg, tmp_path, progress=False)
    path = tmp_path / RESULTS
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    run_sweep(cfg, tmp_path, progress=False)
    assert path.read_text().splitlines() == lines  # nothing recomputed
    # simulate a run killed in the middle of writing the 5th cell
    path.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    again = run_sweep(cfg, tmp_path, progress=False)
    recs = read_results(path)
    assert len(recs) == 6  # 4 kept + 2 recomputed (torn line ignored)
    assert [r["ppl"] for r in again] == [r["ppl"] for r in first]
    # more strategies are more cells of the same experiment; another setting is another experiment
    run_sweep(config(tiny_model_dir, text_file, strategies=["vanilla", "yarn", "dynamic_ntk", "ntk"]), tmp_path,
              progress=False)
    assert len(read_results(path)) == 8
    with pytest.raises(ExperimentMismatchError,
                       match="holds another experiment \\(options: .*'max_windows': 3.* now, "
                             ".*'max_windows': 6.* in the folder\\); give a new output folder"):
        run_sweep(config(tiny_model_dir, text_file, max_windows=3), tmp_path, progress=False)
    assert len(read_results(path)) == 8


def test_a_finished_cell_whose_defaults_changed_is_refused_not_reused(tmp_path, tiny_model_dir, text_file):
    """A cell's id hashes the parameters given, so a strategy default that changed since a cell was measured
    leaves the same id: its record (here yarn's beta_fast as if the default had been 16) is refused in one line,
    and the folder is left as it was."""
    cfg = config(tiny_model_dir, text_file, strategies=["vanilla", "yarn"])
    run_sweep(cfg, tmp_path, progress=False)
    path = tmp_path / RESULTS
    records = [json.loads(line) for line in path.read_text().splitlines()]
    stale = next(r for r in records if r["strategy"] == "yarn" and r["length"] == 64)
    assert stale["params"]["beta_fast"] == 32
    stale["params"]["beta_fast"] = 16
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = path.read_text()
    with pytest.raises(InvalidInput, match=r"yarn at 64 was measured with .*'beta_fast': 16.*; it now resolves to "
                                           r".*'beta_fast': 32.* \(a default changed\): write to a new output folder"):
        run_sweep(cfg, tmp_path, progress=False)
    assert path.read_text() == before


def test_sliding_mode_and_bos(tmp_path, tiny_model_dir, text_file):
    cfg = config(tiny_model_dir, text_file, mode="sliding", stride=16, add_bos=True, lengths=[32],
                 strategies=["vanilla"], max_windows=None)
    (r,) = run_sweep(cfg, tmp_path, progress=False)
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tiny_model_dir)(text_file.read_text(), add_special_tokens=False)["input_ids"])
    assert r["tokens"] == n and r["stride"] == 16 and r["add_bos"]


def test_dataset_too_short(tmp_path, tiny_model_dir):
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.")
    with pytest.raises(WindowError, match="dataset too short for length 32: the longest document has 11 tokens"):
        run_sweep(config(tiny_model_dir, short), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "results.jsonl").exists()  # failed before any cell ran


def test_logn_cells_are_separate_and_only_act_past_the_window(tmp_path, tiny_model_dir, text_file):
    cfg = config(tiny_model_dir, text_file, strategies=["vanilla", "vanilla:logn=true"])
    r = {(x["strategy"], x["length"]): x for x in run_sweep(cfg, tmp_path, progress=False)}
    assert r[("vanilla+logn", 64)]["logn"] and not r[("vanilla", 64)]["logn"]
    assert math.isclose(r[("vanilla+logn", 32)]["ppl"], r[("vanilla", 32)]["ppl"], rel_tol=1e-6)
    assert r[("vanilla+logn", 64)]["ppl"] != r[("vanilla", 64)]["ppl"]
    # what each strategy did per layer, in the manifest: the temperature column says log-n was added
    patches = json.loads((tmp_path / "manifest.json").read_text())["patches"]
    assert {r["temperature"] for r in patches["vanilla+logn"]} == {"logn (added)"}
    assert {r["temperature"] for r in patches["vanilla"]} == {""}
    assert [r["applied"] for r in patches["vanilla"]] == ["vanilla"]  # the tiny model's one layer
    run_sweep(cfg, tmp_path, progress=False)  # a rerun resumes every cell and keeps the record
    assert json.loads((tmp_path / "manifest.json").read_text())["patches"] == patches


def test_a_sweep_writes_its_reports_under_an_ascii_locale(tmp_path):
    """Reports are UTF-8 whatever the machine's locale (results.md's header line holds '—'; under
    LC_ALL=C with UTF-8 mode off the write failed with an 'ascii' codec error)."""
    import os
    import subprocess
    import sys

    out_dir = tmp_path / "π-run"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    cmd = [sys.executable, "cli.py", "sweep", "--model", "reference", "--data", "kjv-heldout", "--strategy", "vanilla",
           "--lengths", "128", "--max-windows", "2", "--output", str(out_dir), "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.getcwd(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out_dir / "results.md").read_text(encoding="utf-8").startswith("Task `perplexity` — model `reference`")


@pytest.mark.parametrize("strategy,message", [
    # T = 32: DCA's local_window defaults to T // 8 = 4, STRING's S to int(0.33 T) = 10
    ("dca:chunk_size=3", "strategy dca:chunk_size=3 at length 32 (training window T = 32): dca: local_window=4 "
                         "must be below chunk_size=3 (both in tokens)"),
    ("string:local_window=12", "strategy string:local_window=12 at length 32 (training window T = 32): string: "
                               "local_window=12 must be below shifted_offset=10 (both in tokens)"),
    ("leaky_rerope:window=40,target_length=64", "leaky_rerope: window=40 leaves no room below T=32"),
])
def test_every_cell_is_checked_before_anything_is_written(tmp_path, tiny_model_dir, text_file, strategy, message):
    """A strategy whose parameters fail only with the training window (defaults derived from T)
    is refused before the output folder, the manifest or the first cell — not after the cells
    before it were computed."""
    cfg = config(tiny_model_dir, text_file, strategies=["vanilla", strategy], lengths=[32, 64])
    with pytest.raises(InvalidInput, match=re.escape(message)) as e:
        run_sweep(cfg, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_resolve_cells_fills_and_checks_every_cell(tiny_model_dir, text_file):
    cfg = config(tiny_model_dir, text_file, strategies=["yarn", "dca:local_window=2"])
    cells = resolve_cells(cfg, 32)
    assert cells["yarn", 64]["factor"] == 2.0 and cells["dca:local_window=2", 64]["scale"] == 2.0
    assert cells["dca:local_window=2", 32] == {"chunk_size": None, "local_window": 2, "scale": 1.0,
                                              "vllm_temperature": False}


def test_numpy_numbers_in_a_python_config_make_the_same_cells(tiny_model_dir, text_file):
    """A config built in Python may hold numpy numbers (a search script's): they are numbers, and
    the cell ids (JSON) are those of the Python values."""
    import numpy as np

    plain = config(tiny_model_dir, text_file, strategies=[{"name": "dca", "chunk_size": 16, "scale": 2.0}])
    numpy = config(tiny_model_dir, text_file, strategies=[{"name": "dca", "chunk_size": np.int64(16),
                                                           "scale": np.float32(2.0)}])
    assert numpy.strategies[0].display == plain.strategies[0].display == "dca:chunk_size=16,scale=2.0"
    assert cell_id("e", numpy.strategies[0], 32) == cell_id("e", plain.strategies[0], 32)


def test_a_length_refused_when_its_examples_are_built_leaves_the_folder_free(tmp_path, tiny_model_dir):
    """A passkey length too short for the prompt is found when the examples are built, after the
    model loads: the folder was already claimed, so the corrected rerun was refused as another
    experiment (issue 26)."""
    raw = {"task": "passkey", "model": str(tiny_model_dir), "strategies": ["vanilla"], "device": "cpu",
           "passkey": {"trials": 1, "depths": [0.5], "digits": 3, "candidates": 2}}
    with pytest.raises(ValueError, match="length 8 is too short for this prompt"):
        run_sweep(build_config({**raw, "lengths": [8]}), tmp_path, progress=False)
    assert not (tmp_path / "manifest.json").exists()
    records = run_sweep(build_config({**raw, "lengths": [64]}), tmp_path, progress=False)
    assert [r["length"] for r in records] == [64]


def test_rebuild_reports_refuses_a_file_without_records_before_writing(tmp_path):
    """`ropescale plot`'s body (moved out of cli.py, issue 30): nothing to plot is one line, no folder made."""
    from eval.sweep import rebuild_reports

    empty = tmp_path / "results.jsonl"
    empty.write_text("")
    with pytest.raises(InvalidInput, match=r"results.jsonl: no records$"):
        rebuild_reports(empty, tmp_path / "plots")
    with pytest.raises(InvalidInput, match=r"no such results file"):
        rebuild_reports(tmp_path / "missing.jsonl", tmp_path / "plots")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def test_kl_cells_report_the_short_context_cost(tmp_path, sharp_model_dir, text_file):
    """``perplexity: {kl: true}``: every cell records KL(P_unpatched ‖ P_patched); vanilla's is 0, at
    L ≤ T linear ×2 moves the distributions (what a static factor costs short prompts) and
    dynamic NTK (s = 1 there) does not; results.md gets the KL tables and kl_vs_length.png is drawn.
    Turning kl on is another experiment; off, folders from before it resume."""
    from eval.engines.vllm.scoring import check_engine
    from eval.tasks.perplexity import PerplexityOptions
    from ropescale.runs.config import ConfigError

    cfg = config(sharp_model_dir, text_file, strategies=["vanilla", "linear:factor=2", "dynamic_ntk"],
                 perplexity={"kl": True, "kl_first_tokens": 8})
    records = {(r["strategy"], r["length"]): r for r in run_sweep(cfg, tmp_path, progress=False)}
    for length in (32, 64):
        assert records[("vanilla", length)]["kl"] == 0.0
        assert records[("linear:factor=2", length)]["kl"] > 1e-6
        assert records[("linear:factor=2", length)]["kl_first"] > 0
    assert records[("dynamic_ntk", 32)]["kl"] == 0.0 and records[("dynamic_ntk", 64)]["kl"] > 0
    assert all(r["kl_first_tokens"] == 8 and "kl" in r["nll_by_position"][0] for r in records.values())
    md = (tmp_path / "results.md").read_text()
    assert "**KL(P_unpatched ‖ P_patched)** [nats/token], each window's first 8 predictions" in md
    assert (tmp_path / "kl_vs_length.png").stat().st_size > 0
    assert "kl" not in PerplexityOptions().key() and PerplexityOptions(kl=True).key()["kl"] is True
    with pytest.raises(ConfigError, match="perplexity: kl: .*an engine returns the target's log-probability only"):
        check_engine(build_config({"model": str(sharp_model_dir), "lengths": [32], "strategies": ["yarn"],
                                   "engine": "vllm", "perplexity": {"kl": True}}))


def test_profiles_score_each_cell_as_the_static_factor_the_rule_picks(tmp_path, tiny_model_dir, text_file):
    """``{name: yarn, profiles: [1, 2, 4]}`` (T = 32): a cell of L tokens is scored as static YaRN at the
    smallest factor whose reach covers L (1 at 32, 2 at 64, 4 at 128 and past it), the same numbers as
    the static cells; its cells are not the static ones (the rule is part of their identity)."""
    from ropescale.runs.config import parse_strategy

    lengths = [32, 64, 128, 256]
    static = ["yarn:factor=1", "yarn:factor=2", "yarn:factor=4"]
    cfg = config(tiny_model_dir, text_file, lengths=lengths, strategies=[{"name": "yarn", "profiles": [4, 1, 2]},
                                                                           *static], max_windows=2)
    records = {(r["strategy"], r["length"]): r for r in run_sweep(cfg, tmp_path, progress=False)}
    picked = {32: 1, 64: 2, 128: 4, 256: 4}
    for length, factor in picked.items():
        mine = records[("yarn+profiles=1/2/4", length)]
        assert mine["params"]["factor"] == factor
        assert mine["ppl"] == records[(f"yarn:factor={factor}", length)]["ppl"]
    assert records[("yarn+profiles=1/2/4", 64)]["ppl"] != records[("yarn:factor=4", 64)]["ppl"]
    assert parse_strategy("yarn:profiles=[1,2,4],beta_fast=16").profiles == [1.0, 2.0, 4.0]
    for entry, words in (({"name": "dynamic_ntk", "profiles": [1, 2]}, "no static scale factor|none"),
                         ({"name": "yarn", "factor": 2, "profiles": [1, 2]}, "leave factor out"),
                         ({"name": "yarn", "profiles": [1, True]}, "True is not a scale factor")):
        with pytest.raises(ValueError, match=words):
            parse_strategy(entry)


def test_the_reports_show_every_cell_of_the_folder_not_only_this_runs(tmp_path, tiny_model_dir, text_file):
    """`--lengths 64` then `--lengths 32` into one folder: results.jsonl held both, results.md and
    results.csv only the second run's column. Now they are made from every record of the experiment."""
    import csv

    first = run_sweep(config(tiny_model_dir, text_file, lengths=[64], strategies=["vanilla", "yarn"]), tmp_path,
                      progress=False)
    second = run_sweep(config(tiny_model_dir, text_file, lengths=[32], strategies=["vanilla", "linear"]), tmp_path,
                       progress=False)
    assert [(r["strategy"], r["length"]) for r in second] == [("vanilla", 32), ("linear", 32)]  # this run's cells
    md = (tmp_path / "results.md").read_text()
    assert "| strategy | 32 (T) | 64 (2T) |" in md
    by_cell = {(r["strategy"], r["length"]): r["ppl"] for r in first + second}
    for (strategy, length), ppl in by_cell.items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {strategy} |"))
        assert f"{ppl:.2f}" in row, (strategy, length)
    assert "| yarn |  | " in md  # yarn ran at 64 only: its 32 column is empty
    with (tmp_path / "results.csv").open(encoding="utf-8") as f:
        rows = {(r["strategy"], int(r["length"])): float(r["ppl"]) for r in csv.DictReader(f)}
    assert rows == pytest.approx(by_cell) and len(rows) == 4


def _ones(dim):
    return torch.ones(dim // 2)  # [d/2]: valid frequencies


@pytest.mark.parametrize(("fn", "length", "message"), [
    (lambda dim: RopeFrequencies(torch.full((dim // 2,), float("nan")), 1.0), 32, r"returned inv_freq\[0\] = nan"),
    (lambda dim: RopeFrequencies(torch.ones(dim), 1.0), 32, r"returned inv_freq of shape \[16\]; expected \[8\]"),
    (lambda dim: RopeFrequencies(_ones(dim), float("nan")), 32, r"returned attention_factor = nan"),
    (lambda dim: _ones(dim).tolist(), 32, r"returned list, not RopeFrequencies"),
    # dynamic, and wrong only past T = 32: found at length 64 (a forward of 64 tokens), not only at T
    (lambda dim, seq_len: RopeFrequencies(_ones(dim) * (float("nan") if seq_len > 32 else 1.0), 1.0), 64,
     r"returned inv_freq\[0\] = nan"),
], ids=["nan", "shape", "nan_factor", "list", "late_nan"])
def test_a_strategy_whose_output_is_not_frequencies_is_refused_before_the_folder(tmp_path, tiny_model_dir, text_file,
                                                                                 fn, length, message):
    """A (plugin) strategy returning NaN frequencies, a wrong inv_freq shape, a NaN attention factor or a list
    was refused in one line only at its first cell — after the folder, its manifest and the cells before
    (vanilla's) were written. Now every cell's strategy is computed on the model before the manifest: one
    line naming the cell, and no folder."""
    from ropescale.strategies.registry import REGISTRY, register

    try:
        register("bad_output_sweep_test", source="a test")(fn)
        cfg = config(tiny_model_dir, text_file, strategies=["vanilla", "bad_output_sweep_test"])
        with pytest.raises(InvalidInput, match=rf"^strategy bad_output_sweep_test at length {length} \(training "
                                               r"window T = 32\): strategy 'bad_output_sweep_test' .*" + message) as e:
            run_sweep(cfg, tmp_path / "out", progress=False)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()
    finally:
        REGISTRY.pop("bad_output_sweep_test", None)


def test_a_cell_rotating_bit_for_bit_as_a_measured_one_takes_its_numbers(tmp_path, tiny_model_dir, text_file):
    """Inside the window, linear and ntk at factor 1 leave the rotation vanilla leaves: their cells carry vanilla's
    numbers with ``same_as`` and run nothing; the numbers equal those of the cell measured alone; past the window
    (factor 2) they run."""
    base = {"model": str(tiny_model_dir), "data": str(text_file), "max_windows": 2, "device": "cpu"}
    records = run_sweep(build_config({**base, "lengths": [32, 64], "strategies": ["vanilla", "linear", "ntk",
                                                                                  "rerope"]}),
                        tmp_path / "run", progress=False)
    by = {(r["strategy"], r["length"]): r for r in records}
    for name in ("linear", "ntk"):
        assert by[name, 32]["same_as"] == "vanilla" and by[name, 32]["seconds"] == 0.0
        assert by[name, 32]["ppl"] == by["vanilla", 32]["ppl"] and by[name, 32]["params"]["factor"] == 1
        assert "same_as" not in by[name, 64] and by[name, 64]["ppl"] != by["vanilla", 64]["ppl"]
    assert "same_as" not in by["rerope", 32] and "rotation" not in by["rerope", 32]
    alone = run_sweep(build_config({**base, "lengths": [32], "strategies": ["linear"]}), tmp_path / "alone",
                      progress=False)
    assert alone[0]["ppl"] == pytest.approx(by["linear", 32]["ppl"], rel=1e-12) and "same_as" not in alone[0]


def test_each_cells_parameters_are_resolved_once_when_the_sweep_prepares(tmp_path, tiny_model_dir, text_file,
                                                                          monkeypatch):
    """A cell is one object (``eval.cells.Cell``) resolved in ``prepare`` and handed whole to what scores it:
    ``Strategy.resolve`` runs once per cell there, besides the check before anything loads (the config's T,
    refusing a bad cell before the folder exists). Before issue 54 the scoring of each cell resolved it again."""
    from ropescale.runs.config import StrategySpec

    calls = []
    resolve = StrategySpec.resolve

    def counted(self, **kw):
        calls.append((self.display, kw["length"]))
        return resolve(self, **kw)

    monkeypatch.setattr(StrategySpec, "resolve", counted)
    records = run_sweep(config(tiny_model_dir, text_file, max_windows=1), tmp_path, progress=False)
    cells = [(r["strategy"], r["length"]) for r in records]
    assert sorted(calls) == sorted(cells * 2)
    calls.clear()
    run_sweep(config(tiny_model_dir, text_file, max_windows=1), tmp_path, progress=False)  # every cell done
    assert sorted(calls) == sorted(cells)  # the check only: nothing left to prepare

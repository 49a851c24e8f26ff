"""The one run protocol (``ropescale.runs.protocol``): the order of its steps, written out here as the
module's contract says it (the oracle), walked by a recording kind; a refused run leaving nothing
behind; and no module outside ``ropescale/runs/`` ordering those steps itself."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from eval.config import build_config
from eval.sweep import run_sweep
from ropescale.errors import InvalidInput
from ropescale.runs.lifecycle import claimed_folder
from ropescale.runs.manifest import LOCK, MANIFEST, ExperimentMismatchError
from ropescale.runs.protocol import RunKind, execute_run

ROOT = Path(__file__).resolve().parents[2]

HELD = ["check", "identity", "manifest checked", "prepare", "manifest written", "execute", "finish"]
SHARED = ["check", "identity", "prepare", "manifest written", "claim", "execute", "finish"]


class Recording(RunKind):
    """A kind that records each step and what the folder held when it ran."""

    def __init__(self, model_dir, data, *, fields=None, refuse_in=None, shares=False):
        self.cfg = build_config({"model": str(model_dir), "data": str(data), "lengths": [32],
                                 "strategies": ["vanilla"], "device": "cpu"})
        self.steps, self.fields, self.refuse_in = [], fields or {"task": "recording"}, refuse_in
        self.shares_folder = shares

    def _step(self, name, folder=None):
        if folder is not None and (folder.path / MANIFEST).is_file() and "manifest written" not in self.steps:
            self.steps.append("manifest written")
        self.steps.append(name)
        if name == self.refuse_in:
            raise InvalidInput(f"refused in {name}")

    def check(self):
        self._step("check")

    def identity(self, inputs):
        self._step("identity")
        return self.fields, inputs.docs

    def prepare(self, inputs, folder):
        if folder is not None:  # held: the folder's experiment is known (checked) before preparing
            assert len(folder.experiment) == 12 and not (folder.path / MANIFEST).is_file()
            self.steps.append("manifest checked")
        self._step("prepare", folder)

    def claim(self, folder):
        self._step("claim", folder)

    def execute(self, folder):
        self._step("execute", folder)
        return "executed"

    def finish(self, folder, result):
        assert result == "executed"
        self._step("finish", folder)
        return "done"


def test_a_held_folder_is_claimed_checked_prepared_then_written(tmp_path, tiny_model_dir, text_file):
    kind = Recording(tiny_model_dir, text_file)
    assert execute_run(kind, tmp_path / "run") == "done"
    assert kind.steps == HELD
    assert json.loads((tmp_path / "run" / MANIFEST).read_text())["identity"]["task"] == "recording"


def test_a_shared_folder_is_prepared_before_it_is_touched(tmp_path, tiny_model_dir, text_file):
    kind = Recording(tiny_model_dir, text_file, shares=True, refuse_in="prepare")
    with pytest.raises(InvalidInput, match="refused in prepare"):
        execute_run(kind, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    kind = Recording(tiny_model_dir, text_file, shares=True)
    assert execute_run(kind, tmp_path / "run") == "done"
    assert kind.steps == SHARED


@pytest.mark.parametrize("step", ["check", "identity", "prepare"])
def test_a_run_refused_before_its_manifest_leaves_no_folder(tmp_path, tiny_model_dir, text_file, step):
    out = tmp_path / "a" / "b" / "run"  # parents created by the claim go too
    with pytest.raises(InvalidInput, match=f"refused in {step}"):
        execute_run(Recording(tiny_model_dir, text_file, refuse_in=step), out)
    assert not (tmp_path / "a").exists()


def test_a_refused_run_keeps_a_folder_it_did_not_create_and_what_was_written(tmp_path, tiny_model_dir, text_file):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInput):
        execute_run(Recording(tiny_model_dir, text_file, refuse_in="prepare"), out)
    assert sorted(p.name for p in out.iterdir()) == [LOCK, "notes.txt"]
    # refused in execution, after the manifest: the folder holds the run, kept
    with pytest.raises(InvalidInput):
        execute_run(Recording(tiny_model_dir, text_file, refuse_in="execute"), tmp_path / "later")
    assert (tmp_path / "later" / MANIFEST).is_file()


def test_tidy_removes_nothing_it_did_not_create(tmp_path):
    with pytest.raises(RuntimeError), claimed_folder(tmp_path / "x", tidy=True) as folder:
        (folder / "partial.jsonl").write_text("{}")
        raise RuntimeError("stopped")
    assert (tmp_path / "x" / "partial.jsonl").is_file()


def test_another_experiment_is_refused_before_the_model_loads(tmp_path, tiny_model_dir, text_file):
    execute_run(Recording(tiny_model_dir, text_file), tmp_path / "run")
    other = Recording(tiny_model_dir, text_file, fields={"task": "another"})
    with pytest.raises(ExperimentMismatchError):
        execute_run(other, tmp_path / "run")
    assert other.steps == ["check", "identity"]  # not prepared: no model loaded for a folder that refuses it


def test_a_refused_sweep_leaves_no_folder(tmp_path, tiny_model_dir, text_file):
    """Before the protocol, a sweep whose task refused a length (here: windows longer than the data)
    left an empty folder with a lock file behind."""
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [1 << 16],
                        "strategies": ["vanilla"], "device": "cpu", "original_max_position_embeddings": 64})
    with pytest.raises(ValueError):
        run_sweep(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_runs_threads_hold_for_the_run_and_the_count_before_is_back(tmp_path, tiny_model_dir, text_file):
    """``threads`` set torch's thread count for the whole process (torch.set_num_threads) and left it there
    when the run ended — a notebook's or a test's next computation ran on the run's count. Now it holds
    from check to finish, and the count before is back after a run, a refused one and a failed one."""
    torch.set_num_threads(2)  # the count before (tests/conftest.py puts the test's own back)
    seen = []

    class Counting(Recording):
        def check(self):
            seen.append(torch.get_num_threads())
            super().check()

        def execute(self, folder):
            seen.append(torch.get_num_threads())
            return super().execute(folder)

    for i, refuse_in in enumerate([None, "prepare", "execute"]):
        kind = Counting(tiny_model_dir, text_file, refuse_in=refuse_in)
        kind.cfg = kind.cfg.model_copy(update={"threads": 1})
        try:
            execute_run(kind, tmp_path / f"run{i}")
        except InvalidInput:
            assert refuse_in is not None
        assert torch.get_num_threads() == 2, refuse_in
    assert seen == [1, 1, 1, 1, 1]  # check and execute; check only when refused in prepare
    # the three kinds that set it themselves before: a sweep, a refused sweep, a search, a fine-tuning
    sweep = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["vanilla"],
             "device": "cpu", "max_windows": 2, "threads": 1}
    run_sweep(build_config(sweep), tmp_path / "sweep", progress=False)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="too short"):  # refused once the model is loaded
        run_sweep(build_config({**{k: v for k, v in sweep.items() if k not in ("data", "max_windows")},
                                "task": "passkey", "lengths": [8], "passkey": {"trials": 1}}),
                  tmp_path / "refused", progress=False)
    assert torch.get_num_threads() == 2
    from eval.search.config import build_search_config
    from eval.search.run import run_search
    from ropescale.reference import kjv
    from ropescale.training import build_finetune_config, finetune

    jonah = tmp_path / "jonah.txt"  # a training book: the search refuses held-out text
    jonah.write_text(dict(kjv.split("train"))["Jonah"], encoding="utf-8")
    run_search(build_search_config({"model": str(tiny_model_dir), "data": str(jonah), "strategy": "yarn",
                                    "fixed": {"factor": 2}, "search": {"beta_fast": [4, 64]}, "lengths": [64],
                                    "budget": 1, "max_windows": 2, "threads": 1, "device": "cpu"}),
               tmp_path / "search", progress=False)
    assert torch.get_num_threads() == 2
    finetune(build_finetune_config({"model": str(tiny_model_dir), "strategy": "linear", "data": str(text_file),
                                    "length": 64, "steps": 1, "batch_size": 1, "device": "cpu", "threads": 1}),
             tmp_path / "finetune", progress=False)
    assert torch.get_num_threads() == 2


STEPS = {"claimed_folder", "check_manifest", "run_identity", "load_inputs"}


def _called(path: Path) -> set[str]:
    """The names of the protocol's steps that ``path`` calls or imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names & STEPS


def test_no_module_outside_runs_orders_the_lifecycle():
    files = [*ROOT.joinpath("ropescale").rglob("*.py"), *ROOT.joinpath("eval").rglob("*.py"), ROOT / "cli.py"]
    offenders = {str(p.relative_to(ROOT)): sorted(_called(p)) for p in files
                 if "runs" not in p.relative_to(ROOT).parts[:2] and _called(p)}
    assert offenders == {}


def test_the_layout_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ropescale.runs.lifecycle import claimed_folder\nwith claimed_folder('x'):\n    pass\n")
    assert _called(bad) == {"claimed_folder"}

"""``report_to``: a fine-tuning run reports to accelerate's trackers (TensorBoard here, offline) the
numbers it writes to log.jsonl; an unknown or missing tracker is one line before anything is written."""

from __future__ import annotations

import json

import pytest

from ropescale.runs.config import ConfigError
from ropescale.training import build_finetune_config, finetune
from ropescale.training.report import read_log


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard holds under ``folder``, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_tensorboard_holds_what_log_jsonl_holds(tmp_path, tiny_run):
    pytest.importorskip("tensorboard")
    summary = finetune(build_finetune_config(tiny_run(report_to="tensorboard")), tmp_path / "run", progress=False)
    assert summary["steps"] == 4
    log = read_log(tmp_path / "run")
    got = _scalars(tmp_path / "run")
    losses = [(r["step"], r["loss"]) for r in log if "loss" in r]
    assert [s for s, _ in got["loss"]] == [s for s, _ in losses]
    assert [v for _, v in got["loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)  # float32 in the file
    ppl = [(r["step"], r["ppl"]["64"]) for r in log if "ppl" in r]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in ppl] == got["ppl/64"]
    assert {"lr", "tokens_per_s"} <= set(got)


def test_the_run_is_the_same_run_with_or_without_trackers(tmp_path, tiny_run):
    """report_to is where a run is watched from, not what it trains: a run resumes across it."""
    a = build_finetune_config(tiny_run()).identity()
    b = build_finetune_config(tiny_run(report_to=["tensorboard"])).identity()
    assert a == b


@pytest.mark.parametrize("value,match", [
    ("tensorbored", "unknown tracker 'tensorbored'; accelerate's trackers: aim, clearml"),
    ([1], "a tracker name or a list of them"),
])
def test_a_bad_tracker_is_one_line(tmp_path, tiny_run, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_finetune_config(tiny_run(report_to=value))
    assert "\n" not in str(err.value)


def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_written(tmp_path, tiny_run, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"report_to: wandb is not installed \(pip install wandb\)"):
        finetune(build_finetune_config(tiny_run(report_to="wandb")), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("blocked", ["file", "read-only"])
def test_a_tracker_folder_that_cannot_be_written_is_one_line_before_training(tmp_path, tiny_run, monkeypatch,
                                                                              blocked):
    """TensorBoard's folder (<output>/<output name>) taken by a file, or on a read-only file system, was
    accelerate's ``AttributeError: 'TensorBoardTracker' object has no attribute 'writer'``."""
    pytest.importorskip("tensorboard")
    import errno

    from ropescale.errors import OutputError

    out = tmp_path / "run"
    out.mkdir()
    if blocked == "file":
        (out / "run").write_text("")
    else:  # as the OS says it where the folder cannot be made
        import torch.utils.tensorboard

        def read_only(logdir, *a, **k):
            raise OSError(errno.EROFS, "Read-only file system", logdir)

        monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", read_only)
    raw = tiny_run(steps=1, eval=None, report_to="tensorboard")
    with pytest.raises(OutputError) as err:
        finetune(build_finetune_config(raw), out, progress=False)
    why = "a file is in its place" if blocked == "file" else "Read-only file system"
    assert str(err.value) == (f"report_to: tensorboard cannot write its logs in {out / 'run'} ({why}); make that a "
                              "writable folder or leave report_to out")
    assert not (out / "log.jsonl").exists()  # before the first step
    if blocked == "file":  # nothing left behind that refuses the corrected rerun
        (out / "run").unlink()
        assert finetune(build_finetune_config(raw), out, progress=False)["steps"] == 1
        assert [step for step, _ in _scalars(out)["loss"]] == [1]


def _read_only(monkeypatch, folder) -> list[str]:
    """The file system under ``folder`` (which exists: a mount point) made read-only as the OS says it: every
    open for writing there (``io.open``, which ``Path.open`` and TensorBoard's file writer use, and ``os.open``)
    raises ``OSError(EROFS)``. Returns the list the refused paths are added to."""
    import errno
    import io
    import os

    refused: list[str] = []

    def under(file) -> str | None:
        if isinstance(file, int):
            return None
        path = os.path.abspath(os.fsdecode(os.fspath(file)))
        return path if os.path.commonpath([path, str(folder)]) == str(folder) else None

    def refuse(path: str):
        refused.append(path)
        raise OSError(errno.EROFS, "Read-only file system", path)

    real_io, real_os = io.open, os.open

    def io_open(file, mode="r", *args, **kwargs):
        path = under(file)
        if path is not None and any(c in mode for c in "wxa+"):
            refuse(path)
        return real_io(file, mode, *args, **kwargs)

    def os_open(file, flags, *args, **kwargs):
        path = under(file)
        if path is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os(file, flags, *args, **kwargs)

    monkeypatch.setattr(io, "open", io_open)
    monkeypatch.setattr(os, "open", os_open)
    return refused


def test_a_read_only_tensorboard_folder_is_one_line_and_no_writer_starts(tmp_path, tiny_run, monkeypatch):
    """TensorBoard's folder on a read-only file system (there: a mount point): its writer opens the event file
    in a thread of its own, which died with ``OSError: [Errno 30] Read-only file system:
    '…/events.out.tfevents…'`` printed as a traceback after the run's one line. Now the folder is probed before
    any writer starts: one line from the CLI, exit 1, no event file tried, no thread dying, no step run."""
    pytest.importorskip("tensorboard")
    import threading

    from tests.training.test_config import cli, one_line_error

    out = tmp_path / "run"
    (out / "run").mkdir(parents=True)
    died: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    config = tmp_path / "ft.yaml"
    config.write_text(json.dumps(tiny_run(steps=1, eval=None, report_to="tensorboard")))
    refused = _read_only(monkeypatch, out / "run")
    res = cli(config, "-q", "--output", out)
    monkeypatch.undo()  # the file system as it was, the threads' hook too
    one_line_error(res, f"report_to: tensorboard cannot write its logs in {out / 'run'} (Read-only file system); "
                        "make that a writable folder or leave report_to out")
    assert refused and not [p for p in refused if "tfevents" in p]  # no writer was started there
    assert died == []
    assert not (out / "log.jsonl").exists() and list((out / "run").iterdir()) == []
    assert not (out / "manifest.json").exists()  # refused before the manifest was written


def test_the_tracker_folder_probe_leaves_nothing_behind(tmp_path, tiny_run, monkeypatch):
    """``check_tracker_folder``: a writable TensorBoard folder is made and left empty; one it cannot write in
    is refused in one line and the folder it made removed again; a tracker without a folder is not probed."""
    from ropescale.errors import OutputError
    from ropescale.training.loop import check_tracker_folder

    out = tmp_path / "run"
    out.mkdir()
    check_tracker_folder(None, build_finetune_config(tiny_run(report_to="tensorboard")), out)
    assert list(out.iterdir()) == [out / "run"] and list((out / "run").iterdir()) == []
    (out / "run").rmdir()
    check_tracker_folder(None, build_finetune_config(tiny_run(report_to="wandb")), out)
    assert list(out.iterdir()) == []
    _read_only(monkeypatch, out / "run")
    with pytest.raises(OutputError, match=r"^report_to: tensorboard cannot write its logs in .*run/run \(Read-only"):
        check_tracker_folder(None, build_finetune_config(tiny_run(report_to="tensorboard")), out)
    assert list(out.iterdir()) == []

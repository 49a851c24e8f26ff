"""A full disk while checkpointing: one line (``CheckpointWriteError``, an ``OutputError``) naming
the checkpoint folder, the partial checkpoint never counted complete, and — once there is space
again — a rerun that resumes from the last complete checkpoint to bit-identical weights."""

import errno

import pytest
import torch
from safetensors.torch import load_file

from eval.finetune import run_finetune as finetune
from ropescale.errors import RopescaleError
from ropescale.runs.manifest import OutputError
from ropescale.training import build_finetune_config
from ropescale.training.checkpoints import CheckpointWriteError, complete_checkpoints
from ropescale.training.report import read_log


def run(raw, output, **kw):
    return finetune(build_finetune_config(raw), output, progress=False, **kw)


def weights(output):
    return load_file(output / "model" / "model.safetensors")


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
                 "No space left on device"),
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_rerun_resumes_bit_exactly(tmp_path, tiny_run, monkeypatch,
                                                                                   error):
    raw = tiny_run(steps=5, checkpoint_every=2)
    run(raw, tmp_path / "straight")

    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):  # the optimiser state of the step-4 checkpoint hits a full disk
        calls.append(str(f))
        if "step-000004" in str(f):
            with open(f, "wb") as fh:  # part of the file made it, as on a real full disk
                fh.write(b"PK\x03\x04partial")
            raise error
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "full"
    with pytest.raises(CheckpointWriteError) as info:
        run(raw, out)
    msg = str(info.value)
    assert isinstance(info.value, OutputError) and isinstance(info.value, RopescaleError)
    assert "\n" not in msg and "Traceback" not in msg
    assert str(out / "checkpoints" / "step-000004") in msg and "no space left on the device" in msg
    assert "resumes from step 2" in msg
    assert any("step-000004" in c for c in calls)  # the failure came from the patched writer
    assert [s for s, _ in complete_checkpoints(out)] == [2]  # step 4 never marked complete
    assert not (out / "checkpoints" / "step-000004").exists()  # the partial folder is gone (it holds space)

    monkeypatch.setattr(torch, "save", real_save)  # space freed
    resumed = run(raw, out)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 5
    a, b = weights(tmp_path / "straight"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda log: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log]
    assert strip(read_log(out)) == strip(read_log(tmp_path / "straight"))


def test_a_partial_checkpoint_left_by_a_killed_save_is_not_resumed_from(tmp_path):
    """A folder with state files but no marker (the process died inside save_state)."""
    from ropescale.training.checkpoints import CHECKPOINTS, COMPLETE

    good = tmp_path / CHECKPOINTS / "step-000002"
    good.mkdir(parents=True)
    (good / COMPLETE).write_text('{"step": 2}\n')
    cut = tmp_path / CHECKPOINTS / "step-000004"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"partial")
    assert complete_checkpoints(tmp_path) == [(2, good)]


def test_an_error_that_is_not_a_write_failure_propagates_unchanged(tmp_path, tiny_run, monkeypatch):
    def bug(*a, **k):
        raise RuntimeError("expected a Tensor, got NoneType")

    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(RuntimeError, match="expected a Tensor") as info:
        run(tiny_run(steps=3, checkpoint_every=2, eval=None), tmp_path)
    assert not isinstance(info.value, RopescaleError)

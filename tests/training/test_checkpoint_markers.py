"""A checkpoint counts as complete only when its completion marker reads back: an emptied or cut
marker (a full disk, a hand edit) makes a resume fall back to the previous complete checkpoint
instead of failing every rerun with a JSON error that never names the folder."""

import json

from ropescale.training.loop import CHECKPOINTS, _checkpoints


def _checkpoint(root, step, marker):
    folder = root / CHECKPOINTS / f"step-{step:06d}"
    folder.mkdir(parents=True)
    if marker is not None:
        (folder / "complete.json").write_text(marker, encoding="utf-8")
    return folder


def test_unreadable_markers_are_not_complete(tmp_path):
    good = _checkpoint(tmp_path, 100, json.dumps({"step": 100}) + "\n")
    _checkpoint(tmp_path, 200, "")  # emptied
    _checkpoint(tmp_path, 300, '{"st')  # cut off
    _checkpoint(tmp_path, 400, None)  # save never finished
    _checkpoint(tmp_path, 500, "[1, 2]")  # not a marker this loop writes
    assert _checkpoints(tmp_path) == [(100, good)]

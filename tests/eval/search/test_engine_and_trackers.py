"""``engine: vllm`` and ``report_to`` in a search config, as eval's and fine-tuning's have them: the
same options and checks, each refusal one line before anything is written; every candidate scored
through what ``patch --engine vllm`` writes; each finished trial in TensorBoard.

Without vLLM here, its driver is stood in for by plain transformers loading the served folder
(the exported config.json, the weights linked) — what the export tells an engine to compute,
read by other code than ropescale's patch — so the search's plumbing (requests, scored targets,
parity check, manifest) is checked against the transformers engine's search."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from eval import engines
from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.runs.config import ConfigError


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("text") / "jonah.txt"
    path.write_text(dict(kjv.split("train"))["Jonah"], encoding="utf-8")
    return path


@pytest.fixture
def raw(tiny_model_dir, train_file):
    return {"model": str(tiny_model_dir), "data": str(train_file), "strategy": "yarn", "fixed": {"factor": 2},
            "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2]}, "lengths": [64], "budget": 2,
            "max_windows": 2, "threads": 1, "device": "cpu", "dtype": "float32"}


def fake_vllm(engine: str, request: dict, **_) -> dict:
    """vllm_driver.py's ``score`` mode, computed by transformers from the served folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for r in request["requests"]:
            ids = torch.tensor([r["ids"]])
            logp = model(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
            results.append({"logprobs": logp.gather(1, ids[0, 1:, None])[:, 0].tolist()})
    return {"vllm": "0.0-stand-in", "results": results, "start_seconds": 0.0, "score_seconds": 0.0}


def _rows(folder: Path) -> list[dict]:
    return list(csv.DictReader((folder / "trials.csv").open(encoding="utf-8")))


def test_a_search_scored_through_the_vllm_export_equals_the_transformers_one(tmp_path, raw, monkeypatch):
    monkeypatch.setattr(engines.process, "require_engine", lambda engine: Path(sys.executable))
    monkeypatch.setattr(engines.process, "run_engine", fake_vllm)
    raw = {**raw, "budget": 1}
    ours = run_search(build_search_config(raw), tmp_path / "hf", progress=False)
    theirs = run_search(build_search_config({**raw, "engine": "vllm"}), tmp_path / "vllm", progress=False)
    a, b = _rows(tmp_path / "hf"), _rows(tmp_path / "vllm")
    assert [(r["beta_fast"], r["beta_slow"]) for r in a] == [(r["beta_fast"], r["beta_slow"]) for r in b]
    for x, y in zip(a, b):
        for key in ("objective", "ppl@64", "ppl_train", "constraint"):
            assert float(y[key]) == pytest.approx(float(x[key]), rel=1e-5, abs=1e-6), key
        assert "parity" not in x and 0 <= float(y["parity"]) <= 1e-4
    assert theirs["params"] == ours["params"]
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["identity"]["engine"] == "vllm"
    assert "engine" not in json.loads((tmp_path / "hf" / "manifest.json").read_text())["identity"]
    served = json.loads(next((tmp_path / "vllm" / "vllm").glob("candidate-*/config.json")).read_text())
    assert served["rope_parameters"]["rope_type"] == "yarn"  # what `patch --engine vllm` writes


@pytest.mark.parametrize("changes,fragment", [
    ({"strategy": "rerope", "search": {"window": [8, 32]}, "fixed": {}},
     "strategy: rerope: a relative-position rule applied inside attention; vLLM has no setting for it"),
    ({"strategy": "dynamic_ntk", "search": {"factor": [1, 4]}, "fixed": {}},
     "strategy: dynamic_ntk: recomputes its frequencies from the sequence length; vLLM serves one static rotation; "
     "a search scores T and every length in one engine"),
    ({"vllm": {"max_model_len": 40}}, "vllm.max_model_len: 40 is shorter than the 65 tokens"),
])
def test_what_vllm_cannot_do_in_a_search_is_one_line_before_anything_is_written(tmp_path, raw, changes, fragment,
                                                                                monkeypatch):
    monkeypatch.setattr(engines.process, "require_engine", lambda engine: Path(sys.executable))
    with pytest.raises(ConfigError) as e:
        run_search(build_search_config({**raw, "engine": "vllm", **changes}), tmp_path / "out", progress=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_absent_vllm_and_a_stray_vllm_section_are_one_line(tmp_path, raw, monkeypatch):
    monkeypatch.setenv("ROPESCALE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(ConfigError, match=r"^config: engine: vllm: vLLM is not installed.*bench/engines/install.sh"):
        run_search(build_search_config({**raw, "engine": "vllm"}), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"vllm: settings of engine: vllm, but this config's engine is transformers"):
        build_search_config({**raw, "vllm": {"tensor_parallel_size": 2}})


def test_each_finished_trial_is_in_tensorboard_as_in_trials_csv(tmp_path, raw):
    pytest.importorskip("tensorboard")
    from tests.training.test_trackers import _scalars

    run_search(build_search_config({**raw, "report_to": "tensorboard"}), tmp_path / "s", progress=False)
    rows, got = _rows(tmp_path / "s"), _scalars(tmp_path / "s")
    for key in ("objective", "ppl@64", "ppl_train", "constraint", "param/beta_fast"):
        column = key.removeprefix("param/")
        assert [s for s, _ in got[key]] == [int(r["trial"]) for r in rows], key
        assert [v for _, v in got[key]] == pytest.approx([float(r[column]) for r in rows], rel=1e-6), key
    a = build_search_config({**raw, "report_to": ["tensorboard"]})
    assert a.identity() == build_search_config(raw).identity()  # a search resumes across report_to


def test_a_bad_or_missing_tracker_is_one_line_before_anything_is_written(tmp_path, raw, monkeypatch):
    import accelerate.tracking

    with pytest.raises(ConfigError, match=r"report_to: unknown tracker 'tensorbored'; accelerate's trackers: aim"):
        build_search_config({**raw, "report_to": "tensorbored"})
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"report_to: wandb is not installed \(pip install wandb\)"):
        run_search(build_search_config({**raw, "report_to": "wandb"}), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

"""A search scores through the scoring registry as a sweep does: ``engine:`` is any registered scoring engine
answering log-probabilities, and a candidate is the requests a task makes (``Task.engine_requests``' format),
handed to the engine's ``answer`` (``eval.engines.answering``). A plugin's engine registered from this module —
nothing edited anywhere else — runs a search and finds the transformers engine's best; an engine that answers no
log-probabilities is refused in one line before anything is written; with mlx-lm installed, ``engine: mlx``
runs a search too."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import ClassVar

import pytest

from eval import engines
from eval.engines.answering import Answered, transformers_logprobs
from eval.engines.registry import add_role, remove_role
from eval.engines.scoring import ScoringEngine
from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.runs.config import ConfigError


class Toy(ScoringEngine):
    """A plugin's engine: the patched model in this process asked through the requests, as an engine in another
    process would be (its answers checked, its first window checked against transformers at 1e-6 nats)."""

    name = "toy-search-test"
    answers = frozenset({"logprobs"})
    asked: ClassVar[list] = []

    def tolerance(self, options, dtype):
        return 1e-6

    def answer(self, requests, serving):
        Toy.asked.append((serving.where, len(requests), serving.folder.name))
        results = [{"logprobs": transformers_logprobs(serving.model, r["ids"], serving.device).tolist()}
                   for r in requests]
        return Answered(results=results, version="toy 1")


class Mute(Toy):
    """A plugin's engine that answers generations only."""

    name = "mute-search-test"
    answers = frozenset({"generate"})


# defining them registered them; each test registers them for itself
remove_role(Toy.name, "scorer")
remove_role(Mute.name, "scorer")


@pytest.fixture(autouse=True)
def plugins():
    add_role(Toy, "scorer")
    add_role(Mute, "scorer")
    Toy.asked = []
    yield
    remove_role(Toy.name, "scorer")
    remove_role(Mute.name, "scorer")


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
            "max_windows": 2, "threads": 1, "device": "cpu", "dtype": "float32", "retrieval_weight": 0.5}


def _rows(folder: Path) -> list[dict]:
    return list(csv.DictReader((folder / "trials.csv").open(encoding="utf-8")))


def _same_best(ours: dict, theirs: dict) -> None:
    assert theirs.keys() == ours.keys()
    for key in ("strategy", "params", "spec", "feasible", "trial", "evaluations"):
        assert theirs[key] == ours[key], key
    for key in ("objective", "ppl_train"):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-5), key
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=1e-5)


def test_a_plugin_engine_runs_a_search_and_finds_the_transformers_best(tmp_path, raw):
    ours = run_search(build_search_config(raw), tmp_path / "hf", progress=False)
    theirs = run_search(build_search_config({**raw, "engine": Toy.name}), tmp_path / "toy", progress=False)
    _same_best(ours, theirs)
    assert json.loads((tmp_path / "toy" / "best.json").read_text()) == theirs
    # the vanilla patch (the constraint's PPL at T) and each candidate: one call each, every window and passkey
    windows = 2 * 2  # max_windows at L = 64 and at T = 32
    assert [n for _, n, _ in Toy.asked] == [windows + 4] * (1 + raw["budget"])
    assert Toy.asked[0][0].startswith("vanilla") and {f for _, _, f in Toy.asked} == {Toy.asked[0][2]}
    assert Toy.asked[0][2].startswith("candidate-")
    for x, y in zip(_rows(tmp_path / "hf"), _rows(tmp_path / "toy")):
        assert "parity" not in x and 0 <= float(y["parity"]) <= 1e-6
        assert float(y["retrieval_nll"]) == pytest.approx(float(x["retrieval_nll"]), rel=1e-5)
    identity = json.loads((tmp_path / "toy" / "manifest.json").read_text())["identity"]
    assert identity["engine"] == Toy.name


def test_an_engine_answering_no_logprobs_or_unknown_is_one_line_before_anything_is_written(tmp_path, raw):
    with pytest.raises(ConfigError) as e:
        run_search(build_search_config({**raw, "engine": Mute.name}), tmp_path / "out", progress=False)
    assert str(e.value) == (f"config: engine: {Mute.name} does not answer logprobs, which a search asks for — use "
                            "engine: transformers")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"unknown scoring engine 'vlm'; choose from .*vllm.*did you mean 'vllm'"):
        build_search_config({**raw, "engine": "vlm"})
    with pytest.raises(ConfigError, match=r"max_kl: .* engine toy-search-test returns the target's log-probability"):
        build_search_config({**raw, "engine": Toy.name, "max_kl": 0.1})


def test_a_candidate_the_engine_cannot_serve_is_refused_and_the_search_goes_on(tmp_path, raw, monkeypatch):
    from ropescale.serving.rope import ExportRefused

    answer = Toy.answer

    def picky(self, requests, serving):
        if serving.handle.params.get("beta_slow", 1) < 1:
            raise ExportRefused("toy: beta_slow below 1 has no setting")
        return answer(self, requests, serving)

    monkeypatch.setattr(Toy, "answer", picky)
    raw = {**raw, "budget": 4, "retrieval_weight": 0}
    run_search(build_search_config({**raw, "engine": Toy.name}), tmp_path / "toy", progress=False)
    rows = _rows(tmp_path / "toy")
    refused = [r for r in rows if r["state"] == "refused"]
    assert refused and len(refused) < len(rows) and all(float(r["beta_slow"]) < 1 for r in refused)
    assert all("toy: beta_slow below 1 has no setting (engine: toy-search-test)" in r["invalid"] for r in refused)
    assert all(r["state"] == "complete" for r in rows if float(r["beta_slow"]) >= 1)


HAS_MLX = engines.engine_python("mlx") is not None


@pytest.mark.skipif(not HAS_MLX, reason=engines.engine_status("mlx"))
@pytest.mark.engines
def test_a_search_through_mlx_finds_the_transformers_best(tmp_path, raw):
    raw = {**raw, "retrieval_weight": 0}
    ours = run_search(build_search_config(raw), tmp_path / "hf", progress=False)
    theirs = run_search(build_search_config({**raw, "engine": "mlx"}), tmp_path / "mlx", progress=False)
    assert theirs["params"] == ours["params"] and theirs["spec"] == ours["spec"]
    assert theirs["objective"] == pytest.approx(ours["objective"], abs=1e-4)
    assert all(0 <= float(r["parity"]) <= 1e-4 for r in _rows(tmp_path / "mlx"))

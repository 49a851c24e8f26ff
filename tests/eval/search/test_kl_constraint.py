"""``max_kl``: the short-context cost as a search constraint — c = max(c_PPL, KL_T / κ − 1), KL_T
the mean KL(P_unpatched ‖ P_candidate) per token at T, checked against the written-out sum over an
unpatched copy of the model (``tests.runs.test_scoring_kl.kl_oracle``)."""

import copy
import csv
import json

import pytest

import ropescale
from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.models import load_model
from ropescale.runs.config import ConfigError
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from ropescale.runs.manifest import ExperimentMismatchError
from ropescale.runs.windows import make_windows
from tests.runs.test_scoring_kl import kl_oracle


@pytest.fixture
def raw(sharp_model_dir, tmp_path):
    from ropescale.reference import kjv

    text = tmp_path / "jonah.txt"  # a training book: the default held-out data is kjv-heldout
    text.write_text(dict(kjv.split("train"))["Jonah"], encoding="utf-8")
    return {"model": str(sharp_model_dir), "data": str(text), "strategy": "yarn", "fixed": {"factor": 2},
            "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2]}, "lengths": [64], "budget": 2,
            "max_windows": 2, "threads": 1}


def test_the_kl_constraint_is_measured_at_t_and_binds(raw, tmp_path):
    out = tmp_path / "s"
    best = run_search(build_search_config({**raw, "max_kl": 1e-9}), out, progress=False)
    rows = list(csv.DictReader((out / "trials.csv").open(encoding="utf-8")))
    assert len(rows) == 2
    model, tok = load_model(raw["model"], device="cpu")
    docs = tokenize_documents(tok, load_documents(DataSpec(source=raw["data"])))
    windows = make_windows([len(d) for d in docs], 32, max_windows=2)  # T = 32
    unpatched = copy.deepcopy(model)
    for row in rows:
        params = {"factor": 2.0, "beta_fast": float(row["beta_fast"]), "beta_slow": float(row["beta_slow"])}
        with ropescale.patch(model, "yarn", **params):
            total, count, _, _ = kl_oracle(unpatched, model, docs, windows)
        kl = float(row["kl_train"])
        assert kl > 1e-6 and kl == pytest.approx(total / count, rel=1e-3, abs=1e-7)  # float32 vs float64
        assert float(row["constraint"]) == pytest.approx(kl / 1e-9 - 1, rel=1e-9)  # the KL term binds
        assert row["feasible"] == "False"
    assert "KL(unpatched ‖ candidate) at T ≤ 1e-09" in (out / "results.md").read_text()
    assert json.loads((out / "best.json").read_text()) == best
    # another ceiling is another search; none at all keeps the identity of searches from before max_kl
    with pytest.raises(ExperimentMismatchError):
        run_search(build_search_config({**raw, "max_kl": 0.5}), out, progress=False)
    free = run_search(build_search_config(raw), tmp_path / "free", progress=False)
    assert "kl_train" not in next(csv.DictReader((tmp_path / "free" / "trials.csv").open(encoding="utf-8")))
    assert free["evaluations"] == 2


@pytest.mark.parametrize(("change", "words"), [
    ({"max_kl": 0}, "max_kl"),
    ({"max_kl": True}, "max_kl"),
    ({"max_kl": 0.1, "engine": "vllm"}, "max_kl: the KL to the unpatched model needs the whole next-token"),
])
def test_bad_kl_ceilings_are_one_line(raw, change, words):
    with pytest.raises(ConfigError, match=words):
        build_search_config({**raw, **change})

"""Bad search configs are refused in one line naming the key; good ones read back."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from cli import main
from eval.search.config import build_search_config
from eval.search.run import run_search
from ropescale.runs.config import ConfigError

GOOD = {"strategy": "yarn", "fixed": {"factor": 8}, "lengths": [1024],
        "search": {"beta_fast": [2, 128], "beta_slow": [0.125, 8]}}


def test_defaults_keep_the_search_off_the_heldout_books():
    cfg = build_search_config(GOOD)
    assert cfg.data.source == "kjv-train" and cfg.heldout.source == "kjv-heldout"
    assert cfg.method == "tpe" and cfg.budget >= 1
    assert [d.name for d in cfg.space()] == ["beta_fast", "beta_slow"]
    assert cfg.weights() == [1.0]
    assert build_search_config({**GOOD, "lengths": [512, 1024], "length_weights": [1, 3]}).weights() == [0.25, 0.75]


@pytest.mark.parametrize(("change", "words"), [
    ({"strategy": "yarnn"}, "yarnn"),
    ({"strategy": "vanilla", "search": None, "fixed": {}}, "no numeric parameter"),
    ({"budget": 0}, "budget"),
    ({"budget": -3}, "at least 1 trial"),
    ({"data": "kjv-heldout"}, "held-out"),
    ({"data": "my.txt", "heldout": "my.txt"}, "held-out"),
    ({"method": "random"}, "unknown method 'random'"),
    ({"method": "tpee"}, "did you mean 'tpe'"),
    ({"lengths": []}, "lengths"),
    ({"length_weights": [1, 2]}, "length_weights"),
    ({"search": {"short_factor": None}, "strategy": "longrope", "fixed": {}}, "not searchable"),
    ({"epochs": 3}, "unknown key"),
])
def test_bad_configs_are_one_line(change, words):
    with pytest.raises(ConfigError) as e:
        build_search_config({**GOOD, **change}, "search.yaml")
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("search.yaml")


def test_evolution_missing_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "eval.search.evolution", None)  # as if the module were not there
    cfg = build_search_config({"strategy": "longrope", "method": "evolution", "lengths": [1024]})
    with pytest.raises(ConfigError, match="evolution .* not available"):
        run_search(cfg, tmp_path / "out", progress=False)


def test_cli_prints_one_line_and_exits_1(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("strategy: yarn\nlengths: [1024]\nfixed: {factor: 8}\nsearch: [beta_fast]\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["search", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and "no upper bound" in lines[0]
    result = CliRunner().invoke(main, ["search", str(path), "--set", "budget=0"])
    assert result.exit_code == 1 and "budget" in result.output

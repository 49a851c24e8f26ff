"""Bad search configs are refused in one line naming the key; good ones read back."""

from __future__ import annotations

import math
import os
import sys

import pytest
from click.testing import CliRunner

from cli import main
from eval.search.config import build_search_config, load_search_config
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


@pytest.mark.parametrize(("change", "words"), [
    # on main [.inf, 1] looped forever (every objective NaN), [1e308, 1e308] made every objective 0
    # (the weights normalised by an infinite sum) and retrieval_weight .inf made every one inf
    ({"length_weights": [math.inf, 1]}, "length_weights.0: Input should be a finite number, got inf"),
    ({"length_weights": [math.nan, 1]}, "finite number"),
    ({"length_weights": [1e308, 1e308]}, "sum to more than a float holds"),
    ({"length_weights": [0, 0]}, "not all zero"),
    ({"length_weights": [-1, 2]}, "≥ 0"),
    ({"length_weights": [True, 1]}, "length_weights: expected numbers, got true"),
    ({"retrieval_weight": math.inf}, "retrieval_weight: Input should be a finite number, got inf"),
    ({"epsilon": math.nan}, "epsilon"),
    # on main budget: true ran one trial (a bool read as the int 1)
    ({"budget": True}, "budget: expected an integer, got true"),
    ({"budget": 4.0}, "budget: Input should be a valid integer, got 4.0"),
    ({"budget": "4"}, "budget: Input should be a valid integer, got '4'"),
    ({"seed": False}, "seed"),
    ({"max_windows": True}, "max_windows"),
    ({"lengths": [True, 1024]}, "lengths: expected numbers, got true"),
    ({"threads": True}, "threads"),
    ({"retrieval_trials": 2.0}, "retrieval_trials"),
    ({"original_max_position_embeddings": True}, "original_max_position_embeddings"),
])
def test_numbers_and_weights_are_checked_up_front(change, words):
    with pytest.raises(ConfigError) as e:
        build_search_config({**GOOD, "lengths": [512, 1024], **change}, "search.yaml")
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("search.yaml")


def test_tiny_and_large_weights_are_fine():
    cfg = build_search_config({**GOOD, "lengths": [512, 1024], "length_weights": [1e307, 3e307]})
    assert cfg.weights() == pytest.approx([0.25, 0.75], rel=1e-15)


def test_set_numbers_still_read_as_numbers(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("strategy: yarn\nlengths: [1024]\nfixed: {factor: 8}\nsearch: {beta_fast: [2, 128]}\n",
                    encoding="utf-8")
    cfg = load_search_config(str(path), ["budget=7", "seed=3", "length_weights=[2]", "retrieval_weight=0.5"])
    assert (cfg.budget, cfg.seed, cfg.length_weights, cfg.retrieval_weight) == (7, 3, [2.0], 0.5)


def _spellings(tmp_path):
    """The same held-out file under other names: relative with ``..``, a symlink, a hard link,
    the folder holding it, ``~`` (HOME set to ``tmp_path``)."""
    book = tmp_path / "books" / "ruth.txt"
    book.parent.mkdir()
    book.write_text("Now it came to pass in the days when the judges ruled.\n", encoding="utf-8")
    (tmp_path / "link.txt").symlink_to(book)
    os.link(book, tmp_path / "hard.txt")
    return book, {
        "dotted": str(tmp_path / "books" / ".." / "books" / "ruth.txt"),
        "relative": os.path.relpath(book),
        "symlink": str(tmp_path / "link.txt"),
        "hard link": str(tmp_path / "hard.txt"),
        "folder": str(book.parent),
        "home": "~/books/ruth.txt",
    }


@pytest.mark.parametrize("spelling", ["dotted", "relative", "symlink", "hard link", "folder", "home"])
def test_the_heldout_data_under_another_spelling_is_refused(tmp_path, monkeypatch, spelling):
    # on main only the spellings were compared: ruth.txt as search data and books/../books/ruth.txt
    # as heldout was accepted, and the search could be scored on the reported data
    monkeypatch.setenv("HOME", str(tmp_path))
    book, names = _spellings(tmp_path)
    with pytest.raises(ConfigError, match="held-out data"):
        build_search_config({**GOOD, "data": names[spelling], "heldout": str(book)})
    with pytest.raises(ConfigError, match="held-out data"):
        build_search_config({**GOOD, "data": str(book), "heldout": names[spelling]})


@pytest.mark.parametrize(("data", "heldout"), [
    ({"source": "kjv-heldout", "max_documents": 2}, "kjv-heldout"),  # a prefix of the held-out books
    ({"source": "pg19", "split": "test[:100]"}, {"source": "PG19", "split": "test"}),  # a slice, the id's case
    ({"source": "wikitext", "config": "wikitext-103-raw-v1", "text_column": "page"},
     {"source": "wikitext/", "config": "WikiText-103-raw-v1"}),
])
def test_the_heldout_dataset_under_another_spec_is_refused(data, heldout):
    with pytest.raises(ConfigError, match="held-out data"):
        build_search_config({**GOOD, "data": data, "heldout": heldout})


@pytest.mark.parametrize(("data", "heldout"), [
    ("kjv-train", "kjv-heldout"),
    ({"source": "pg19", "split": "validation"}, {"source": "pg19", "split": "test"}),
    ({"source": "wikitext", "config": "wikitext-2-raw-v1"}, {"source": "wikitext", "config": "wikitext-103-raw-v1"}),
])
def test_other_data_is_accepted(data, heldout):
    build_search_config({**GOOD, "data": data, "heldout": heldout})

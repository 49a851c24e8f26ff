"""One loader and one error formatter for every config kind (``ropescale.runs.config``: ``load_raw``,
``explain``): a misspelt key reads the same in an experiment, a sweep, a fine-tuning run, a search,
the RULER suite's options and a recipe's options — ``SOURCE: key.path: unknown key; allowed: ...
(did you mean 'KEY'?)``, one line."""

from __future__ import annotations

import re

import pytest

from eval.config import build_config, load_config
from eval.search.config import build_search_config, load_search_config
from ropescale.runs.config import ConfigError, load_raw
from ropescale.training import build_finetune_config, load_finetune_config

EVAL = {"lengths": [128], "strategies": ["vanilla"]}
FINETUNE = {"strategy": "yarn", "length": 64, "steps": 1}
SEARCH = {"strategy": "yarn", "lengths": [512], "search": {"beta_fast": [4, 64]}}


@pytest.mark.parametrize(("build", "raw", "path", "meant", "listed"), [
    (build_config, {**EVAL, "lenghts": [256]}, "lenghts", "lengths", "strategies"),  # an experiment
    (build_config, {**EVAL, "perplexity": {"max_windws": 2}}, "perplexity.max_windws", "max_windows",
     "stride"),  # a sweep: perplexity's options
    (build_config, {**EVAL, "task": "ruler", "ruler": {"taks": ["niah_single_1"]}}, "ruler.taks", "tasks",
     "tasks"),  # the RULER suite's options
    (build_finetune_config, {**FINETUNE, "stpes": 3}, "stpes", "steps", "strategy"),  # a fine-tuning run
    (build_finetune_config, {**FINETUNE, "recipe": {"name": "lora", "rr": 4}}, "recipe.rr", "r",
     "alpha"),  # a recipe's options
    (build_search_config, {**SEARCH, "budgte": 3}, "budgte", "budget", "lengths"),  # a search
], ids=["eval", "sweep", "ruler_suite", "finetune", "recipe", "search"])
def test_every_config_kind_formats_a_bad_key_the_same_way(build, raw, path, meant, listed):
    with pytest.raises(ConfigError) as e:
        build(raw, "x.yaml")
    line = str(e.value)
    assert "\n" not in line
    shape = rf"x\.yaml: {re.escape(path)}: unknown key; allowed: [^;]*\b{listed}\b[^;]* \(did you mean '{meant}'\?\)"
    assert re.fullmatch(shape, line), line


@pytest.mark.parametrize("load", [load_config, load_search_config, load_finetune_config],
                         ids=["eval", "search", "finetune"])
def test_every_loader_reads_yaml_and_overrides_the_same_way(load, tmp_path):
    missing = tmp_path / "none.yaml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))}: no such file$"):
        load(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("lengths: [128\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load(bad)
    assert str(e.value).startswith(f"{bad}: not valid YAML: ") and "\n" not in str(e.value)
    good = tmp_path / "good.yaml"
    good.write_text("lengths: [128]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^--set 'budget': expected key=value$"):
        load(good, ["budget"])


def test_load_raw_merges_file_then_flags_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: a\nlengths: [1]\ndata: {source: x}\n", encoding="utf-8")
    raw, source = load_raw(path, ["lengths=[2,3]", "data.max_documents=4"], {"model": "b", "device": None})
    assert raw == {"model": "b", "lengths": [2, 3], "data": {"source": "x", "max_documents": 4}}
    assert source == str(path)
    assert load_raw(None, [], {"model": "c"}) == ({"model": "c"}, "flags")

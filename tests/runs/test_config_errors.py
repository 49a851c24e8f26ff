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


def _alias_bomb(levels: int) -> str:
    """``lengths:`` holding ten aliases of ten aliases …, ``levels`` deep: 10^levels values from a few
    hundred characters."""
    items = ["  - &a0 [128, 128, 128, 128, 128, 128, 128, 128, 128, 128]"]
    items += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "model: reference\nstrategies: [vanilla]\nlengths:\n" + "\n".join(items) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path):
    """10 levels of 10 aliases are 10^10 values: the one reader of every config kind refuses them from
    the node graph (each anchor counted once), before a value is built — validating them ran for
    minutes. In a ``--set`` value the same; an alias inside its own anchor (a list holding itself) too."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(10), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_raw(path)
    shape = (rf"{re.escape(str(path))}: not valid YAML: its aliases expand to more than 100,000 values "
             r"\(anchors repeated inside anchors: an alias bomb\); .* \(line \d+, column \d+\)")
    assert re.fullmatch(shape, str(e.value))
    bomb = "[" + ", ".join(f"&b{i} [" + ", ".join(["*b" + str(i - 1) if i else "1"] * 10) + "]"
                           for i in range(7)) + "]"  # 10^7 values from one --set
    with pytest.raises(ConfigError, match=r"^--set 'lengths=.*: its aliases expand to more than 100,000 values"):
        load_raw(None, [f"lengths={bomb}"])
    path = tmp_path / "self.yaml"
    path.write_text("lengths: &a [128, *a]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"not valid YAML: an alias refers to its own anchor"):
        load_raw(path)


def test_aliases_and_merge_keys_within_the_bound_still_read(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(_alias_bomb(4) + "base: &d {source: kjv-heldout}\ndata:\n  <<: *d\n  max_documents: 2\n",
                    encoding="utf-8")  # 10^4 values
    raw, _ = load_raw(path)
    assert raw["data"] == {"source": "kjv-heldout", "max_documents": 2}
    flat = [x for a in raw["lengths"] for x in _flatten(a)]
    assert len(flat) == 10 + 100 + 1000 + 10000 and set(flat) == {128}


def _flatten(x):
    return [y for v in x for y in _flatten(v)] if isinstance(x, list) else [x]


@pytest.mark.parametrize(("build", "raw", "key", "kind"), [
    (build_config, {**EVAL, "engine": "vllm", "vllm": {"tensor_parallel_size": True}}, "vllm.tensor_parallel_size",
     "an integer"),
    (build_config, {**EVAL, "engine": "vllm", "vllm": {"parity_tolerance": True}}, "vllm.parity_tolerance",
     "a number"),
    (build_config, {**EVAL, "threads": True}, "threads", "an integer"),
    (build_config, {**EVAL, "data": {"source": "kjv-heldout", "max_documents": True}}, "data.max_documents",
     "an integer"),
    (build_finetune_config, {**FINETUNE, "recipe": {"name": "longlora", "r": True}}, "recipe.r", "an integer"),
    (build_finetune_config, {**FINETUNE, "adam_betas": [0.9, True]}, "adam_betas", "numbers"),
], ids=["vllm_tp", "vllm_tolerance", "threads", "max_documents", "longlora_r", "adam_betas"])
def test_a_boolean_where_a_number_is_meant_is_refused_in_every_config_kind(build, raw, key, kind):
    """``true`` is 1 to pydantic: ``vllm: {tensor_parallel_size: true}`` was sent to vLLM as 1 and
    ``recipe: {name: longlora, r: true}`` trained rank 1. One base (``ConfigModel``) refuses it for
    every number field, as ``passkey.trials: true`` was."""
    with pytest.raises(ConfigError) as e:
        build(raw, "x.yaml")
    assert str(e.value) == f"x.yaml: {key}: expected {kind}, got true"


def test_a_parameter_given_twice_in_a_strategy_string_is_refused():
    # "dpe:scale_0=2,scale_0=3" ran with scale_0 = 3 and no word
    with pytest.raises(ConfigError, match=r"'dpe:scale_0=2,scale_0=3': scale_0 given twice"):
        build_config({"lengths": [256], "strategies": ["dpe:scale_0=2,scale_0=3"]})


def test_a_parameter_under_params_and_beside_it_is_refused():
    # {name: dpe, window: 16, params: {window: 32}} ran with window 16 (the top-level value won unseen)
    with pytest.raises(ConfigError, match=r"strategy entry 'dpe': window given both under params: and beside it"):
        build_config({"lengths": [256], "strategies": [{"name": "dpe", "window": 16, "params": {"window": 32}}]})


def test_a_repeated_label_is_named_as_such():
    # two entries of other settings under one label were told "the same cell would be computed twice"
    with pytest.raises(ConfigError, match=r"entry 1's label 'a' is entry 0's too: give each entry its own label"):
        build_config({"lengths": [256], "strategies": [{"name": "dpe", "window": 16, "label": "a"},
                                                       {"name": "dpe", "window": 32, "label": "a"}]})

"""An engine's config section is the engine's own (issue 54, item 1): a plugin's scoring engine that declares
``options`` and ``Options`` gets its section in eval and search configs — validated by its class, its bad keys
named under its key, refused beside another engine, dumped and read back — with no field in any config."""

from __future__ import annotations

import pytest
from pydantic import ConfigDict

from eval.config import build_config
from eval.engines.registry import add_role, remove_role
from eval.engines.scoring import ScoringEngine, section_keys
from eval.search.config import build_search_config
from ropescale.runs.config import ConfigError, ConfigModel


class ToyOptions(ConfigModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    batch: int = 8
    fast: bool = False


class ToySections(ScoringEngine):
    name = "toy-sections-test"
    answers = frozenset({"logprobs"})
    options = "toy_sections"
    Options = ToyOptions


remove_role(ToySections.name, "scorer")  # defining it registered it; each test registers it for itself


@pytest.fixture(autouse=True)
def plugin():
    add_role(ToySections, "scorer")
    yield
    remove_role(ToySections.name, "scorer")


@pytest.fixture
def raw(tiny_model_dir, text_file):
    return {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["yarn"]}


def test_a_plugin_engine_section_is_read_by_its_own_options(raw):
    assert "toy_sections" in section_keys() and "vllm" in section_keys()
    cfg = build_config({**raw, "engine": ToySections.name, "toy_sections": {"batch": 2}})
    assert cfg.engine_options == ToyOptions(batch=2) and ToySections().section(cfg) == ToyOptions(batch=2)
    assert build_config(cfg.model_dump(mode="json")) == cfg  # a manifest's config reads back
    left_out = build_config({**raw, "engine": ToySections.name})
    assert left_out.engine_options == ToyOptions()  # its defaults, as vllm's


@pytest.mark.parametrize(("extra", "message"), [
    ({"engine": "toy-sections-test", "toy_sections": {"bach": 2}},
     r"x.yaml: toy_sections.bach: unknown key; allowed: batch, fast \(did you mean 'batch'\?\)"),
    ({"toy_sections": {"batch": 2}},
     r"x.yaml: toy_sections: settings of engine: toy-sections-test, but this config's engine is transformers "
     r"\(which would ignore them\); set engine: toy-sections-test, or drop the toy_sections: section"),
    ({"engine": "toy-sections-test", "toy_sections": {"batch": 2}, "engine_options": {"batch": 3}},
     r"x.yaml: .*toy_sections: the engine's options are given twice"),
    ({"engine": "transformers", "engine_options": {"batch": 3}}, r"x.yaml: .*engine transformers takes no options"),
    ({"toy_sectons": {}}, r"x.yaml: toy_sectons: unknown key; .*did you mean 'toy_sections'"),
])
def test_a_bad_section_is_one_line(raw, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config({**raw, **extra}, "x.yaml")


def test_a_dumped_search_config_reads_back_under_another_engine(tiny_model_dir, text_file):
    """A search config dumped with engine: vllm (``engine_options`` at vLLM's defaults) read back with engine:
    transformers, as ``vllm: {defaults}`` always was (``lenient``)."""
    raw = {"model": str(tiny_model_dir), "data": str(text_file), "strategy": "yarn", "fixed": {"factor": 2},
           "search": {"beta_fast": [4, 64]}, "lengths": [64], "budget": 1, "engine": "vllm"}
    dumped = build_search_config(raw).model_dump(mode="json")
    assert dumped["engine_options"]["tensor_parallel_size"] == 1
    back = build_search_config({**dumped, "engine": "transformers"})
    assert back.engine_options is None
    with pytest.raises(ConfigError, match=r"engine_options: engine transformers takes no options"):
        build_search_config({**dumped, "engine": "transformers",
                             "engine_options": {**dumped["engine_options"], "tensor_parallel_size": 2}})


def test_a_search_reads_the_section_too(tiny_model_dir, text_file):
    raw = {"model": str(tiny_model_dir), "data": str(text_file), "strategy": "yarn", "fixed": {"factor": 2},
           "search": {"beta_fast": [4, 64]}, "lengths": [64], "budget": 1, "engine": ToySections.name,
           "toy_sections": {"fast": True}}
    cfg = build_search_config(raw)
    assert cfg.engine_options == ToyOptions(fast=True)
    assert build_search_config(cfg.model_dump(mode="json")) == cfg
    with pytest.raises(ConfigError, match=r"toy_sections.fastt: unknown key"):
        build_search_config({**raw, "toy_sections": {"fastt": True}})

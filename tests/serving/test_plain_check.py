"""The transformers engine says "plain transformers reproduces it" only after checking it
(``ropescale.serving.plain``): an export whose rope parameters plain ``from_pretrained`` turns into
another rotation is rewritten for ``ropescale.load_model`` only, with a note saying by how much."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ropescale
from ropescale.serving import export_for
from ropescale.serving.plain import check_plain, probe_positions
from ropescale.strategies import REGISTRY, register
from ropescale.strategies.frequency import FACTOR, rope_inv_freq
from ropescale.strategies.registry import RopeFrequencies

REPRODUCES = "plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def misexported():
    """Position interpolation whose export hook writes the wrong factor (s + 1): a hook bug the check
    must catch, since nothing else compares the written parameters with the patch."""
    def export(params, context, base, max_position_embeddings):
        return {"rope_type": "linear", "factor": params["factor"] + 1}

    @register("test_misexported", params=(FACTOR,), source="test", export=export)
    def misexported(dim, rope_theta, factor):
        return RopeFrequencies(rope_inv_freq(dim, rope_theta) / factor, 1.0)

    yield "test_misexported"
    del REGISTRY["test_misexported"]


def test_positions_reach_the_end_of_the_span():
    short, far = probe_positions(100)
    assert short.tolist() == [list(range(8))] and far.tolist() == [[0, 1, 2, 3, 96, 97, 98, 99]]
    assert len(probe_positions(8)) == 1


@torch.no_grad()
def test_an_export_plain_transformers_does_not_reproduce_is_written_for_ropescale_only(tmp_path, tiny_model_dir,
                                                                                      misexported):
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, misexported, factor=2.0)
    result = export_for(model, "transformers", 128, tmp_path / "out", tokenizer=tok)
    assert result.usage != REPRODUCES and result.usage.startswith("transformers cannot express this strategy")
    assert any(n.startswith("plain from_pretrained of the transformers rope parameters does not reproduce the patch "
                            "(max |Δ logit| ") for n in result.notes), result.notes
    config = json.loads((result.path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"].startswith("ropescale:test_misexported")
    assert config["max_position_embeddings"] == 128  # the served length, as written before the check
    assert json.loads((result.path / "ropescale.json").read_text())["native"] is False
    with pytest.raises(KeyError, match="ropescale.load_model"):
        AutoModelForCausalLM.from_pretrained(result.path)
    loaded, _ = ropescale.load_model(str(result.path), device="cpu")  # the patch itself is still restored
    ids = torch.arange(1, 60)[None]
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_reproduced_export_says_what_was_compared(tmp_path, tiny_model_dir):
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "yarn", factor=4.0)
    result = export_for(model, "transformers", 128, tmp_path / "out", tokenizer=tok)
    assert result.usage == REPRODUCES
    assert "checked: plain from_pretrained of the folder gives the patched model's logits (max |Δ logit| 0 " \
           "against the patched model on 8 tokens at positions up to 127)" in result.notes


def test_a_folder_plain_transformers_cannot_load_fails_the_check(tmp_path, tiny_model_dir):
    model, _ = ropescale.load_model(str(tiny_model_dir), device="cpu")
    got = check_plain(model, tmp_path, far=64)  # no model there
    assert not got.same and got.max_diff == float("inf")
    assert got.line.startswith("plain from_pretrained of the export fails: ") and "\n" not in got.line


def test_without_room_for_a_second_copy_the_export_says_it_was_not_checked(tmp_path, tiny_model_dir, monkeypatch):
    """An 8B float32 model on a host without 32 GB more: the check would need a second copy of the weights."""
    import ropescale.serving.engines.transformers as engine

    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "yarn", factor=4.0)
    copy = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(engine, "device_available", lambda device: copy)  # less than 1.25 copies free
    result = export_for(model, "transformers", 128, tmp_path / "out", tokenizer=tok)
    assert result.usage != REPRODUCES and "not checked here" in result.usage
    assert any(n.startswith("not checked against plain from_pretrained: a second copy of the weights") for n in
               result.notes), result.notes
    record = json.loads((result.path / "ropescale.json").read_text())
    assert record["native"] is True and record["plain_checked"] is False

"""The per-family quirks table (``ropescale.rotary.quirks``): every row is declared with its source and
a test that exists; its refusals and overrides act on made-up modules shaped like the families'."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ropescale.rotary import find_rotary_modules
from ropescale.rotary.modules import NoRotaryEmbeddingError
from ropescale.rotary.quirks import PROBE_CONTRACTS, QUIRKS, STAGES, apply_quirk_overrides, ignores_buffers, refuse

ROOT = Path(__file__).resolve().parents[2]


def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


@pytest.mark.parametrize("quirk", QUIRKS, ids=lambda q: q.name)
def test_every_row_names_its_families_source_and_an_existing_test(quirk):
    assert quirk.stage in STAGES and quirk.families.strip() and quirk.source.strip()
    path, _, test = quirk.test.partition("::")
    assert (ROOT / path).is_file(), quirk.test
    name, _, param = test.partition("[")
    assert name in _defined_tests(ROOT / path), quirk.test
    if path == "tests/test_census.py":  # a census case: the type and the check exist
        from tests.census.run import ALL_CHECKS, types

        arch, _, check = param.rstrip("]").rpartition("-")
        assert arch in types() and check in ALL_CHECKS, quirk.test


def test_row_names_are_unique():
    assert len({q.name for q in QUIRKS}) == len(QUIRKS)


def test_probe_contracts_are_tried_head_before_tail_halves_before_interleaved_plus_before_minus():
    """The probe keeps the first contract that reproduces a layer: the order is part of the result."""
    want = [(s, i, g) for s in ("head", "tail") for i in (False, True) for g in (1, -1)]
    assert [(c.start, c.interleaved, c.sign) for c in PROBE_CONTRACTS] == want
    assert [c.start_channel(64, 16) for c in PROBE_CONTRACTS] == [0] * 4 + [48] * 4


class _Rotary(nn.Module):
    """A rotary module that reads its buffer (``follows=True``) or a copy frozen at construction."""

    def __init__(self, follows: bool = True):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1]), persistent=False)
        self.frozen = None if follows else self.inv_freq.clone()
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        freq = self.inv_freq if self.frozen is None else self.frozen
        angle = position_ids[..., None].float() * freq  # [b, s, d/2]
        return angle.cos(), angle.sin()


def test_ignores_buffers_tells_a_module_that_reads_them_from_one_that_does_not():
    assert not ignores_buffers(_Rotary(follows=True))
    assert ignores_buffers(_Rotary(follows=False))


def test_a_module_that_ignores_its_buffers_is_refused():
    model = nn.Module()
    model.rotary_emb = _Rotary(follows=False)
    with pytest.raises(NoRotaryEmbeddingError, match="recomputes its frequencies from the config"):
        refuse("modules", model, find_rotary_modules(model))
    model.rotary_emb = _Rotary(follows=True)
    refuse("modules", model, find_rotary_modules(model))  # nothing to refuse


def test_a_rotary_module_inside_a_part_of_an_attention_layer_is_refused():
    """DeepSeek-V4: layers.<i>.self_attn.compressor.rotary_emb rotates keys at the compressor's positions."""
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn = nn.Module()
    model.layers[0].self_attn.compressor = nn.Module()
    model.layers[0].self_attn.compressor.rotary_emb = _Rotary()
    with pytest.raises(NoRotaryEmbeddingError, match=re.escape("layers.0.self_attn.compressor.rotary_emb")):
        refuse("modules", model, find_rotary_modules(model))


def test_a_layer_with_an_additive_mask_is_refused_for_relative_rules():
    from ropescale.rotary.sites import LayerRope

    layers = [LayerRope(0, "layers.0.attn", "rope"), LayerRope(1, "layers.1.attn", "rope", additive_mask=True)]
    with pytest.raises(NoRotaryEmbeddingError, match=r"layer 1 \(layers.1.attn\).*rerope's kernels"):
        refuse("layers", nn.Module(), layers, "rerope")
    refuse("layers", nn.Module(), layers[:1], "rerope")


def test_a_module_recomputing_through_rope_init_fn_reads_the_buffers_while_patched():
    """Phi-3.5-MoE: forward calls ``rope_init_fn(config)``; patched, it returns the module's buffers and the
    config's rope type reads default; restored, both are the model's again. Not for a patch that keeps the
    module's frequencies (no entries)."""
    module = _Rotary()
    shipped = (torch.tensor([9.0, 9.0]), 2.0)
    module.rope_init_fn = lambda *a, **k: shipped
    module.config = SimpleNamespace(rope_parameters={"rope_type": "longrope"})
    original = module.rope_init_fn
    assert apply_quirk_overrides("frequencies", module, {}) == []
    restores = apply_quirk_overrides("frequencies", module, {None: object()})
    module.inv_freq = torch.tensor([3.0, 4.0])
    inv_freq, scaling = module.rope_init_fn(module.config)
    assert torch.equal(inv_freq, torch.tensor([3.0, 4.0])) and scaling == 1.0
    assert module.config.rope_parameters["rope_type"] == "default"
    for r in reversed(restores):
        r()
    assert module.rope_init_fn is original and module.config.rope_parameters["rope_type"] == "longrope"

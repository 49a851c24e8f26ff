"""DCA's ``chunk_size`` and ``local_window`` default from the model's ``dual_chunk_attention_config``
(Qwen2.5-1M ships ``{chunk_size, local_size, original_max_position_embeddings}`` in its
config.json; vLLM serves it with chunks of chunk_size − local_size), else ChunkLlama's 3T/4 and
T/8; a parameter given explicitly wins, each on its own."""

import pytest
import torch

import ropescale
from ropescale.errors import InvalidInput
from ropescale.patching import find_rotary_modules, rope_context
from ropescale.strategies import get_strategy
from tests.families import COMMON, FAMILIES
from tests.strategies.test_relative import dca_pair

T = COMMON["max_position_embeddings"]  # 64: ChunkLlama's defaults would be chunk_size 48, local_window 8
SHIPPED = {"chunk_size": 20, "local_size": 4, "original_max_position_embeddings": T}
IDS = torch.randint(0, COMMON["vocab_size"], (1, 50), generator=torch.Generator().manual_seed(3))


def qwen2(dual=SHIPPED):
    cfg_cls, model_cls, extra = FAMILIES["qwen2"]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**COMMON, **extra, dual_chunk_attention_config=dual)).eval().double()


@torch.no_grad()
def logits(model, **params):
    with ropescale.patch(model, "dca", **params):
        return model(IDS).logits


def positions(rule, n=60):
    """The relative position the rule gives each (query i, key j ≤ i), row by row."""
    pos = torch.arange(n, dtype=torch.float64)[None]
    p = rule.relative_positions(pos, pos)[0]  # [n, n]
    return [p[i, :i + 1].tolist() for i in range(n)]


def paper(chunk_size, local_window, n=60):
    return [[float(q - k) for q, k in (dca_pair(i, j, chunk_size, local_window) for j in range(i + 1))]
            for i in range(n)]


def test_defaults_come_from_the_models_dual_chunk_attention_config():
    model = qwen2()
    torch.testing.assert_close(logits(model), logits(model, chunk_size=20, local_window=4), rtol=0, atol=0)
    dca = get_strategy("dca")
    context = rope_context(model, find_rotary_modules(model)[0][1])  # what the patch reads from the model
    assert positions(dca.compute(context, dca.validate({}))) == paper(20, 4)
    # each explicit parameter wins on its own; the other still comes from the config
    assert positions(dca.compute(context, dca.validate({"chunk_size": 30}))) == paper(30, 4)
    assert positions(dca.compute(context, dca.validate({"local_window": 2}))) == paper(20, 2)
    # a model without the config keeps ChunkLlama's 3T/4 and T/8
    plain = rope_context(qwen2(dual=None), find_rotary_modules(qwen2(dual=None))[0][1])
    assert "dual_chunk_attention_config" not in plain
    assert positions(dca.compute(plain, dca.validate({}))) == paper(48, 8) != paper(20, 4)


def test_the_checks_before_a_run_use_the_models_sizes_and_bad_shipped_ones_are_one_line():
    """A sweep resolves every cell before it runs: chunk_size = 6 is below ChunkLlama's T/8 = 8 but
    above the model's local_size 4, so it is a valid cell of this model."""
    dca = get_strategy("dca")
    context = {"dual_chunk_attention_config": SHIPPED}
    assert dca.resolve({"chunk_size": 6}, length=128, train_length=T, context=context)["chunk_size"] == 6
    with pytest.raises(InvalidInput, match=r"local_window=8 must be below chunk_size=6"):
        dca.resolve({"chunk_size": 6}, length=128, train_length=T)  # no model: ChunkLlama's T/8
    with pytest.raises(InvalidInput, match=r"^dca: local_window=4 must be below chunk_size=3 \(both in tokens\) "
                                           r"\(local_window from the model's dual_chunk_attention_config\)$"):
        dca.resolve({"chunk_size": 3}, length=128, train_length=T, context=context)
    with pytest.raises(InvalidInput, match=r"^dca: the model's dual_chunk_attention_config.local_size='4' is not a "
                                           r"whole number of tokens; give local_window explicitly$"):
        ropescale.patch(qwen2({**SHIPPED, "local_size": "4"}), "dca")


def test_a_sweep_checks_its_cells_with_the_models_sizes(tmp_path):
    from eval.config import build_config
    from eval.sweep import resolve_cells

    qwen2().save_pretrained(tmp_path / "m")
    cfg = build_config({"model": str(tmp_path / "m"), "lengths": [128], "strategies": ["dca:chunk_size=6"]})
    assert resolve_cells(cfg, T)["dca:chunk_size=6", 128]["chunk_size"] == 6  # main: refused (local_window=8)

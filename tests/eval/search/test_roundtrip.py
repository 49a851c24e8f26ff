"""A search result's ``spec`` (best.json) used unchanged by ``export``, ``eval`` and ``finetune``:
``ropescale patch --strategy SPEC`` writes a transformers-native config (``longrope`` / ``yarn``)
that plain ``from_pretrained`` reproduces, an eval config and a finetune config take it to the same
parameters. The best.json files come from the search's own spec writer (``spec_string``,
``spec_params``) with the parameter types a search produces (LongRoPE grid floats such as
1.7200000000000006, the fixed ``factor`` as given, auto ones filled)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ropescale
from cli import main
from eval.config import build_config
from eval.search.evolution import yarn_init_factors
from eval.search.objective import spec_params
from eval.search.report import spec_string
from ropescale.runs.config import parse_strategy
from ropescale.training import build_finetune_config, resolve

pytestmark = pytest.mark.slow

T, L, DIM, THETA = 128, 1024, 32, 10000.0  # the bundled reference model


def _longrope_best() -> dict:
    # as eval.search.longrope writes it: searched long_factor (grid values with float noise),
    # short_factor fixed to 1, factor auto-filled as L / T
    grid = np.arange(1.0, 1.0 + L / T + 0.01, 0.01)  # LongRoPE's grid: 1.7200000000000006, ...
    long = yarn_init_factors(DIM, THETA, T, L / T)
    long[1:3] = [float(grid[72]), float(grid[83])]
    params = spec_params("longrope", {}, {"long_factor": long, "short_factor": [1.0] * (DIM // 2)},
                         length=L, train_length=T)
    return {"strategy": "longrope", "params": params, "spec": spec_string("longrope", params)}


def _yarn_best() -> dict:
    # as the tuner writes it: the fixed factor as given (an int) and the sampled floats
    params = spec_params("yarn", {"factor": 8}, {"beta_fast": 115.48982092956896, "beta_slow": 1.052865051018753,
                                                 "attention_factor": 1.1075361898815832}, length=L, train_length=T)
    return {"strategy": "yarn", "params": params, "spec": spec_string("yarn", params)}


@pytest.mark.parametrize(("best", "rope_type"), [(_longrope_best(), "longrope"), (_yarn_best(), "yarn")],
                         ids=["longrope", "yarn"])
def test_best_spec_exports_natively_and_from_pretrained_reproduces_it(best, rope_type, tmp_path):
    from transformers import AutoModelForCausalLM

    (tmp_path / "best.json").write_text(json.dumps(best), encoding="utf-8")
    spec = json.loads((tmp_path / "best.json").read_text(encoding="utf-8"))["spec"]
    assert parse_strategy(spec).params == best["params"]

    out = tmp_path / "patched"
    res = CliRunner().invoke(main, ["patch", "--model", "reference", "--strategy", spec, "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "plain transformers (AutoModelForCausalLM.from_pretrained) reproduces it" in res.output
    rp = json.loads((out / "config.json").read_text(encoding="utf-8"))["rope_parameters"]
    assert rp["rope_type"] == rope_type
    if rope_type == "longrope":
        assert rp["long_factor"] == best["params"]["long_factor"]
        assert rp["short_factor"] == best["params"]["short_factor"]

    patched, _ = ropescale.load_model("reference", device="cpu")
    ropescale.unpatch(patched)
    ropescale.patch(patched, best["strategy"], **best["params"])
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    gen = torch.Generator().manual_seed(0)
    for n in (16, 2 * T + 5):  # short input (short_factor for longrope) and one past T (long_factor)
        ids = torch.randint(0, plain.config.vocab_size, (1, n), generator=gen)
        with torch.no_grad():
            a, b = patched(ids).logits, plain(ids).logits
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (n, (a - b).abs().max().item())


@pytest.mark.parametrize("best", [_longrope_best(), _yarn_best()], ids=["longrope", "yarn"])
def test_best_spec_is_an_eval_and_a_finetune_strategy(best):
    assert build_config({"lengths": [T, L], "strategies": [best["spec"]]}).strategies[0].params == best["params"]
    cfg = build_finetune_config({"model": "reference", "strategy": best["spec"], "length": L, "steps": 1})
    assert cfg.strategy.name == best["strategy"]
    run = resolve(cfg)
    assert run.train_length == T
    assert run.params == {**run.params, **best["params"]}  # the searched values, unchanged
    assert run.strategy_spec(cfg).params == run.params

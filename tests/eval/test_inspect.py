"""`ropescale inspect`: files, summary numbers against the geometry's closed forms, bad input."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

from cli import main


def run(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)], catch_exceptions=False)


def test_bundled_model_at_8t(tmp_path):
    res = run("--model", "reference", "--strategy", "vanilla", "--strategy", "linear", "--strategy", "ntk",
              "--strategy", "pi_over_2n:n_max=2048", "--strategy", "rerope", "--length", 1024, "-o", tmp_path)
    assert res.exit_code == 0, res.output
    for name in ("wavelengths.png", "angles.png", "decay.png", "base_bound.png", "relative_positions.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["dim"], s["rope_theta"], s["train_length"], s["length"]) == (32, 10000.0, 128, 1024)
    rows = {r["strategy"]: r for r in s["strategies"]}
    # vanilla past T: the pairs with λ_i = 2π·b^(2i/d) > T are extrapolated, the others unchanged
    slow = sum(2 * math.pi * 10000 ** (2 * i / 32) > 128 for i in range(16))
    assert rows["vanilla"]["class_counts"] == {"unchanged": 16 - slow, "interpolated": 0, "extrapolated": slow,
                                               "truncated": 0}
    assert rows["vanilla"]["alias_distance"] == {"0": 7}  # θ_0 = 1
    assert rows["linear"]["class_counts"]["interpolated"] == 16 and rows["linear"]["params"]["factor"] == 8.0
    assert rows["pi_over_2n:n_max=2048"]["alias_distance"] == {"0": None}
    assert rows["rerope"]["kind"] == "relative rule" and rows["rerope"]["max_relative_position"] == 64
    assert s["smallest_base_for_length"] > s["rope_theta"] and not s["rope_theta_keeps_B_nonnegative"]
    assert rows["vanilla"]["base_bound_first_negative"] is not None


def test_bare_configuration_and_attention(tmp_path):
    res = run("--head-dim", 64, "--rope-theta", 10000, "--original-max-position-embeddings", 256, "--strategy", "yarn",
              "--length", 512, "--pair", 0, "--pair", 5, "-o", tmp_path / "bare")
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "bare" / "summary.json").read_text())
    assert s["dim"] == 64 and set(s["strategies"][0]["alias_distance"]) == {"0", "5"}
    res = run("--model", "reference", "--strategy", "vanilla", "--strategy", "yarn", "--length", 256, "--attention",
              "-o", tmp_path / "att")
    assert res.exit_code == 0, res.output
    att = json.loads((tmp_path / "att" / "summary.json").read_text())["attention"]
    for v in att.values():  # entropy of a distribution over ≤ 256 keys; a share in [0, 1]
        assert 0 < v["mean_entropy"] < math.log(256) and 0 <= v["mean_sink_share"] <= 1
    assert (tmp_path / "att" / "attention.png").stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    (["--strategy", "yarnn", "--model", "reference", "--length", 256], "unknown strategy 'yarnn'"),
    (["--strategy", "yarn", "--length", 256], "give --model, or a bare configuration: missing --head-dim"),
    (["--strategy", "yarn", "--model", "reference", "--length", 256, "--pair", 16], "pairs [16] out of range"),
    (["--strategy", "yarn", "--model", "reference", "--length", 1], "length 1 must be at least 2"),
    (["--strategy", "rerope", "--model", "reference", "--length", 256, "--attention"],
     "needs attention weights; rerope compute"),
    (["--strategy", "yarn:factor=0.5", "--model", "reference", "--length", 256], "factor=0.5 is out of range"),
    (["--strategy", "yarn", "--model", "reference", "--head-dim", 64, "--length", 256],
     "--head-dim describe a bare configuration; with --model the model's own config is used"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    res = run(*args, "-o", tmp_path)
    assert res.exit_code == 1 and res.output.startswith("Error: ") and message in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


@pytest.mark.parametrize("theta", ["nan", "inf", "-inf"])
def test_a_non_finite_rope_theta_is_refused(tmp_path, theta):
    # nan passed the `> 1` check (every comparison with nan is false) and ended in a traceback; inf wrote plots
    res = run("--head-dim", 64, "--rope-theta", theta, "--original-max-position-embeddings", 256, "--strategy", "yarn",
              "--length", 1024, "-o", tmp_path)
    assert res.exit_code == 1
    assert res.output == ("Error: --head-dim must be even and >= 2, --rope-theta finite and > 1, "
                          "--original-max-position-embeddings >= 2\n")
    assert not any(tmp_path.iterdir())


def test_lengths_that_cannot_run_are_refused_before_allocating(tmp_path):
    # 10^9 ended in the allocator's 'can't allocate 128000000000 bytes', 10^20 in an OverflowError
    for length in (10 ** 9, 10 ** 20):
        res = run("--model", "reference", "--strategy", "yarn", "--length", length, "-o", tmp_path / "big")
        assert res.exit_code == 1
        assert res.output == (f"Error: length {length} is beyond any model: RoPE angles come from float32 positions,"
                              " exact only up to 2^24 = 16777216 tokens; use a length of at most 16777216\n")
    # within 2^24 but larger than this machine: the estimate is named, nothing is allocated
    res = run("--head-dim", 256, "--rope-theta", 500000, "--original-max-position-embeddings", 8192,
              "--strategy", "yarn",
              "--length", 16_000_000, "-o", tmp_path / "m")
    assert res.exit_code == 1 and res.output.startswith(
        "Error: inspect at L = 16000000 tokens, d = 256 needs about 61.0 GiB (angle tables 61.0 GiB); this machine has")
    assert res.output.rstrip().endswith("free; use a shorter length")


def test_relative_rule_map_is_the_full_matrix_on_a_grid():
    """The truncation rule's figure is computed on a grid of at most 256 positions per side (it
    held the [L, L] matrix: 34 GB at L = 65,536); on a small L it equals the full matrix, written
    out here, taken on the same grid, and the largest position equals the full matrix's maximum."""
    import torch

    from eval.inspect import GRID, RotaryConfig, _strategy_summary
    from ropescale.runs.config import parse_strategy
    from ropescale.strategies.frequency import rope_inv_freq

    cfg = RotaryConfig(32, 10000.0, 64, rope_inv_freq(32, 10000.0).double(), "test")
    for spec, length in (("rerope:window=16", 1000), ("leaky_rerope:window=16,k=4", 777),
                         ("self_extend:group_size=4,window=16", 600)):
        row = _strategy_summary(parse_strategy(spec), cfg, length, [0])
        i = torch.arange(length, dtype=torch.float64)
        near = i[:, None] - i[None, :]
        w = row["window"]
        if spec.startswith("rerope"):
            far = torch.full_like(near, float(w))
        elif spec.startswith("leaky"):
            far = (i[:, None] - i[None, :]) / 4 + w * (1 - 1 / 4)
        else:
            far = torch.floor(i[:, None] / 4) + (w - w // 4) - torch.floor(i[None, :] / 4)
        full = torch.where(near < w, near, far).tril()  # [L, L]
        step = -(-length // GRID)
        assert row["_p"].shape[0] <= GRID
        assert torch.equal(row["_p"], full[::step, ::step])
        assert row["max_relative_position"] == float(full.max())


@pytest.mark.parametrize("strategy,message", [
    ("dca:chunk_size=.inf", "dca: parameter chunk_size=inf must be a finite whole number; allowed: >= 2"),
    ("dca:chunk_size=.nan", "dca: parameter chunk_size=nan must be a finite whole number; allowed: >= 2"),
    ("string:shifted_offset=-.inf", "string: parameter shifted_offset=-inf must be a finite whole number; "
                                    "allowed: >= 1"),
    ("yarn:beta_fast=.nan", "yarn: parameter beta_fast=nan must be a finite number; allowed: > 0"),
    ("self_extend:group_size=true", "self_extend: parameter group_size=True must be a whole number (int); "
                                    "allowed: >= 1"),
    # the training window's defaults: T = 256 gives local_window 32 and S = 84
    ("dca:chunk_size=20", "dca: local_window=32 must be below chunk_size=20 (both in tokens)"),
    ("string:local_window=100", "string: local_window=100 must be below shifted_offset=84 (both in tokens)"),
    # the model's rotary dim, known only with the model: still before anything is written
    ("longrope:short_factor=[1.0],long_factor=[1.0]", "longrope: short_factor has 1 entries; the model's rotary "
                                                      "dim 64 needs 32"),
])
def test_hostile_strategy_parameters_are_one_line_and_write_nothing(tmp_path, strategy, message):
    res = run("--head-dim", 64, "--rope-theta", 10000, "--original-max-position-embeddings", 256, "--strategy", "yarn",
              "--strategy", strategy, "--length", 1024, "-o", tmp_path / "out")
    assert res.output == f"Error: {message}\n" and res.exit_code == 1
    assert not (tmp_path / "out").exists()


def test_whole_numbers_written_as_floats_and_numpy_numbers_inspect_alike(tmp_path):
    import numpy as np

    from eval.inspect import RotaryConfig, inspect
    from ropescale.runs.config import StrategySpec
    from ropescale.strategies.frequency import rope_inv_freq

    cfg = RotaryConfig(64, 10000.0, 256, rope_inv_freq(64, 10000.0).double(), "bare")
    got = [inspect(cfg, [StrategySpec(name="dca", params={"chunk_size": v, "local_window": 8})], 1024,
                   tmp_path / str(i))["strategies"][0] for i, v in enumerate([96, 96.0, np.int64(96)])]
    for g in got:
        assert g.pop("strategy").startswith("dca:chunk_size=96")  # the label keeps the spelling
    assert got[0] == got[1] == got[2] and type(got[2]["params"]["chunk_size"]) is int


def test_rotary_config_bare_is_vanilla_rope_and_refuses_a_mix():
    """The bare configuration the command draws (moved out of cli.py, issue 30): θ_i = b^(-2i/d)."""
    from eval.inspect import rotary_config
    from ropescale.errors import InvalidInput

    cfg = rotary_config(None, 8, 100.0, 16)
    assert (cfg.dim, cfg.rope_theta, cfg.train_length, cfg.source) == (8, 100.0, 16, "d=8, b=100, T=16")
    assert cfg.inv_freq.dtype == torch.float64
    assert cfg.inv_freq.tolist() == pytest.approx([100.0 ** (-2 * i / 8) for i in range(4)], rel=1e-7)
    with pytest.raises(InvalidInput, match="^--head-dim describe a bare configuration"):
        rotary_config("reference", head_dim=8)
    with pytest.raises(InvalidInput, match="missing --rope-theta, --original-max-position-embeddings$"):
        rotary_config(None, head_dim=8)
    with pytest.raises(InvalidInput, match="--head-dim must be even"):
        rotary_config(None, 7, 100.0, 16)


def test_a_model_gets_the_per_layer_table_patch_dry_run_prints(tmp_path):
    """``inspect --model`` prints, per strategy, the table of ``patch --dry-run`` (main printed only
    the geometry) and keeps its rows in summary.json; a tiny Qwen3.5 (the census's builder) has its
    Gated DeltaNet layers as "no RoPE" rows beside its one full-attention layer."""
    from transformers import AutoTokenizer

    from ropescale.models import REFERENCE_MODEL
    from tests.census.build import build
    from tests.census.run import types

    model = build(types()["qwen3_5_text"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "q35")
    AutoTokenizer.from_pretrained(REFERENCE_MODEL).save_pretrained(tmp_path / "q35")
    dry = CliRunner().invoke(main, ["patch", "--model", str(tmp_path / "q35"), "--strategy", "yarn:factor=2",
                                    "--dry-run", "-q"], catch_exceptions=False)
    assert dry.exit_code == 0, dry.output
    table = dry.output.split("\n", 1)[1]  # after "yarn:factor=2 on ... (dry run: nothing written)"
    res = run("--model", tmp_path / "q35", "--strategy", "yarn:factor=2", "--length", 64, "-o", tmp_path / "o", "-q")
    assert res.exit_code == 0, res.output
    assert f"yarn:factor=2 on {tmp_path / 'q35'}, per layer:\n{table}" in res.output
    layers = model.config.layer_types
    assert table.count("no RoPE (linear_attention), untouched") == layers.count("linear_attention") == 3
    rows = json.loads((tmp_path / "o" / "summary.json").read_text())["layers"]["yarn:factor=2"]
    assert [r["layer"] for r in rows] == list(range(len(layers)))
    assert [r["rope"] for r in rows] == ["none" if t == "linear_attention" else "rope" for t in layers]

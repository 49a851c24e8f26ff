"""Request-length profiles: ``export_profiles`` / ``patch --profiles`` write one export per factor
and the rule; each profile, read back as vLLM reads it (``vllm_rope``, written out from vLLM's source),
is the static strategy at its factor (parity per profile); the rule by hand."""

import json

import pytest
import torch
from click.testing import CliRunner

import ropescale
from cli import main
from ropescale.errors import InvalidInput
from ropescale.runs.profiles import check_factors, select_factor
from ropescale.serving import compare, ropescale_rope, vllm_rope
from ropescale.serving.profiles import Profile, export_profiles, read_profiles, select_profile


@pytest.mark.parametrize(("tokens", "factor"), [(1, 1.0), (32, 1.0), (33, 2.0), (64, 2.0), (65, 4.0), (128, 4.0),
                                                (129, 4.0), (10_000, 4.0)])
def test_the_rule_by_hand(tokens, factor):
    """T = 32, profiles 1/2/4 reach 32/64/128: the smallest covering factor; past 128 the largest."""
    assert select_factor([4, 1, 2], 32, tokens) == factor
    profiles = [Profile(4.0, 128, "c"), Profile(1.0, 32, "a"), Profile(2.0, 64, "b")]
    assert select_profile(profiles, tokens - 1, 1).factor == factor  # prompt + max_new_tokens
    assert select_factor([1.5], 33, 49) == 1.5 and select_factor([1.5, 3], 33, 50) == 3  # reach ⌊1.5·33⌋ = 49


@pytest.mark.parametrize(("factors", "words"), [([], "non-empty"), ([0.5, 2], "0.5 is not a scale factor"),
                                                ([1, True], "True is not"), ([2, 2.0], "twice"),
                                                ([1, float("nan")], "nan is not"), ("1,2", "non-empty list")])
def test_bad_factors_are_one_line(factors, words):
    with pytest.raises(InvalidInput, match=words):
        check_factors(factors)


def test_each_profile_is_the_static_strategy_at_its_factor_as_vllm_reads_it(tiny_model_dir, tmp_path):
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")  # T = 32
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results = export_profiles(model, "yarn", [4, 1, 2], "vllm", tmp_path / "p", tokenizer=tok, beta_fast=16.0)
    assert ropescale.current_patch(model) is None and all(torch.equal(v, before[k]) for k, v in
                                                          model.state_dict().items())
    record, profiles = read_profiles(tmp_path / "p")
    assert [(p.factor, p.reach, p.path) for p in profiles] == [(1.0, 32, "profile-1x"), (2.0, 64, "profile-2x"),
                                                              (4.0, 128, "profile-4x")]
    assert record["strategy"] == "yarn" and record["params"] == {"beta_fast": 16.0} and record["train_length"] == 32
    assert record["engine"] == "vllm" and "smallest factor" in record["rule"]
    for p, result in zip(profiles, results):
        folder = tmp_path / "p" / p.path
        assert result.path == folder and result.serve_length == p.reach
        config = json.loads((folder / "config.json").read_text())
        served = json.loads((folder / "vllm.json").read_text())["max_model_len"]
        assert served == p.reach
        with ropescale.patch(model, "yarn", factor=p.factor, beta_fast=16.0):
            ours = ropescale_rope(model, p.reach)
        theirs = vllm_rope(config, served)
        assert theirs.failure is None and compare(ours, theirs, p.reach).same
        other = 2.0 if p.factor == 1.0 else 1.0  # and not another profile's rotation
        with ropescale.patch(model, "yarn", factor=other, beta_fast=16.0):
            assert not compare(ropescale_rope(model, p.reach), theirs, p.reach).same


@pytest.mark.parametrize(("strategy", "params", "words"), [
    ("dynamic_ntk", {}, "no static scale factor"),
    ("rerope", {"window": 8}, "no static scale factor"),
    ("yarn", {"factor": 2}, "leave factor out"),
])
def test_what_profiles_cannot_serve_is_refused(tiny_model_dir, tmp_path, strategy, params, words):
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    with pytest.raises(InvalidInput, match=words):
        export_profiles(model, strategy, [1, 2], "vllm", tmp_path / "p", tokenizer=tok, **params)
    assert not (tmp_path / "p").exists()
    ropescale.patch(model, "yarn", factor=2)
    with pytest.raises(InvalidInput, match="already patched"):
        export_profiles(model, "yarn", [1, 2], "vllm", tmp_path / "p", tokenizer=tok)


def test_cli_patch_profiles(tiny_model_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "yarn"
    res = runner.invoke(main, ["patch", "--model", str(tiny_model_dir), "--strategy", "yarn", "--engine", "vllm",
                               "--profiles", "1,2,4", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "saved yarn ×4 for vllm (serves 128 tokens)" in res.output
    assert [p.reach for p in read_profiles(out)[1]] == [32, 64, 128]
    for args, words in ((["--serve-length", "64"], "leave --serve-length"),
                        (["--strategy", "yarn:factor=2"], "leave factor"),
                        (["--profiles", "1,x"], "not a comma-separated list"),
                        (["--profiles", "0.5,2"], "0.5 is not a scale factor")):
        base = {"--strategy": "yarn", "--profiles": "1,2"}
        flags = dict(zip(args[::2], args[1::2]))
        argv = ["patch", "--model", str(tiny_model_dir), "--engine", "vllm", "-o", str(tmp_path / "bad")]
        for k, v in {**base, **flags}.items():
            argv += [k, v]
        res = runner.invoke(main, argv)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1 and words in lines[0], res.output
        assert not (tmp_path / "bad").exists()


def test_each_factor_gets_its_own_folder_named_exactly(tiny_model_dir, tmp_path):
    """Factors ``f"{f:g}"`` writes alike (1.0000001, 1.0000002: both "1") get a folder each, whose name reads back
    as its factor; profiles.json lists each once, and each folder holds its own factor's export."""
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    factors = [1.0000001, 1.0000002, 2.0]
    export_profiles(model, "yarn", factors, "vllm", tmp_path / "p", tokenizer=tok)
    _, profiles = read_profiles(tmp_path / "p")
    assert [p.factor for p in profiles] == factors
    assert [p.path for p in profiles] == ["profile-1.0000001x", "profile-1.0000002x", "profile-2x"]
    assert sorted(x.name for x in (tmp_path / "p").iterdir()) == sorted([p.path for p in profiles] + ["profiles.json"])
    for p in profiles:
        assert float(p.path.removeprefix("profile-").removesuffix("x")) == p.factor
        config = json.loads((tmp_path / "p" / p.path / "config.json").read_text())
        assert config["rope_parameters"]["factor"] == p.factor


@pytest.mark.parametrize("existing", [False, True])
def test_a_factor_its_export_refuses_is_refused_before_any_profile_is_written(tiny_model_dir, tmp_path, existing):
    """×1000000 reaches 32·10^6 tokens, past the 2^24 any export serves: refused in one line naming it, before
    profile-1x is written (the output folder as it was: missing, or empty)."""
    out = tmp_path / "p"
    if existing:
        out.mkdir()
    res = CliRunner().invoke(main, ["patch", "--model", str(tiny_model_dir), "--strategy", "yarn", "--engine", "vllm",
                                    "--profiles", "1,1000000", "-o", str(out), "-q"])
    assert (sorted(out.iterdir()) == []) if existing else not out.exists()
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and "×1000000 (serving 32000000 tokens)" in lines[0], res.output
    assert "2^24" in lines[0]


def test_dry_run_with_profiles_shows_each_profile_and_writes_nothing(tiny_model_dir, tmp_path):
    """``--dry-run`` with ``--profiles``: each profile's folder, reach and per-layer table, nothing written; what the
    export would refuse is refused as the export refuses it."""
    out = tmp_path / "p"
    res = CliRunner().invoke(main, ["patch", "--model", str(tiny_model_dir), "--strategy", "yarn:beta_fast=16",
                                    "--engine", "vllm", "--profiles", "2,1.5", "--dry-run", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    headings = [line for line in res.output.splitlines() if "dry run" in line]
    assert headings == [f"yarn:beta_fast=16 ×{s} on {tiny_model_dir}: profile-{s}x, serves {r} tokens for vllm "
                        "(dry run: nothing written)" for s, r in (("1.5", 48), ("2", 64))]
    table = [line.split() for line in res.output.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in table] == ["0", "0"] and all("yarn" in row for row in table)
    assert not out.exists()
    res = CliRunner().invoke(main, ["patch", "--model", str(tiny_model_dir), "--strategy", "yarn", "--profiles",
                                    "1,1000000", "--dry-run", "-q"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and "×1000000" in lines[0], res.output


def test_a_sweep_label_names_each_profile_factor_exactly():
    from ropescale.runs.config import parse_strategy

    assert parse_strategy({"name": "yarn", "profiles": [1.0000001, 1.0000002]}).display == \
        "yarn+profiles=1.0000001/1.0000002"  # f"{f:g}" wrote both as 1
    assert parse_strategy("yarn:profiles=[1,2,4]").display == "yarn+profiles=1/2/4"

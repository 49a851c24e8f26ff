import json

import pytest
from click.testing import CliRunner

import ropescale
from cli import main


@pytest.fixture
def run():
    runner = CliRunner()

    def _run(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return _run


def test_strategies_lists_all_with_params_and_sources(run):
    out = run("strategies").output
    # each strategy's header line starts at column 0 with its name: every name listed, once, in order
    listed = [line.split()[0] for line in out.splitlines() if line and not line[0].isspace()]
    assert listed == ropescale.strategy_names()
    assert "beta_fast (float, > 0; default 32.0)" in out and "arXiv:2309.00071" in out


def test_sweep_from_flags(run, tmp_path, tiny_model_dir, text_file):
    res = run("sweep", "--model", tiny_model_dir, "--data", text_file, "--strategy", "vanilla",
              "--strategy", "linear:factor=2", "--lengths", "32,64", "--max-windows", "4",
              "--device", "cpu", "-q", "-o", tmp_path)
    assert res.exit_code == 0, res.output
    assert "| linear:factor=2 |" in res.output
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["strategy"], r["length"]) for r in recs] == [
        ("vanilla", 32), ("linear:factor=2", 32), ("vanilla", 64), ("linear:factor=2", 64)]


def test_sweep_from_yaml_with_set(run, tmp_path, tiny_model_dir, text_file):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\ndata: {text_file}\nlengths: [32]\n"
                   f"strategies: [vanilla, ntk]\nmax_windows: 2\ndevice: cpu\noutput: {tmp_path / 'out'}\n")
    res = run("sweep", cfg, "--set", "lengths=[16,32]", "-q")
    assert res.exit_code == 0, res.output
    assert "| ntk |" in res.output and "16 (0.5T)" in res.output
    assert (tmp_path / "out" / "ppl_vs_length.png").exists()
    res = run("plot", tmp_path / "out" / "results.jsonl", "-o", tmp_path / "plots")
    assert res.exit_code == 0 and (tmp_path / "plots" / "ppl_vs_length.png").exists()


@pytest.mark.parametrize("args,match", [
    (["--lengths", "32", "--strategy", "yarnn"], "unknown strategy 'yarnn'"),
    (["--lengths", "32,x", "--strategy", "vanilla"], "comma-separated integers"),
    (["--strategy", "vanilla"], "lengths: Field required"),
    (["--lengths", "32", "--strategy", "vanilla", "--model", "reference"], "output: no results folder"),
])
def test_sweep_bad_input_is_one_clear_line(run, tmp_path, args, match):
    res = run("sweep", *args)
    assert res.exit_code != 0 and match in res.output and "Traceback" not in res.output


def test_bad_yaml_names_the_key(run, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("lengths: [32]\nstrategies: [vanilla]\nmax_window: 3\n")
    res = run("sweep", cfg, "-o", tmp_path / "o")
    assert res.exit_code == 1 and "max_window: unknown key" in res.output and "did you mean 'max_windows'" in res.output


def test_patch_saves_a_model_ropescale_loads_patched(run, tmp_path, tiny_model_dir, text_file):
    out = tmp_path / "patched"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "yarn:factor=4", "--output", out)
    assert res.exit_code == 0, res.output
    model, _ = ropescale.load_model(str(out), device="cpu")
    assert ropescale.current_patch(model).params["factor"] == 4.0
    # the sweep replaces the saved patch with each strategy it sweeps
    res = run("sweep", "--model", out, "--data", text_file, "--strategy", "vanilla", "--lengths", "32",
              "--max-windows", "2", "--device", "cpu", "-q", "-o", tmp_path / "s")
    assert res.exit_code == 0, res.output
    res = run("patch", "--model", tiny_model_dir, "--strategy", "yarn:factor=0", "--output", out)
    assert res.exit_code == 1 and "factor=0 is out of range" in res.output


def test_patch_options_reach_the_saved_record(run, tmp_path, tiny_model_dir):
    out = tmp_path / "dyn"
    res = run("patch", "--model", tiny_model_dir, "--strategy", "dynamic_yarn:logn=true",
              "--dynamic-cache", "rerotate", "--dynamic-block", "8", "--output", out)
    assert res.exit_code == 0, res.output
    assert "load it with ropescale.load_model" in res.output
    record = json.loads((out / "ropescale.json").read_text())
    assert record["dynamic_cache"] == "rerotate" and record["dynamic_block"] == 8 and record["logn"]
    model, _ = ropescale.load_model(str(out), device="cpu")
    h = ropescale.current_patch(model)
    assert h.options == {"dynamic_cache": "rerotate", "dynamic_block": 8, "logn": True}
    assert model.config._attn_implementation == "ropescale_logn_sdpa"

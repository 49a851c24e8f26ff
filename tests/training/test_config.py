"""Bad fine-tuning configs get one clear line through the CLI (exit 1, no traceback), naming
the key; good ones fill the strategy from L / T as sweeps do."""

import json

import pytest
from click.testing import CliRunner

from cli import main
from eval.config import ConfigError
from ropescale.training import build_finetune_config, resolve


def cli(*args):
    return CliRunner().invoke(main, ["finetune", *map(str, args)])


def one_line_error(res, *fragments):
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture
def write(tmp_path, tiny_run):
    def _write(**overrides):
        path = tmp_path / "ft.yaml"
        path.write_text(json.dumps(tiny_run(**overrides)))
        return path

    return _write


@pytest.mark.parametrize("overrides,fragments", [
    ({"stpes": 3}, ["stpes: unknown key; allowed: model, strategy,", "(did you mean 'steps'?)"]),
    ({"pose": {"chunk": 2}}, ["pose.chunk: unknown key; allowed: enabled, chunks, content", "'chunks'"]),
    ({"steps": 0}, ["steps: must be at least 1 optimiser step; got 0"]),
    ({"steps": -5}, ["steps: must be at least 1"]),
    ({"strategy": "yarnn"}, ["strategy: unknown strategy 'yarnn'", "did you mean 'yarn'"]),
    ({"strategy": "yarn:beta_fast=-1"}, ["strategy:", "beta_fast=-1", "out of range"]),
    ({"pose": True, "length": 32}, ["pose: length 32 is not above the model's original window T = 32"]),
    ({"pose": True, "length": 24}, ["pose: length 24 is not above"]),
    ({"pose": True, "strategy": "rerope"}, ["pose: rerope is a truncation rule", "position_ids"]),
    ({"pose": {"chunks": 40}}, ["pose.chunks: 40 chunks cannot split a window of T = 32"]),
    ({"mixed_precision": "fp16"}, ["fp16 needs a CUDA device"]),
    ({"lr": 0}, ["lr: Input should be greater than 0"]),
    ({"eval": {"every": 2, "data": "SAME"}}, ["is also the training data"]),
    ({"eval": {"after": [{"task": "passky"}]}}, ["eval.after.0", "unknown task 'passky'"]),
    ({"eval": {"after": [{"task": "perplexity", "model": "x"}]}}, ["eval.after: entry 0: model are set by"]),
    ({"model": "./no/such/model"}, ["no such model folder"]),
    ({"data": "/no/such/text.txt"}, ["/no/such/text.txt"]),
    ({"attention_path": "fastest", "strategy": "rerope"}, ["attention_path='fastest'"]),
])
def test_bad_config_one_line(write, tmp_path, overrides, fragments):
    if overrides.get("eval", {}).get("data") == "SAME":
        overrides = {"eval": {"data": json.loads(write().read_text())["data"]}}
    one_line_error(cli(write(**overrides), "-q", "-o", tmp_path / "out"), *fragments)


def test_missing_file_and_missing_output(tmp_path, write):
    one_line_error(cli(tmp_path / "nope.yaml"), "nope.yaml: no such file")
    one_line_error(cli(write()), "output: no run folder")


def test_output_not_writable(tmp_path, write):
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line_error(cli(write(output=str(blocker)), "-q"), "is a file, not a folder")
    one_line_error(cli(write(), "-q", "-o", blocker / "sub"), "a part of the path is a file")


def test_strategy_parameters_filled_from_the_target_length(tiny_run):
    run = resolve(build_finetune_config(tiny_run(strategy="yarn", length=128, eval={"data": "x.txt"})))
    assert run.train_length == 32 and run.params["factor"] == 4.0 and run.window == 128
    assert run.eval_lengths == [32, 64, 128]  # T, 2T, ..., L
    pose = resolve(build_finetune_config(tiny_run(strategy="pi_over_2n", pose=True, eval=None)))
    assert pose.params == {"n_max": 64.0} and pose.window == 32
    explicit = resolve(build_finetune_config(tiny_run(strategy="linear:factor=8", eval=None)))
    assert explicit.params == {"factor": 8.0}


def test_set_overrides_and_flags(tmp_path, write):
    from ropescale.training import load_finetune_config

    cfg = load_finetune_config(write(), ["pose.chunks=3", "lr=1e-4"], {"steps": 9, "model": None})
    assert cfg.pose.enabled and cfg.pose.chunks == 3 and cfg.lr == 1e-4 and cfg.steps == 9
    with pytest.raises(ConfigError, match="steps: must be at least 1"):
        load_finetune_config(write(), ["steps=0"])


def test_cli_runs_and_reports(tmp_path, write):
    res = cli(write(steps=2, eval={"every": 2, "data": json.loads(write().read_text())["eval"]["data"],
                                   "max_windows": 2, "lengths": [64]}), "-q", "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "fine-tuned linear for 2 steps" in res.output and "held-out PPL 64:" in res.output
    assert (tmp_path / "out" / "model" / "finetune.json").is_file()

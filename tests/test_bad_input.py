"""Everyday mistakes end in one clear line (exit code 1, no traceback) or a warning, never a
silently wrong number. One case per item of the trustworthy-runs issue's battery."""

import json
import logging

import pytest
import torch
from click.testing import CliRunner

import ropescale
from cli import main


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(res, message):
    out = res.output.strip().splitlines()
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and out[-1].startswith("Error: ") and message in out[-1], res.output
    return out[-1]


@pytest.fixture
def sweep_args(tiny_model_dir, text_file, tmp_path):
    return ["sweep", "--model", tiny_model_dir, "--data", text_file, "--strategy", "vanilla", "--lengths", "32",
            "--max-windows", "2", "-q"]


@pytest.mark.parametrize("model,message", [
    ("/tmp/ropescale-no-such-model", "/tmp/ropescale-no-such-model: no such model folder"),
    ("some-org/some-model", "cannot load 'some-org/some-model': not a bundled name (reference, kjv-llama), "
                            "not a local folder, and the hub is offline (HF_HUB_OFFLINE=1)"),
])
def test_missing_model_and_offline_hub_id(tmp_path, text_file, model, message):
    one_line_error(cli("sweep", "--model", model, "--data", text_file, "--strategy", "vanilla", "--lengths", 32,
                       "-o", tmp_path / "o"), message)
    one_line_error(cli("patch", "--model", model, "--strategy", "yarn:factor=2", "-o", tmp_path / "p"), message)
    with pytest.raises(ropescale.models.ModelLoadError, match="no such model folder|hub is offline"):
        ropescale.load_model(model)


def test_garbled_safetensors(tmp_path, tiny_model_dir, text_file):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    # the line names the damaged file and what to do, not the loader's "incomplete metadata"
    message = f"{bad / 'model.safetensors'} is truncated or corrupt: its tensors need"
    one_line_error(cli("sweep", "--model", bad, "--data", text_file, "--strategy", "vanilla", "--lengths", 32,
                       "-o", tmp_path / "o"), message)
    with pytest.raises(ropescale.models.ModelLoadError, match="re-save or re-download it$") as err:
        ropescale.load_model(str(bad))
    assert str(err.value).startswith(message)
    (bad / "model.safetensors").write_bytes(data[:50])  # cut inside the header
    with pytest.raises(ropescale.models.ModelLoadError, match=r"model.safetensors is truncated or corrupt: its "
                                                              r"header claims \d+ bytes, the file has 50"):
        ropescale.load_model(str(bad))


@pytest.mark.parametrize("extra,message", [
    (["--strategy", "yarn:factor=[2,3]"], "yarn: parameter factor=[2, 3] must be a number"),
    (["--set", "lengths=[128"], "--set 'lengths=[128': cannot read '[128'"),
    (["--set", "lengths=[128,\t256]"], "--set 'lengths=[128,\\t256]': cannot read"),
    (["--device", "cuda"], "device 'cuda': CUDA is not available on this machine"),
    (["--device", "banana"], "device 'banana' unknown; use auto, cpu, cuda, cuda:N or mps"),
    (["--set", "threads=100000"], "threads: 100000 threads on a machine with"),
    (["--strategy", "vanilla"], "strategies: entry 1 ('vanilla') repeats entry 0"),
    (["--set", "position_buckets=100000"], "position_buckets: Input should be less than or equal to 1024"),
])
def test_bad_flags(sweep_args, tmp_path, extra, message):
    one_line_error(cli(*sweep_args, *extra, "-o", tmp_path / "o"), message)


def test_a_bad_logn_names_the_entry_and_the_key(sweep_args, tmp_path):
    line = one_line_error(cli(*sweep_args, "--strategy", "yarn:logn=maybe", "-o", tmp_path / "o"), "entry 1")
    assert line == ("Error: flags: strategies: entry 1 ('yarn:logn=maybe'): logn: Input should be a valid boolean, "
                    "unable to interpret input")


def test_list_parameters_in_the_flag_syntax():
    from eval.config import parse_strategy

    spec = parse_strategy("longrope:short_factor=[1,1,1,1],long_factor=[2,2,4,4],factor=4")
    assert spec.params == {"short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 4, 4], "factor": 4}


def test_output_in_the_way(sweep_args, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    # output: in a config (the -o flag is checked by click itself, with its own one-line usage error)
    one_line_error(cli(*sweep_args, "--set", f"output={a_file}"), f"output {a_file} is a file, not a folder")
    one_line_error(cli(*sweep_args, "--set", f"output={a_file / 'sub'}"), "a part of the path is a file")


def test_output_not_writable(sweep_args, tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)  # root ignores mode bits: simulate a read-only folder
    one_line_error(cli(*sweep_args, "-o", tmp_path / "ro"), "cannot write there (Permission denied)")


def test_plot_on_a_binary_file_and_on_a_foreign_record(tmp_path):
    binary = tmp_path / "x.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line_error(cli("plot", binary), "not a results file (not UTF-8 text)")
    foreign = tmp_path / "y.jsonl"
    foreign.write_text(json.dumps({"ppl": 3}) + "\n" + json.dumps([1, 2]) + "\n")
    one_line_error(cli("plot", foreign), "line 1 is not a ropescale result record (cell: required key is missing")


def test_sliding_mode_refuses_lengths_the_data_cannot_fill(tmp_path, tiny_model_dir):
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.")
    one_line_error(cli("sweep", "--model", tiny_model_dir, "--data", short, "--strategy", "vanilla",
                       "--lengths", 1024, "--mode", "sliding", "-o", tmp_path / "o"),
                   "dataset too short for length 1024: the longest document has 11 tokens")


@pytest.mark.parametrize("value", [0, -5, 1, 2.5, True])
def test_training_window_must_be_a_positive_length(tiny_llama, value):
    for name in ("dynamic_ntk", "llama3", "yarn"):
        with pytest.raises(ValueError,
                           match="original_max_position_embeddings=.* must be a whole number of tokens >= 2"):
            ropescale.patch(tiny_llama, name, original_max_position_embeddings=value,
                            **({} if name == "dynamic_ntk" else {"factor": 4}))
    assert ropescale.current_patch(tiny_llama) is None


def test_training_window_in_the_cli_and_config(tmp_path, sweep_args):
    one_line_error(cli("patch", "--model", "reference", "--strategy", "dynamic_ntk",
                       "--original-max-position-embeddings", -5, "-o", tmp_path / "p"),
                   "original_max_position_embeddings=-5 must be a whole number")
    one_line_error(cli(*sweep_args, "--set", "original_max_position_embeddings=0", "-o", tmp_path / "o"),
                   "original_max_position_embeddings: Input should be greater than or equal to 2")


@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_logn_must_be_a_boolean(tiny_llama, value):
    with pytest.raises(ValueError, match="logn=.* must be True or False"):
        ropescale.patch(tiny_llama, "vanilla", logn=value)


def test_random_bytes_as_text_warn(tmp_path, caplog):
    from ropescale.runs.data import DataSpec, load_documents

    noise = tmp_path / "noise.txt"
    noise.write_bytes(torch.randint(128, 256, (4000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
                      .numpy().tobytes())
    with caplog.at_level(logging.WARNING, logger="ropescale"):
        load_documents(DataSpec(str(noise)))
    assert "of the characters are not valid UTF-8 and were replaced" in caplog.text


def test_duplicate_yaml_keys(tmp_path):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("lengths: [32]\nstrategies: [vanilla]\nlengths: [64]\n")
    one_line_error(cli("sweep", cfg, "-o", tmp_path / "o"), "key 'lengths' is given twice (lines 1 and 3)")


NOTED = ["rerope:window=64", "self_extend:window=64,group_size=4", "dpe:window=64",
         "string:shifted_offset=64,local_window=8,attention_factor=1"]
NOT_NOTED = ["rerope:window=16", "string:shifted_offset=64,local_window=8", "dca:chunk_size=64,local_window=8",
             {"name": "rerope", "params": {"window": 64}, "logn": True}]


def test_a_rule_that_never_applies_is_noted_and_its_cell_is_vanilla(tmp_path, tiny_model_dir, text_file, caplog):
    """The note is read from the rule (``Strategy.exact_below``), not from a parameter called ``window``, so it
    holds for STRING (whose neighbour band is ``shifted_offset``) and never for a rule with a factor, a chunked
    rule or a query temperature; where it is given, the cell's PPL is vanilla's — the claim checked, not echoed."""
    from eval.config import build_config
    from eval.sweep import run_sweep

    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32],
                        "strategies": ["vanilla", *NOTED, *NOT_NOTED], "max_windows": 2, "device": "cpu"})
    with caplog.at_level(logging.WARNING, logger="ropescale"):
        vanilla, *rest = run_sweep(cfg, tmp_path, progress=False)
    noted, not_noted = rest[:len(NOTED)], rest[len(NOTED):]
    for r in noted:
        assert r["note"].startswith("every distance below 64 is plain RoPE"), r["strategy"]
        assert r["ppl"] == pytest.approx(vanilla["ppl"], rel=1e-9) and "same_as" not in r, r["strategy"]
    # the random tiny model barely reads positions: a rule that applies moves its PPL by ~1e-6, relative
    assert abs(not_noted[0]["ppl"] / vanilla["ppl"] - 1) > 1e-7  # rerope:window=16 < 32 applies
    assert [r.get("note") for r in not_noted] == [None] * len(NOT_NOTED)
    assert "equals vanilla" in caplog.text


def test_the_note_reads_the_rule_with_the_models_own_dca_sizes(tmp_path, tiny_model_dir, text_file):
    """The note builds the rule with the model's ``dual_chunk_attention_config``, as ``resolve`` and the patch do:
    built from T alone, DCA's default local window (T // 8 = 4) refused the cell's chunk_size=3 that the model's
    local_size 1 allows, and the whole sweep stopped."""
    import shutil

    from eval.config import build_config
    from eval.sweep import run_sweep

    model = tmp_path / "dca-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["dual_chunk_attention_config"] = {"chunk_size": 64, "local_size": 1}
    (model / "config.json").write_text(json.dumps(config))
    cfg = build_config({"model": str(model), "data": str(text_file), "lengths": [64],
                        "strategies": ["dca:chunk_size=3"], "max_windows": 1, "device": "cpu"})
    (r,) = run_sweep(cfg, tmp_path / "o", progress=False)
    assert r["ppl"] > 0 and r.get("note") is None


LM_EVAL_TASK = ["--tasks", "tiny_rolling", "--device", "cpu"]


@pytest.mark.parametrize("model_args,message", [
    ("pretrained=reference,strategy=bogus", "unknown strategy 'bogus'; known strategies: "),
    ("pretrained=reference,strategy=linear,factor=-1", "linear: parameter factor=-1.0 is out of range; allowed: >= 1"),
    ("pretrained=/tmp/ropescale-no-such-model,strategy=yarn,factor=2",
     "/tmp/ropescale-no-such-model: no such model folder"),
    ("strategy=yarn,factor=2", "pretrained: missing; give pretrained=NAME"),
    ("pretrained=reference,strategy=dynamic_ntk,dynamic_cache=bogus",
     "dynamic_cache='bogus'; choose one of recompute, rerotate"),
    ("pretrained=reference,strategy=yarn,factor=2,logn=maybe", "logn='maybe' must be True or False"),
    ("pretrained=reference,dtype=float64", "dtype='float64'; choose one of float32, bfloat16, float16"),
    ("pretrained=reference,strategy=linear,fctor=4", "fctor: unknown key (did you mean 'factor'?)"),
    ("pretrained=reference,strategy=linear", "linear: parameter factor is required"),
    ("pretrained=reference,strategy=linear,factor=2,max_length=0", "max_length=0 must be a whole number"),
])
def test_lm_eval_bad_model_args(model_args, message):
    pytest.importorskip("lm_eval")
    line = one_line_error(cli("lm-eval", "--model", "ropescale", "--model_args", model_args, *LM_EVAL_TASK), message)
    assert line.startswith("Error: lm-eval: model_args: "), line


def test_lm_eval_bad_include_path_and_no_arguments():
    pytest.importorskip("lm_eval")
    one_line_error(cli("lm-eval", "--model", "ropescale", "--model_args", "pretrained=reference",
                       "--include_path", "/tmp/ropescale-no-such-tasks", *LM_EVAL_TASK),
                   "--include_path /tmp/ropescale-no-such-tasks: no such file or folder")
    one_line_error(cli("lm-eval"), "lm-eval: no arguments; e.g. ropescale lm-eval --model ropescale")
    one_line_error(cli("lm-eval", "--model", "ropescale", "--model_args", "pretrained=reference"),
                   "lm-eval: no --tasks; give --tasks TASK")


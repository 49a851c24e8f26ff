import json

import pytest
import torch
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


def test_lengths_given_twice_are_both_run(run, tmp_path, tiny_model_dir, text_file):
    """``--lengths 32 --lengths 64`` ran 64 only (click kept the last); every occurrence counts, as ``--strategy``'s."""
    res = run("sweep", "--model", tiny_model_dir, "--data", text_file, "--strategy", "vanilla", "--lengths", "32",
              "--lengths", "64", "--max-windows", "2", "--device", "cpu", "-q", "-o", tmp_path)
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["length"] for r in recs] == [32, 64]


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
    (["--strategy", "vanilla"], "lengths: required key is missing"),
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


# --- errors: a user's mistake is one line; anything else is a bug shown as one ------------------

def test_user_error_is_exactly_one_line_exit_1(run, tmp_path, tiny_model_dir):
    res = run("patch", "--model", tiny_model_dir, "--strategy", "yarn:factor=0", "--output", tmp_path / "p")
    assert res.exit_code == 1
    assert res.output.splitlines() == [
        "Error: yarn: parameter factor=0 is out of range; allowed: >= 1"], res.output


@pytest.mark.parametrize("error", [ZeroDivisionError("division by zero"), ValueError("internal: shapes differ"),
                                   OSError("internal: disk")])
def test_a_bug_shows_its_traceback_and_asks_for_a_report(run, tmp_path, tiny_model_dir, text_file, monkeypatch,
                                                          error):
    """Before issue 17 a ZeroDivisionError escaped click (CliRunner raised it; a shell printed a bare
    traceback, exit 1, no report line), and a ValueError or OSError from a bug was caught by the
    commands' `except (ValueError, OSError)` and printed as `Error: internal: ...`, exit 1 — a bug
    disguised as a mistake in the input."""
    import eval.sweep

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(eval.sweep, "run_sweep", broken)
    res = run("sweep", "--model", tiny_model_dir, "--data", text_file, "--strategy", "vanilla", "--lengths", "32",
              "-q", "-o", tmp_path / "o")
    from cli import BUG_EXIT, BUG_REPORT

    lines = res.output.strip().splitlines()
    assert res.exit_code == BUG_EXIT == 70
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-3] == f"{type(error).__name__}: {error}" and lines[-2] == ""
    assert lines[-1] == BUG_REPORT and "please report it" in BUG_REPORT
    assert not any(line.startswith("Error:") for line in lines)


@pytest.mark.parametrize("args,message", [
    (["sweep", "--no-such-option"], "Error: No such option '--no-such-option'."),
    (["patch", "--strategy", "yarn"], "Error: Missing option '--model'."),
    (["compare", "--length", "512", "-o", "f.png"], "Error: Missing argument 'RUNS...'."),
    (["eval", "--dtype", "float8"],
     "Error: Invalid value for '--dtype': 'float8' is not one of 'auto', 'float32', 'bfloat16', 'float16'."),
    (["inspect", "--strategy", "yarn", "--length", "many", "-o", "o"],
     "Error: Invalid value for '--length': 'many' is not a valid integer."),
    (["reference", "train", "-o", "m", "--steps", "0"],
     "Error: Invalid value for '--steps': 0 is not in the range x>=1."),
    (["no-such-command"], "Error: No such command 'no-such-command'."),
    (["--no-such-option"], "Error: No such option '--no-such-option'."),
])
def test_click_usage_errors_are_one_line_and_exit_1(tmp_path, monkeypatch, args, message):
    """Click's own usage errors (an unknown option or command, a missing argument, a bad choice or
    number) exited 2 with click's `Usage:` and `Try ... for help` lines, where every other refused
    input is one line `Error: ...` and exit 1 (issue 30): now the same, with click's message."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert res.stderr.splitlines() == [message] and res.stdout == ""
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_group_without_its_subcommand_still_prints_its_help():
    res = CliRunner().invoke(main, ["reference"])
    assert res.exit_code == 2 and "train" in res.output and "card" in res.output


def test_lm_eval_without_arguments_is_not_a_silent_success(run):
    pytest.importorskip("lm_eval")
    res = run("lm-eval")
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert res.output.startswith("Error: lm-eval: no arguments; e.g. ropescale lm-eval --model ropescale ")


# --- the former `python -m` entry points ---------------------------------------------------------

def test_base_bound_prints_the_table(run):
    from eval.inspect import base_bound_table

    res = run("base-bound", "--dims", "16,32", "--lengths", "64,128")
    assert res.exit_code == 0, res.output
    assert res.output == base_bound_table([16, 32], [64, 128], paper_fit=False)
    lines = res.output.splitlines()
    assert lines[0] == "| L | d = 16 | d = 32 |" and [line.split(" | ")[0] for line in lines[2:]] == ["| 64", "| 128"]


@pytest.mark.parametrize("args,message", [
    (["--dims", "33"], "Error: Invalid value for '--dims': '33': each must be an even number from 2 to 65536; got 33"),
    (["--lengths", "64,x"], "Error: Invalid value for '--lengths': '64,x': expected comma-separated whole numbers"),
    # went to the allocator: a [L, d/2] table of 10^11 rows, or of 5·10^5 columns
    (["--lengths", "100000000000"],
     "Error: Invalid value for '--lengths': '100000000000': each must be from 2 to 16777216; got 100000000000"),
    (["--dims", "16,1000000"],
     "Error: Invalid value for '--dims': '16,1000000': each must be an even number from 2 to 65536; got 1000000"),
])
def test_base_bound_refuses_bad_numbers(run, args, message):
    res = run("base-bound", *args)
    assert res.exit_code == 1 and res.output.splitlines() == [message]


def test_base_bound_refuses_a_table_beyond_memory_before_computing(run):
    res = run("base-bound", "--dims", "65536", "--lengths", "16777216")  # 2^24 × 2^15 pairs, float64
    assert res.exit_code == 1 and len(res.output.splitlines()) == 1
    assert res.output.startswith("Error: base-bound at L = 16777216 tokens, d = 65536 needs about 16,384 GiB")


def test_base_bound_marks_a_cell_no_base_reaches_and_prints_the_rest(run):
    """d = 2 has one pair, θ_0 = b^0 = 1 for every base: B(m) = cos m, and cos 2 < 0 — no base keeps
    B(m) >= 0 for m < L >= 3. One such cell refused the whole table."""
    import math

    from ropescale.geometry import smallest_base

    assert math.cos(2) < 0
    res = run("base-bound", "--dims", "2,16", "--lengths", "64,128")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[:4] == ["| L | d = 2 | d = 16 |", "|---:|---:|---:|",
                         f"| 64 | — | {smallest_base(16, 64):.3g} |", f"| 128 | — | {smallest_base(16, 128):.3g} |"]
    assert lines[4] == "" and lines[5].startswith("—: no base up to 1e+12 keeps B(m) >= 0 for every m < L at this d")


def test_base_bound_table_checks_its_numbers_too():
    from eval.inspect import base_bound_table
    from ropescale.errors import InvalidInput

    for dims, lengths, match in [([3], [64], "dims: 3: a rotary dim d is an even number from 2 to 2"),
                                 ([16], [10 ** 11], "lengths: 100000000000: a length L is from 2 to 2"),
                                 ([16], [], "lengths: none given")]:
        with pytest.raises(InvalidInput, match=match):
            base_bound_table(dims, lengths)


def test_reference_train_help_shows_the_recipe_mixes(run):
    from eval.reference.train import COPY_MIX, DEFAULT_MIX, mix_text

    out = "".join(run("reference", "train", "-h").output.split())  # click wraps inside long words too
    assert f"[default:{mix_text(DEFAULT_MIX)}]" in out and f"[default:{mix_text(COPY_MIX)}]" in out


@pytest.mark.parametrize("args,message", [
    (["train", "-o", "{tmp}/m", "--mix", "kjv=a"],
     "--mix 'kjv=a': 'kjv=a' is not KIND=SHARE with a share >= 0 (kinds: kjv, passkey, needle, repeat, random)"),
    (["train", "-o", "{tmp}/m", "--copy-mix", "kjv=1,poems=1"],
     "--copy-mix: unknown kinds ['poems']; known: kjv, passkey, needle, repeat, random"),
    (["train", "-o", "{tmp}/m", "--mix", "kjv=0"], "--mix 'kjv=0': the shares add up to 0"),
    (["train", "-o", "{tmp}/m", "--init", "{tmp}/none"],
     "--init {tmp}/none: no config.json (a model folder `ropescale reference train` wrote)"),
    (["card", "--model", "{tmp}/none"],
     "--model {tmp}/none: no training.json (a model folder `ropescale reference train` wrote)"),
])
def test_reference_commands_refuse_bad_input_in_one_line(run, tmp_path, args, message):
    res = run("reference", *[a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 1
    assert res.output.splitlines() == ["Error: " + message.format(tmp=tmp_path)]
    assert not (tmp_path / "m").exists()


def _cores() -> int:
    import os

    return os.cpu_count() or 1


@pytest.mark.parametrize("args,message", [
    (["-o", "{tmp}/file/m"], "--output {tmp}/file/m: a part of the path ({tmp}/file) is a file, not a folder"),
    (["-o", "{tmp}/m", "--threads", "{many}"],
     "--threads: {many} threads on a machine with {cores} CPU cores; use at most {cores}"),
])
def test_reference_train_refuses_its_output_and_threads_before_training(run, tmp_path, monkeypatch, args, message):
    """The output folder was checked only after training (a read-only --output lost the trained
    model), and --threads 64 was taken on 2 cores."""
    import eval.reference.train as ref

    monkeypatch.setattr(ref, "train_tokenizer", lambda *a, **k: pytest.fail("training started"))
    (tmp_path / "file").write_text("")
    fmt = {"tmp": tmp_path, "many": _cores() + 1, "cores": _cores()}
    res = run("reference", "train", *[a.format(**fmt) for a in args])
    assert res.exit_code == 1 and res.output.splitlines() == ["Error: " + message.format(**fmt)]
    assert not (tmp_path / "m").exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes in read-only folders")
def test_reference_train_refuses_a_read_only_output_before_training(run, tmp_path, monkeypatch):
    import eval.reference.train as ref

    monkeypatch.setattr(ref, "train_tokenizer", lambda *a, **k: pytest.fail("training started"))
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        res = run("reference", "train", "-o", tmp_path / "ro" / "m")
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert res.exit_code == 1 and "cannot write in" in res.output and len(res.output.splitlines()) == 1


@pytest.mark.parametrize("content,args,message", [
    ("{{not json", [], "--model {m}: {m}/training.json is not JSON (Expecting property name enclosed in double "
                       "quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", [], "--model {m}: {m}/training.json: the file is not a mapping of the training record but a list"),
    ('{{"seed": 0}}', [], "--model {m}: {m}/training.json lacks steps, batch_size, window,"),
    ("TRAINED", ["--threads", "{many}"], "--threads: {many} threads on a machine with {cores} CPU cores"),
    ("TRAINED", ["--plot", "{m}/curves.txt"],
     "--plot {m}/curves.txt: the extension .txt is not a figure format; use one of "),
])
def test_reference_card_refuses_before_measuring(run, tmp_path, monkeypatch, content, args, message):
    """A training.json that is not JSON ended in a traceback (after the model was loaded); keys it
    lacks, after three minutes of measuring."""
    import eval.reference.card as card
    from ropescale.models import REFERENCE_MODEL

    monkeypatch.setattr(card, "measure", lambda *a, **k: pytest.fail("measuring started"))
    m = tmp_path / "m"
    m.mkdir()
    bundled = (REFERENCE_MODEL / "training.json").read_text()  # a valid record
    (m / "training.json").write_text(bundled if content == "TRAINED" else content.format())
    fmt = {"m": m, "many": _cores() + 1, "cores": _cores()}
    res = run("reference", "card", "--model", m, *[a.format(**fmt) for a in args])
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: " + message.format(**fmt)), lines
    assert "--plot" not in args or (".png" in lines[0] and ".pdf" in lines[0])


def test_patch_dry_run_reports_each_layer_and_writes_nothing(run, tmp_path):
    """Cohere2 rotates its sliding layers only (models/cohere2/modeling_cohere2.py): the report says
    so per layer, from the model, and nothing is written."""
    from transformers import AutoTokenizer, Cohere2Config, Cohere2ForCausalLM

    from ropescale.models import REFERENCE_MODEL

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    cfg = Cohere2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, sliding_window=8,
                        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    Cohere2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run("patch", "--model", tmp_path / "m", "--strategy", "rerope:window=16", "--dry-run")
    assert res.exit_code == 0, res.output
    table = [line.split() for line in res.output.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in table] == ["0", "1", "2", "3"]
    assert [row[1] for row in table] == ["rope", "rope", "rope", "none"]
    assert all(row[-1] == "rerope" for row in table[:3]) and res.output.rstrip().endswith("no RoPE, untouched")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_patch_without_output_or_dry_run_is_one_line(run, tiny_model_dir):
    res = CliRunner().invoke(main, ["patch", "--model", str(tiny_model_dir), "--strategy", "vanilla"])
    assert res.exit_code == 1
    assert res.output.strip() == "Error: patch needs --output (the folder to write), or --dry-run"


# --- `sweep` is `eval --task perplexity` ---------------------------------------------------------

@pytest.fixture
def parsed_runs(monkeypatch):
    """The ``(EvalConfig, output)`` each invocation hands to the run, instead of running it."""
    import eval.report
    import eval.sweep

    runs = []
    monkeypatch.setattr(eval.sweep, "run_sweep", lambda cfg, out, progress: runs.append((cfg, out, progress)) or [])
    monkeypatch.setattr(eval.report, "markdown_report", lambda records: "")
    return runs


@pytest.mark.parametrize("args", [
    ["--model", "m", "--data", "d.txt", "--strategy", "vanilla", "--strategy", "yarn:factor=4", "--lengths", "32,64",
     "--mode", "sliding", "--stride", "16", "--max-windows", "3", "--batch-size", "2", "--dynamic-block", "8",
     "--dtype", "float32", "--device", "cpu", "-q", "-o", "out"],
    ["{cfg}"],
    ["{cfg}", "--set", "lengths=[16]", "--max-windows", "5", "-o", "elsewhere"],
])
def test_sweep_and_eval_task_perplexity_parse_the_same_run(run, parsed_runs, tmp_path, args):
    """Before issue 30 eval lacked sweep's --mode, --stride, --max-windows, --batch-size and
    --dynamic-block: `eval --task perplexity --max-windows 3` was a usage error."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\ndata: d.txt\nlengths: [32, 64]\nstrategies: [vanilla, ntk]\nmode: sliding\n"
                   "output: out\n")
    args = [a.format(cfg=cfg) for a in args]
    for command in (["sweep"], ["eval", "--task", "perplexity"]):
        res = run(*command, *args)
        assert res.exit_code == 0, res.output
    (a, out_a, progress_a), (b, out_b, progress_b) = parsed_runs
    assert a.task == b.task == "perplexity"
    assert a.model_dump() == b.model_dump() and (out_a, progress_a) == (out_b, progress_b)
    if "--mode" in args:
        assert (a.options.mode, a.options.stride, a.options.max_windows, a.options.batch_size,
                a.options.dynamic_block) == ("sliding", 16, 3, 2, 8)


def test_sweep_has_evals_parameters_less_the_task():
    from cli import eval_cmd, sweep

    assert [p.name for p in sweep.params] == [p.name for p in eval_cmd.params if p.name != "task"]
    assert all(p is q for p, q in zip(sweep.params, (p for p in eval_cmd.params if p.name != "task")))


PERPLEXITY_ONLY = "task is 'passkey'; `ropescale sweep` and the perplexity flags"


@pytest.mark.parametrize("command,config,message", [
    (["sweep"], "task: passkey\n", PERPLEXITY_ONLY),
    (["eval", "--max-windows", "2"], "task: passkey\n", PERPLEXITY_ONLY),
    (["eval", "--task", "passkey", "--mode", "sliding", "--stride", "8"], "",
     "--mode, --stride: the perplexity task's flags; --task passkey takes its options with --set passkey.KEY=VALUE"),
])
def test_perplexity_flags_and_sweep_refuse_another_task(run, parsed_runs, tmp_path, command, config, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: m\nlengths: [32]\nstrategies: [vanilla]\n{config}")
    res = run(*command, cfg, "-o", tmp_path / "o")
    lines = res.output.splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert parsed_runs == [] and not (tmp_path / "o").exists()


def test_eval_without_perplexity_flags_still_runs_a_config_of_another_task(run, parsed_runs, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nlengths: [32]\nstrategies: [vanilla]\ntask: passkey\n")
    res = run("eval", cfg, "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert [c.task for c, _, _ in parsed_runs] == ["passkey"]

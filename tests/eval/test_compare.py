"""The training log's curves and the comparison figure, on a hand-written log."""

import pytest
from click.testing import CliRunner

from cli import main
from eval.compare import by_step_table, final_table, plot_runs
from ropescale.training.report import TrainingLog, eval_curve, read_log, steps_to_reach

LOG = [{"step": 0, "ppl": {"128": 40.0, "512": 70.0}},
       {"step": 1, "loss": 3.5, "lr": 1e-4, "tokens": 10, "tokens_per_s": 5.0},
       {"step": 50, "ppl": {"128": 38.0, "512": 45.0}},
       {"step": 100, "ppl": {"128": 37.0, "512": 39.5}}]


def test_curve_and_steps_to_reach():
    assert eval_curve(LOG, 512) == [(0, 70.0), (50, 45.0), (100, 39.5)]
    assert steps_to_reach(LOG, 512, 45.0) == 50 and steps_to_reach(LOG, 512, 45.1) == 50
    assert steps_to_reach(LOG, 512, 80.0) == 0 and steps_to_reach(LOG, 512, 39.0) is None


def test_log_keeps_what_a_resumed_run_does_not_rewrite(tmp_path):
    log = TrainingLog(tmp_path / "log.jsonl")
    for r in LOG:
        log.write(r)
    (tmp_path / "log.jsonl").open("a").write('{"step": 10')  # torn line of a killed run
    assert read_log(tmp_path) == LOG
    log.keep_through(50)
    assert read_log(tmp_path) == LOG[:3]
    log.keep_through(-1)
    assert read_log(tmp_path) == []
    TrainingLog(tmp_path / "other.jsonl", enabled=False).write(LOG[0])  # not the main process
    assert not (tmp_path / "other.jsonl").exists()


def test_plot_runs_writes_a_png(tmp_path):
    path = plot_runs({"a": LOG, "b": LOG[:2]}, 512, tmp_path / "x" / "ppl.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_read_the_log_at_the_asked_steps():
    runs = {"a": LOG, "b": [{"step": 0, "ppl": {"512": 50.0}}, {"step": 50, "ppl": {"512": 41.0}},
                            {"step": 50, "loss": 3.0, "tokens": 99}]}
    by_step = by_step_table(runs, 512, [0, 50, 100]).splitlines()
    assert by_step[-2:] == ["| a | 70.00 | 45.00 | 39.50 |", "| b | 50.00 | 41.00 | — |"]
    final = final_table(runs, 512, 39.5, "a").splitlines()
    # b's last PPL @ 512 is 41.0: above 39.5, within 5% (41.475); a reaches 39.5 at 100 and 41.475 at 100
    assert final[-2:] == ["| a | 1 | 10 | 37.00 | 39.50 | 100 | 100 |",
                          "| b | 50 | 99 | nan | 41.00 | not reached | 50 |"]


def cli(*args):
    return CliRunner().invoke(main, ["compare", *map(str, args)], catch_exceptions=False)


def test_comparison_cli_draws_and_prints_the_tables(tmp_path):
    runs = []
    for name, log in (("a", LOG), ("b", LOG[:3])):
        run = tmp_path / name
        run.mkdir()
        for r in log:
            TrainingLog(run / "log.jsonl").write(r)
        runs.append(run)
    res = cli(*runs, "--length", 512, "--at", "0,50,100", "-o", tmp_path / "f.png", "--title", "t")
    assert res.exit_code == 0, res.output
    records = {"a": LOG, "b": LOG[:3]}
    assert res.output == (by_step_table(records, 512, [0, 50, 100]) + "\n\n" + final_table(records, 512, 39.5, "a")
                          + f"\n\nfigure: {tmp_path / 'f.png'}\n")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["{run}", "--length", "999"], "--length 999: run has no held-out PPL at it; evaluated: [128, 512]"),
    (["{run}", "--length", "512", "--at", "0,x"],
     "Invalid value for '--at': '0,x': comma-separated step numbers, e.g. 0,50,100"),
    (["{run}", "--length", "512", "--before", "{tmp}/nope"],
     "--before {tmp}/nope: no results.jsonl (a harness results folder)"),
    (["{tmp}/nope", "--length", "512"], "{tmp}/nope: no log.jsonl (a fine-tuning output folder)"),
])
def test_comparison_cli_refuses_bad_input_in_one_line(tmp_path, args, message):
    """What the arguments name cannot be used: one line, exit 1, as every command refuses input;
    an option value click cannot parse (--at 0,x) too (click's usage error, which exited 2)."""
    run = tmp_path / "run"
    run.mkdir()
    TrainingLog(run / "log.jsonl").write(LOG[0])
    res = cli(*[a.format(run=run, tmp=tmp_path) for a in args], "-o", tmp_path / "f.png")
    lines = res.output.strip().splitlines()
    assert "Traceback" not in res.output and lines[-1] == "Error: " + message.format(tmp=tmp_path)
    assert res.exit_code == 1 and len(lines) == 1
    assert not (tmp_path / "f.png").exists()


def _run(folder, log=LOG, label=None):
    import json

    folder.mkdir(parents=True)
    for r in log:
        TrainingLog(folder / "log.jsonl").write(r)
    if label:
        (folder / "model").mkdir()
        (folder / "model" / "finetune.json").write_text(json.dumps({"label": label, "steps": 100}))
    return folder


def one_line(res, message):
    assert res.exit_code == 1, res.output
    assert res.output.splitlines() == ["Error: " + message], res.output


@pytest.mark.parametrize("name,message", [
    ("f.txt", "-o {out}: the extension .txt is not a figure format; use one of "),
    ("f", "-o {out}: no file extension; use one of "),
    ("file/f.png", "-o {out}: a part of the path ({tmp}/file) is a file, not a folder"),
])
def test_an_output_it_cannot_save_is_one_line_before_reading_the_runs(tmp_path, name, message):
    """`-o fig.txt` and `-o` under a file ended in matplotlib's or pathlib's traceback, after the
    runs were read."""
    (tmp_path / "file").write_text("")
    out = tmp_path / name
    res = cli(tmp_path / "no-such-run", "--length", 512, "-o", out)  # refused before the run is looked for
    assert res.exit_code == 1 and len(res.output.splitlines()) == 1, res.output
    assert res.output.startswith("Error: " + message.format(out=out, tmp=tmp_path))
    assert name != "f.txt" or (".png" in res.output and ".pdf" in res.output and ".svg" in res.output)


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes in read-only folders")
def test_an_output_in_a_read_only_folder_is_one_line(tmp_path):
    run = _run(tmp_path / "run")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        res = cli(run, "--length", 512, "-o", tmp_path / "ro" / "f.png")
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert res.exit_code == 1 and len(res.output.splitlines()) == 1 and "cannot write in" in res.output


@pytest.mark.parametrize("line,message", [
    ("[1, 2]", "a JSON list, not a record (a JSON object)"),
    ('"step"', "a JSON str, not a record (a JSON object)"),
    ('{"loss": 3.0}', "step None is not a step number (a whole number >= 0)"),
    ('{"step": 7, "ppl": 5}', "ppl 5 is not a mapping of lengths to perplexities"),
    ('{"step": 7, "ppl": {"512": "low"}}', "ppl {'512': 'low'} is not a mapping of lengths to perplexities"),
])
def test_a_log_line_that_is_json_but_not_a_record_is_one_line_naming_file_and_line(tmp_path, line, message):
    """`[1, 2]` in log.jsonl crashed compare (a list has no "ppl"); a torn line (not JSON) is still
    skipped."""
    run = _run(tmp_path / "run")
    lines = (run / "log.jsonl").read_text().splitlines()
    (run / "log.jsonl").write_text("\n".join([*lines[:2], line, *lines[2:]]) + "\n" + '{"step": 10')
    res = cli(run, "--length", 512, "-o", tmp_path / "f.png")
    one_line(res, f"{run / 'log.jsonl'}: line 3 is not a training log record ({message})")
    assert not (tmp_path / "f.png").exists()


def test_two_runs_with_one_label_are_told_apart_by_their_folder(tmp_path):
    """Two runs with one label (the same strategy trained twice) were merged: one line, one row."""
    other = [{**r, "ppl": {k: v + 1 for k, v in r["ppl"].items()}} if "ppl" in r else r for r in LOG]
    a, b = _run(tmp_path / "a" / "run", LOG, "yarn"), _run(tmp_path / "b" / "run", other, "yarn")
    c = _run(tmp_path / "c", LOG, "pi")
    res = cli(a, b, c, "--length", 512, "--at", "0,100", "-o", tmp_path / "f.png")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[4:7] == [f"| yarn ({a}) | 70.00 | 39.50 |", f"| yarn ({b}) | 71.00 | 40.50 |",
                                            "| pi | 70.00 | 39.50 |"]


def test_a_run_given_twice_is_refused(tmp_path):
    run = _run(tmp_path / "run")
    res = cli(run, tmp_path / "." / "run", "--length", 512, "-o", tmp_path / "f.png")
    assert res.exit_code == 1 and res.output.splitlines()[-1] == (
        f"Error: {tmp_path / '.' / 'run'}: given twice (as {run} too); name each run once")

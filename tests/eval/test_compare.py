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
    """Usage errors (exit 2): click's usage lines, then the one error line."""
    run = tmp_path / "run"
    run.mkdir()
    TrainingLog(run / "log.jsonl").write(LOG[0])
    res = cli(*[a.format(run=run, tmp=tmp_path) for a in args], "-o", tmp_path / "f.png")
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert lines[0] == "Usage: main compare [OPTIONS] RUNS..." and "Traceback" not in res.output
    assert lines[-1] == "Error: " + message.format(tmp=tmp_path)
    assert not (tmp_path / "f.png").exists()

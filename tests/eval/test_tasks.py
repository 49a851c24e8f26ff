"""The task layer: registry, config sections, and the harness running a retrieval task
end to end on a tiny random model (finite results, same examples for every strategy, resume)."""

import json
import math

import pytest

from eval.config import ConfigError, build_config
from eval.sweep import RESULTS, read_results, run_sweep
from eval.tasks import Task, UnknownTaskError, get_task, task_names
from eval.tasks.passkey import PasskeyOptions


def test_tasks_are_found_by_module():
    assert {"perplexity", "passkey", "needle"} <= set(task_names())
    assert get_task("passkey").Options is PasskeyOptions
    with pytest.raises(UnknownTaskError, match="unknown task 'paskey' \\(did you mean 'passkey'\\?\\); known tasks:"):
        get_task("paskey")
    assert issubclass(get_task("needle"), Task) and get_task("needle").uses_data


def test_task_options_sit_under_the_task_name():
    cfg = build_config({"task": "passkey", "lengths": [64], "strategies": ["vanilla"],
                        "passkey": {"trials": 3, "digits": 4}})
    assert cfg.options.trials == 3 and cfg.options.digits == 4 and cfg.options.candidates == 10
    # perplexity keeps its pre-task layout at the top level, or under perplexity:
    a = build_config({"lengths": [64], "strategies": ["vanilla"], "mode": "sliding", "stride": 8})
    b = build_config({"lengths": [64], "strategies": ["vanilla"], "perplexity": {"mode": "sliding", "stride": 8}})
    assert a.options == b.options and a.options.stride == 8


@pytest.mark.parametrize("raw,match", [
    ({"task": "pasky"}, "unknown task 'pasky'"),
    ({"task": "passkey", "passkey": {"trails": 3}}, "passkey.trails: Extra inputs are not permitted"),
    ({"task": "passkey", "passkey": {"depths": [2]}}, r"passkey.depths: depths must lie in \[0, 1\]"),
    ({"task": "passkey", "mode": "chunk"}, "mode: unknown key; allowed: .*passkey"),
    ({"task": "passkey", "paskey": {"trials": 3}}, "paskey: unknown key.*did you mean 'passkey'"),
])
def test_bad_task_configs_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"lengths": [64], "strategies": ["vanilla"], **raw})


def passkey_config(model_dir, **kw):
    return build_config({"task": "passkey", "model": str(model_dir), "lengths": [56, 64],
                         "strategies": ["vanilla", "yarn", "rerope", "dynamic_ntk"], "device": "cpu",
                         "passkey": {"trials": 2, "depths": [0, 1], "digits": 3, "candidates": 4}, **kw})


def test_passkey_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    records = run_sweep(passkey_config(tiny_model_dir), tmp_path, progress=False)
    assert [(r["strategy"], r["length"]) for r in records] == [
        (s, n) for n in (56, 64) for s in ("vanilla", "yarn", "rerope", "dynamic_ntk")]
    for r in records:
        assert r["task"] == "passkey" and r["trials"] == 4 and r["chance"] == 0.25
        for key in ("accuracy", "candidate_accuracy"):
            assert 0 <= r[key] <= 1 and r[key + "_ci"][0] <= r[key] <= r[key + "_ci"][1]
            assert sum(d[key] * d["trials"] for d in r["by_depth"]) == pytest.approx(r[key] * r["trials"])
        assert [d["depth"] for d in r["by_depth"]] == [0.0, 1.0]
    # the same examples for every strategy: same prompts, so the same needle positions
    at64 = [r for r in records if r["length"] == 64]
    assert len({json.dumps([d["needle_token"] for d in r["by_depth"]]) for r in at64}) == 1
    for name in ("results.csv", "results.md", "accuracy_vs_length.png", "depth_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("Task `passkey` — model `") and "| strategy | 56 | 64 (2T) |" not in md
    assert "**greedy exact-match accuracy** (higher is better)" in md and "| rerope |" in md


def test_retrieval_resumes_and_a_changed_option_is_a_new_cell(tmp_path, tiny_model_dir):
    cfg = passkey_config(tiny_model_dir, strategies=["vanilla", "yarn"])
    first = run_sweep(cfg, tmp_path, progress=False)
    lines = (tmp_path / RESULTS).read_text().splitlines()
    (tmp_path / RESULTS).write_text("\n".join(lines[:2]) + "\n" + lines[2][:30])  # killed mid-write
    again = run_sweep(cfg, tmp_path, progress=False)
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in first]
    assert [r["candidate_accuracy"] for r in again] == [r["candidate_accuracy"] for r in first]
    assert len(read_results(tmp_path / RESULTS)) == 4
    other = passkey_config(tiny_model_dir, strategies=["vanilla"], passkey={
        "trials": 2, "depths": [0, 1], "digits": 3, "candidates": 5})
    with pytest.raises(ValueError, match="holds another experiment \\(options: .*'candidates': 5"):
        run_sweep(other, tmp_path, progress=False)
    run_sweep(other, tmp_path / "new", progress=False)
    assert len(read_results(tmp_path / RESULTS)) == 4 and len(read_results(tmp_path / "new" / RESULTS)) == 2


def test_a_length_too_short_for_the_prompt_fails_before_any_cell(tmp_path, tiny_model_dir):
    cfg = passkey_config(tiny_model_dir, lengths=[24, 64])
    with pytest.raises(ValueError, match="length 24 is too short for this prompt"):
        run_sweep(cfg, tmp_path, progress=False)
    assert not (tmp_path / RESULTS).exists() or not read_results(tmp_path / RESULTS)


def test_needle_reads_the_data_source(tmp_path, tiny_model_dir, text_file):
    cfg = build_config({"task": "needle", "model": str(tiny_model_dir), "data": str(text_file), "lengths": [160],
                        "strategies": ["vanilla"], "device": "cpu",
                        "needle": {"trials": 2, "depths": [0.5], "digits": 4, "candidates": 3}})
    (r,) = run_sweep(cfg, tmp_path, progress=False)
    assert r["task"] == "needle" and r["data"] == str(text_file) and r["trials"] == 2
    assert math.isfinite(r["accuracy"]) and (tmp_path / "depth_heatmap.png").exists()

"""RULER's effective length on hand-made suite records: the longest length whose average, and
every shorter measured length's, is at or above the threshold (RULER §4), in results.md,
effective_length.json and the plot."""

import json

import pytest

from eval.report import write_reports
from eval.tasks.ruler.suite import RulerSuiteOptions, effective_length, effective_lengths


def _records(scores: dict[str, dict[int, float | None]], train: int = 128, threshold=None) -> list[dict]:
    options = {"num_samples": 10} | ({"threshold": threshold} if threshold is not None else {})
    return [{"task": "ruler", "strategy": s, "length": n, "train_length": train, "score": v, "model": "m",
             "data": "d", "tasks": ["vt"], "scores": {"vt": v} if v is not None else {}, "refused": {},
             "options": options}
            for s, by_length in scores.items() for n, v in by_length.items()]


@pytest.mark.parametrize(("scores", "threshold", "want"), [
    ({64: 90.0, 128: 86.0, 256: 70.0}, 85.6, 128),
    ({64: 90.0, 128: 85.6, 256: 85.6}, 85.6, 256),  # at the threshold counts
    ({64: 80.0, 128: 90.0}, 85.6, None),  # the shortest below: no reach at all
    ({64: 90.0, 128: 50.0, 256: 95.0}, 85.6, 64),  # a dip ends the reach, a later recovery does not count
    ({256: 95.0, 64: 90.0, 128: None}, 85.6, 64),  # order of the dict is not the order of lengths; no score ends it
])
def test_effective_length_by_hand(scores, threshold, want):
    assert effective_length(scores, threshold) == want


def test_the_threshold_defaults_to_vanilla_at_t_and_reports_show_it(tmp_path):
    records = _records({"vanilla": {64: 92.0, 128: 88.0, 256: 10.0, 512: 0.0},
                        "yarn": {64: 91.0, 128: 89.0, 256: 88.0, 512: 40.0},
                        "rerope": {64: 87.9, 128: 95.0, 256: 95.0, 512: 95.0}})
    summary = effective_lengths(records)
    assert summary["threshold"] == 88.0 and "vanilla cell's average at T = 128" in summary["threshold_from"]
    assert summary["effective_length"] == {"vanilla": 128, "yarn": 256, "rerope": None}
    paths = write_reports(records, tmp_path)
    assert json.loads(paths["effective_length"].read_text()) == summary
    md = (tmp_path / "results.md").read_text()
    assert "| yarn | 256 |" in md and "| rerope | < 64 |" in md and "≥ 88.0" in md
    assert paths["plot"].stat().st_size > 0


def test_a_given_threshold_wins_and_none_without_vanilla_at_t(tmp_path):
    given = _records({"yarn": {64: 91.0, 128: 89.0, 256: 80.0}}, threshold=85.6)
    assert effective_lengths(given)["effective_length"] == {"yarn": 128}
    bare = _records({"yarn": {64: 91.0, 128: 89.0}})
    assert effective_lengths(bare)["threshold"] is None
    write_reports(bare, tmp_path)
    assert "not computed (no threshold given and no vanilla cell at T = 128; set ruler.threshold)" in (
        tmp_path / "results.md").read_text()


def test_the_threshold_stays_out_of_the_tasks_and_of_the_identity_unless_given():
    from eval.tasks.ruler.suite import RulerSuite

    assert "threshold" not in RulerSuiteOptions(tasks=["vt"]).key()
    assert RulerSuiteOptions(tasks=["vt"], threshold=85.6).key()["threshold"] == 85.6
    with pytest.raises(ValueError):
        RulerSuiteOptions(tasks=["vt"], threshold=101)
    suite = RulerSuite(RulerSuiteOptions(tasks=["vt"], threshold=50), tokenizer=None, train_length=128)
    assert "threshold" not in suite.tasks["vt"].options.model_dump()


def test_a_vanilla_baseline_scoring_0_gives_no_effective_length_and_says_why(tmp_path, caplog):
    """The vanilla cell at T scores 0 (a model that fails every task at its own window): a threshold of 0
    passes every score, so every strategy would 'reach' the longest length — 256 here, for a strategy that
    scores 0 there. Not a number then: null, the reason in the JSON and results.md, one warning line."""
    records = _records({"vanilla": {64: 0.0, 128: 0.0, 256: 0.0}, "yarn": {64: 3.0, 128: 0.0, 256: 0.0}})
    summary = effective_lengths(records)
    assert summary["effective_length"] == {"vanilla": None, "yarn": None}
    assert summary["threshold"] == 0.0 and "every score passes" in summary["reason"]
    with caplog.at_level("WARNING", logger="ropescale"):
        paths = write_reports(records, tmp_path)
    written = json.loads(paths["effective_length"].read_text())
    assert written["effective_length"] == {"vanilla": None, "yarn": None} and written["reason"] == summary["reason"]
    md = (tmp_path / "results.md").read_text()
    assert "**Effective length**: not computed (the threshold (the vanilla cell's average at T = 128) is 0" in md
    assert "| yarn | 256 |" not in md
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "effective length not computed" in warnings[0] and "\n" not in warnings[0]
    with pytest.raises(ValueError, match="greater than 0"):  # a given threshold of 0 says as little
        RulerSuiteOptions(tasks=["vt"], threshold=0)

"""Scoring engines (eval.engines.scoring): a task asks for log-probabilities or generations, an engine
answers. A plugin engine registered from this module — nothing edited anywhere else — scores perplexity
through the task's requests exactly as the in-process engine does, and is refused, in one line, for a
task that asks for what it does not answer."""

import pytest

from eval.config import build_config
from eval.engines.registry import add_role, remove_role
from eval.engines.scoring import ScoringEngine, scoring_engine, scoring_engine_names
from eval.engines.vllm.scoring import transformers_logprobs
from eval.sweep import run_sweep
from eval.tasks.base import get_task, task_names
from ropescale.errors import UnknownNameError
from ropescale.runs.config import ConfigError


class LogprobsOnly(ScoringEngine):
    """A plugin's engine answering log-probabilities only: this process's patched model asked through the
    task's requests (``Task.engine_requests``) and answered back (``Task.engine_parts``), as an engine
    in another process would be."""

    name = "logprobs-only-test"
    answers = frozenset({"logprobs"})

    def score_cell(self, cell, examples, bench):
        from ropescale.strategies import get_strategy

        task, length = bench.task, cell.length
        reqs, _ = task.engine_requests(examples)
        with cell.patch(bench.model):
            results = [{"logprobs": transformers_logprobs(bench.model, r["ids"], bench.device).tolist(), "tokens": []}
                       for r in reqs]
        parts = task.engine_parts(examples, self.sent(results, length), length)
        return {**task.combine([parts], examples, length=length, strategy=get_strategy(cell.spec.name)),
                "engine": self.name, "engine_version": "test"}

    def sent(self, results: list[dict], length: int) -> list[dict]:
        """The answers as the engine sends them back: here as computed."""
        return results


def _gone(results):
    raise RuntimeError("connection reset: server went away")


def _with(results, i, j, value):
    """``results`` with request ``i``'s log-probability ``j`` replaced by ``value``."""
    lp = list(results[i]["logprobs"])
    lp[j] = value
    return [*results[:i], {**results[i], "logprobs": lp}, *results[i + 1:]]


# how a plugin's engine misbehaves at a cell of 64 tokens (two windows, no BOS: 63 log-probabilities each)
# and the one line it is refused with; before issue 52 the first three and the positive one were recorded
# (2 windows of 127 tokens, fewer tokens, PPL nan), the fourth a scatter_add traceback, the fifth "a bug in
# ropescale … report it" without the plugin's name
FAULTS = {
    "one_of_two": (lambda r: r[:1], "answered 1 of the 2 requests asked; the cell is not recorded"),
    "ten_short": (lambda r: [r[0], {**r[1], "logprobs": r[1]["logprobs"][:-10]}],
                  "answered request 1 with 53 log-probabilities for a prompt of 64 tokens (63 asked); the cell is "
                  "not recorded"),
    "nan": (lambda r: _with(r, 1, 5, float("nan")),
            "answered request 1 with a log-probability of nan at position 5, not a finite number; the cell is not "
            "recorded"),
    "too_many": (lambda r: [{**r[0], "logprobs": [*r[0]["logprobs"], -1.0]}, r[1]],
                 "answered request 0 with 64 log-probabilities for a prompt of 64 tokens (63 asked); the cell is "
                 "not recorded"),
    "raises": (_gone, "failed: RuntimeError: connection reset: server went away; the cell is not recorded"),
    "positive": (lambda r: _with(r, 0, 3, 0.5),
                 "answered request 0 with a log-probability of 0.5 at position 3, above 0: a probability above 1; "
                 "the cell is not recorded"),
}


class Faulty(LogprobsOnly):
    """A plugin's engine answering as ``LogprobsOnly`` at 32 tokens and misbehaving at 64 (``FAULTS[fault]``)."""

    name = "myplugin"
    fault = "one_of_two"

    def sent(self, results, length):
        return FAULTS[self.fault][0](results) if length == 64 else results


# defining them registered them; each test of this module registers them for itself
remove_role(LogprobsOnly.name, "scorer")
remove_role(Faulty.name, "scorer")


@pytest.fixture(autouse=True)
def plugin():
    """The plugin engine registered for one test, then taken out: other tests see the bundled engines only."""
    add_role(LogprobsOnly, "scorer")
    add_role(Faulty, "scorer")
    yield LogprobsOnly
    remove_role(LogprobsOnly.name, "scorer")
    remove_role(Faulty.name, "scorer")


def test_the_bundled_engines_are_registered_and_unknown_names_are_one_line():
    assert {"transformers", "vllm"} <= set(scoring_engine_names())
    with pytest.raises(UnknownNameError) as e:
        scoring_engine("vlm")
    assert "\n" not in str(e.value) and "vllm" in str(e.value)
    with pytest.raises(ValueError, match="unknown scoring engine 'vlm'; choose from"):
        build_config({"model": "reference", "lengths": [32], "engine": "vlm"})


def test_what_each_task_asks_decides_which_engines_score_it():
    vllm, ours, plain = scoring_engine("vllm"), scoring_engine(LogprobsOnly.name), scoring_engine("transformers")
    for name in task_names():
        cls = get_task(name)
        assert plain.scores(cls)  # in process: every task
        assert vllm.scores(cls) == bool(cls.engine_asks)  # vLLM answers both kinds
        assert ours.scores(cls) == (cls.engine_asks == {"logprobs"})
    assert ours.scores(get_task("perplexity")) and not ours.scores(get_task("passkey"))


def test_a_plugin_engine_scores_perplexity_as_the_in_process_engine(tmp_path, plugin, tiny_model_dir, text_file):
    base = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32, 64], "max_windows": 4,
            "strategies": ["vanilla", "yarn"], "device": "cpu"}
    ours = run_sweep(build_config(base), tmp_path / "a", progress=False)
    theirs = run_sweep(build_config({**base, "engine": plugin.name}), tmp_path / "b", progress=False)
    for a, b in zip(ours, theirs):
        assert (a["strategy"], a["length"]) == (b["strategy"], b["length"])
        assert a["engine"] == "transformers" and b["engine"] == plugin.name
        assert b["tokens"] == a["tokens"] and b["nll"] == pytest.approx(a["nll"], rel=1e-6)
        # the interval's blocks are cut the same way from the engine's log-probabilities
        assert b["block_tokens"] == a["block_tokens"] and b["nll_blocks"] == pytest.approx(a["nll_blocks"], rel=1e-5)
        assert b["ppl_ci"] == pytest.approx(a["ppl_ci"], rel=1e-5)


def test_a_task_asking_for_more_than_an_engine_answers_is_refused_in_one_line(tmp_path, plugin, tiny_model_dir):
    cfg = build_config({"model": str(tiny_model_dir), "task": "passkey", "lengths": [64], "strategies": ["yarn"],
                       "engine": plugin.name})
    with pytest.raises(ConfigError) as e:
        run_sweep(cfg, tmp_path / "p", progress=False)
    assert str(e.value) == ("config: engine: logprobs-only-test does not answer generate, which passkey asks for — "
                            "use engine: transformers or vllm")
    assert not (tmp_path / "p").exists()  # refused before the folder
    ruler = next(n for n in task_names() if not get_task(n).engine_asks)
    cfg = build_config({"model": str(tiny_model_dir), "task": ruler, "lengths": [64], "strategies": ["yarn"],
                       "engine": "vllm"})
    with pytest.raises(ConfigError, match=f"engine: vllm cannot score {ruler}: it measures the model in this "
                                          "process only — use engine: transformers$"):
        scoring_engine("vllm").check(cfg)


# --- the contract every engine's answers are held to (issue 52)


def _eval(out, model, data, engine, *more):
    """``ropescale eval`` of yarn at 32 and 64 tokens (two windows each) scored by ``engine``."""
    from click.testing import CliRunner

    from cli import main

    return CliRunner().invoke(main, ["eval", "--model", str(model), "--data", str(data), "--strategy", "yarn",
                                     "--lengths", "32,64", "--max-windows", "2", "--device", "cpu", "-q",
                                     "--engine", engine, "-o", str(out), *more])


def _error_lines(res) -> list[str]:
    """What the CLI printed on stderr but transformers' progress bars (loading the weights)."""
    return [line for line in res.stderr.splitlines() if line.strip() and "Loading weights" not in line]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_plugin_engines_bad_answer_is_one_line_and_its_cell_is_not_recorded(tmp_path, monkeypatch, tiny_model_dir,
                                                                           text_file, fault):
    from eval.sweep import RESULTS, read_results

    monkeypatch.setattr(Faulty, "fault", fault)
    res = _eval(tmp_path / "o", tiny_model_dir, text_file, Faulty.name)
    assert res.exit_code == 1, res.output
    assert _error_lines(res) == [f"Error: yarn @ 64: scoring engine 'myplugin' {FAULTS[fault][1]}"]
    assert "Traceback" not in res.output and "report it" not in res.output
    assert [(r["length"], r["engine"]) for r in read_results(tmp_path / "o" / RESULTS)] == [(32, "myplugin")]


def test_a_plugin_engine_answering_well_is_recorded_through_the_cli(tmp_path, tiny_model_dir, text_file):
    """The checks refuse what is wrong only: the same plugin, answering as computed, records both cells."""
    from eval.sweep import RESULTS, read_results

    res = _eval(tmp_path / "o", tiny_model_dir, text_file, LogprobsOnly.name)
    assert res.exit_code == 0, res.output
    recs = read_results(tmp_path / "o" / RESULTS)
    assert [(r["length"], r["windows"], r["tokens"]) for r in recs] == [(32, 2, 62), (64, 2, 126)]


class Generating(ScoringEngine):
    """A plugin's engine answering both kinds for passkey: each candidate prompt's log-probabilities (all
    -1 nats), and one token more than asked for each generation."""

    name = "generating-test"
    answers = frozenset({"logprobs", "generate"})

    def score_cell(self, cell, examples, bench):
        task, length = bench.task, cell.length
        reqs, _ = task.engine_requests(examples)
        results = [{"logprobs": [-1.0] * (len(r["ids"]) - 1) if r["prompt_logprobs"] else None,
                    "tokens": [] if r["prompt_logprobs"] else [7] * (r["max_tokens"] + 1)} for r in reqs]
        return task.combine([task.engine_parts(examples, results, length)], examples, length=length, strategy=None)


remove_role(Generating.name, "scorer")


def test_a_generation_longer_than_asked_is_refused_for_a_retrieval_task(tmp_path, tiny_model_dir):
    import re

    from ropescale.errors import RopescaleError

    add_role(Generating, "scorer")
    try:
        cfg = build_config({"model": str(tiny_model_dir), "task": "passkey", "lengths": [64], "strategies": ["yarn"],
                            "device": "cpu", "engine": Generating.name, "passkey": {"trials": 1, "depths": [0.5]}})
        with pytest.raises(RopescaleError) as e:
            run_sweep(cfg, tmp_path / "p", progress=False)
    finally:
        remove_role(Generating.name, "scorer")
    m = re.fullmatch(r"yarn @ 64: scoring engine 'generating-test' generated (\d+) tokens for request 0, more than "
                     r"the (\d+) asked; the cell is not recorded", str(e.value))
    assert m and int(m[1]) == int(m[2]) + 1, str(e.value)


class Bypassing(ScoringEngine):
    """A plugin's engine making up the cell's metrics without answering the task's requests."""

    name = "bypassing-test"
    answers = frozenset({"logprobs"})

    def score_cell(self, cell, examples, bench):
        return {"ppl": 1.0, "nll": 0.0, "tokens": 10**6, "engine": self.name, "engine_version": "test"}


remove_role(Bypassing.name, "scorer")


def test_metrics_made_up_without_the_tasks_requests_are_refused(tmp_path, tiny_model_dir, text_file):
    from eval.sweep import RESULTS, read_results
    from ropescale.errors import RopescaleError

    add_role(Bypassing, "scorer")
    try:
        cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "max_windows": 2,
                            "strategies": ["yarn"], "device": "cpu", "engine": Bypassing.name})
        with pytest.raises(RopescaleError, match=r"^yarn @ 32: scoring engine 'bypassing-test' returned the cell "
                                                 r"without passing its answers through the task \(Task.engine_parts"
                                                 r"\); the cell is not recorded$"):
            run_sweep(cfg, tmp_path / "o", progress=False)
    finally:
        remove_role(Bypassing.name, "scorer")
    assert read_results(tmp_path / "o" / RESULTS) == []


REQS = [{"ids": [5, 6], "max_tokens": 3, "prompt_logprobs": False},  # a retrieval prompt, its answer generated
        {"ids": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": True},  # the prompt and a candidate of 2 tokens
        {"ids": [5, 6, 9, 9], "max_tokens": 1, "prompt_logprobs": True}]
GOOD = [{"logprobs": None, "tokens": [1, 2]}, {"logprobs": [-1.0, -2.0, -0.5], "tokens": []},
        {"logprobs": [-1.0, -3.0, 5e-5], "tokens": [4]}]  # 5e-5 above 0: float32 rounding, kept


@pytest.mark.parametrize(("results", "problem"), [
    (GOOD[:2], "answered 2 of the 3 requests asked"),
    ([*GOOD, GOOD[0]], "answered 4 of the 3 requests asked"),
    ({"results": GOOD}, "answered dict, not a list of the 3 answers asked"),
    ([GOOD[0], [-1.0, -2.0, -0.5], GOOD[2]], "answered request 1 with a list, not a dict of logprobs and tokens"),
    ([{"logprobs": None}, *GOOD[1:]], "answered generation request 0 without its tokens"),
    ([{"tokens": [1, 2, 3, 4]}, *GOOD[1:]], "generated 4 tokens for request 0, more than the 3 asked"),
    ([{"tokens": [1, -2]}, *GOOD[1:]], r"answered request 0 with tokens that are not token ids: \[1, -2\]"),
    ([{"tokens": ["a"]}, *GOOD[1:]], r"answered request 0 with tokens that are not token ids: \['a'\]"),
    ([GOOD[0], {"tokens": []}, GOOD[2]], "answered request 1 with no log-probabilities"),
    ([GOOD[0], GOOD[1], {"logprobs": [-3.0, 5e-5]}],
     r"answered request 2 with 2 log-probabilities for a prompt of 4 tokens \(3 asked\)"),
    ([GOOD[0], {"logprobs": ["x", -1.0, -1.0]}, GOOD[2]], "answered request 1 with log-probabilities that are not a "
                                                         "list of numbers"),
    ([GOOD[0], {"logprobs": [[-1.0, -1.0, -1.0]]}, GOOD[2]], "answered request 1 with log-probabilities that are "
                                                            "not a list of numbers"),
    ([GOOD[0], {"logprobs": [-1.0, float("-inf"), -1.0]}, GOOD[2]],
     "answered request 1 with a log-probability of -inf at position 1, not a finite number"),
    ([GOOD[0], GOOD[1], {"logprobs": [-1.0, -1.0, 2e-4]}],
     "answered request 2 with a log-probability of 0.0002 at position 2, above 0: a probability above 1"),
], ids=["short", "long", "not_a_list", "not_a_dict", "no_tokens", "tokens_long", "negative_id", "text_id",
        "no_logprobs", "candidate_short", "text_logprob", "nested", "inf", "positive"])
def test_every_answer_is_checked_against_its_request(results, problem):
    from eval.engines import EngineFailed
    from eval.engines.scoring import check_answers

    check_answers(REQS, GOOD, "scoring engine 'x'", "yarn @ 64")  # nothing to refuse
    with pytest.raises(EngineFailed, match=rf"^yarn @ 64: scoring engine 'x' {problem}.*; the cell is not recorded$"):
        check_answers(REQS, results, "scoring engine 'x'", "yarn @ 64")


class Unready(LogprobsOnly):
    """A plugin's engine whose own check raises (its server is not up)."""

    name = "unready-test"

    def check(self, cfg, source="config", processes=1):
        raise ConnectionError("no server at localhost:8000")


remove_role(Unready.name, "scorer")


def test_a_plugins_exception_is_its_failure_and_a_bundled_engines_bug_is_a_bug(monkeypatch, tmp_path, tiny_model_dir,
                                                                           text_file):
    """An exception from a plugin's engine is its own failure, one line naming it — from ``check`` too,
    before anything is written; what a bundled engine raises is ropescale's bug, raised as it is (the CLI
    shows its traceback)."""
    from types import SimpleNamespace

    import eval.engines.vllm.scoring

    add_role(Unready, "scorer")
    try:
        res = _eval(tmp_path / "o", tiny_model_dir, text_file, Unready.name)
    finally:
        remove_role(Unready.name, "scorer")
    assert res.exit_code == 1, res.output
    assert _error_lines(res) == ["Error: scoring engine 'unready-test' failed: ConnectionError: no server at "
                                 "localhost:8000"]
    assert not (tmp_path / "o").exists()

    def broken(*args, **kw):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(eval.engines.vllm.scoring.VllmScoring, "answer", broken)
    with pytest.raises(ZeroDivisionError):
        scoring_engine("vllm").score_requests([], 0, SimpleNamespace(where="yarn @ 64"))

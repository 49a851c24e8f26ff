"""Scoring engines (eval.engines.scoring): a task asks for log-probabilities or generations, an engine
answers. A plugin engine registered from this module — nothing edited anywhere else — scores perplexity
through the task's requests exactly as the in-process engine does, and is refused, in one line, for a
task that asks for what it does not answer."""

import pytest

from eval.config import build_config
from eval.engines.scoring import SCORERS, ScoringEngine, scoring_engine, scoring_engine_names
from eval.engines.vllm_eval import transformers_logprobs
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

    def score_cell(self, cfg, task, model, examples, spec, params, length, train_length, device, output):
        from ropescale import patch
        from ropescale.strategies import get_strategy

        reqs, _ = task.engine_requests(examples)
        with patch(model, spec.name, original_max_position_embeddings=train_length, **params):
            results = [{"logprobs": transformers_logprobs(model, r["ids"], device).tolist(), "tokens": []}
                       for r in reqs]
        parts = task.engine_parts(examples, results, length)
        return {**task.combine([parts], examples, length=length, strategy=get_strategy(spec.name)),
                "engine": self.name, "engine_version": "test"}


SCORERS.pop(LogprobsOnly.name)  # defining it registered it; each test of this module registers it for itself


@pytest.fixture(autouse=True)
def plugin():
    """The plugin engine registered for one test, then taken out: other tests see the bundled engines only."""
    SCORERS.add(LogprobsOnly.name, LogprobsOnly)
    yield LogprobsOnly
    SCORERS.pop(LogprobsOnly.name, None)


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

"""The `ropescale` model type for lm-evaluation-harness, offline on a small local task."""

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

import ropescale  # noqa: E402
from eval import lmeval  # noqa: E402  (registers the model type)

TASK = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, text_file):
    d = tmp_path_factory.mktemp("lm-eval-task")
    text = text_file.read_text()
    with (d / "docs.jsonl").open("w") as f:
        for i in range(3):
            f.write(json.dumps({"text": text[i * 600:(i + 1) * 600]}) + "\n")
    (d / "tiny.yaml").write_text(TASK.format(data=d / "docs.jsonl"))
    return d


@pytest.fixture
def own_tasks_only(monkeypatch):
    """lm-eval's TaskManager without its built-in tasks (indexing them takes ~30 s each time, and these runs use
    the local task only), wherever lm-eval builds one."""
    from lm_eval import tasks

    class OwnOnly(tasks.TaskManager):
        def __init__(self, *a, **k):
            super().__init__(*a, **(k | {"include_defaults": False}))

    monkeypatch.setattr(tasks, "TaskManager", OwnOnly)


@pytest.fixture(scope="module")
def manager(task_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate(model, manager, **kw):
    out = lm_eval.simple_evaluate(model=model, tasks=["tiny_rolling"], task_manager=manager,
                                  batch_size=1, device="cpu", **kw)
    return out["results"]["tiny_rolling"]["word_perplexity,none"]


def test_registered_model_equals_hflm_over_a_model_patched_by_hand(manager, tiny_model_dir):
    from lm_eval.models.huggingface import HFLM

    ours = evaluate("ropescale", manager, model_args=f"pretrained={tiny_model_dir},strategy=yarn,factor=2")
    model, tok = ropescale.load_model(str(tiny_model_dir), device="cpu")
    ropescale.patch(model, "yarn", factor=2)
    by_hand = evaluate(HFLM(pretrained=model, tokenizer=tok, max_length=64, batch_size=1), manager)
    assert ours == pytest.approx(by_hand, rel=1e-9)
    # max_length followed the factor (2 × 32): vanilla RoPE over the same 64-token windows differs
    vanilla = evaluate("ropescale", manager, model_args=f"pretrained={tiny_model_dir},max_length=64")
    assert vanilla != pytest.approx(ours, rel=1e-6)


@pytest.mark.parametrize(("strategy", "want"), [("strategy=yarn,factor=3", 96), ("strategy=dca,scale=2", 64),
                                                ("strategy=dynamic_ntk,factor=2", 32), ("strategy=vanilla", 32)])
def test_max_length_is_the_reach_of_the_scale_factor(tiny_model_dir, strategy, want):
    """s × T (T = 32) for a strategy with a scale factor (its ``auto="scale"`` parameter, whatever its name); the
    model's own window for one without (dynamic NTK's factor is a slope, vanilla has none)."""
    args = dict(kv.split("=") for kv in strategy.split(","))
    lm = lmeval.RopescaleLM(pretrained=str(tiny_model_dir), device="cpu", **{k: (float(v) if k != "strategy" else v)
                                                                           for k, v in args.items()})
    assert lm.max_length == want


def test_bad_strategy_parameter_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="yarn: parameter factor=0.5 is out of range"):
        lmeval.RopescaleLM(pretrained=str(tiny_model_dir), strategy="yarn", factor=0.5)


def test_command_line_runs_offline(task_dir, tiny_model_dir, capsys, own_tasks_only):
    lmeval.main(["--model", "ropescale", "--model_args", f"pretrained={tiny_model_dir},strategy=ntk,factor=2",
                 "--tasks", "tiny_rolling", "--include_path", str(task_dir), "--device", "cpu", "--batch_size", "1"])
    out = capsys.readouterr().out
    assert "tiny_rolling" in out and "word_perplexity" in out


def test_what_needs_the_model_fails_in_one_line_too(task_dir, own_tasks_only):
    # a hub id with the hub offline passes the early checks; loading it fails inside lm-eval's run
    with pytest.raises(lmeval.ModelArgsError, match="model_args: cannot load 'some-org/some-model'.*hub is offline"):
        lmeval.main(["--model", "ropescale", "--model_args", "pretrained=some-org/some-model",
                     "--tasks", "tiny_rolling", "--include_path", str(task_dir), "--device", "cpu"])


def test_model_args_checked_before_loading(tiny_model_dir):
    params = lmeval.check_model_args({"pretrained": str(tiny_model_dir), "strategy": "yarn", "factor": 2,
                                      "logn": True, "batch_size": 1, "dynamic_block": 4})
    assert params["factor"] == 2.0
    with pytest.raises(lmeval.ModelArgsError, match="beta_fast: unknown key.*linear's parameters \\(factor\\)"):
        lmeval.check_model_args({"pretrained": str(tiny_model_dir), "strategy": "linear", "factor": 2,
                                 "beta_fast": 4})


def test_a_misspelled_task_is_one_line_with_close_matches_before_the_model_loads(task_dir, tiny_model_dir,
                                                                                monkeypatch):
    """`--tasks hellaswg` ended in lm-eval's own traceback (ValueError: Tasks not found)."""
    from click.testing import CliRunner

    from cli import main

    monkeypatch.setattr(lmeval.RopescaleLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    res = CliRunner().invoke(main, ["lm-eval", "--model", "ropescale", "--model_args", f"pretrained={tiny_model_dir}",
                                    "--tasks", "tiny_rolling,hellaswg,tiny_rollin", "--include_path", str(task_dir),
                                    "--device", "cpu"])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "Error: lm-eval: --tasks: no lm-eval task, group or tag named hellaswg (did you mean hellaswag"), lines
    assert "; tiny_rollin (did you mean tiny_rolling" in lines[0]  # the tasks of --include_path too
    with pytest.raises(lmeval.ModelArgsError, match="--tasks: no YAML file matches .*/none.yaml"):
        lmeval.main(["--model", "ropescale", "--model_args", f"pretrained={tiny_model_dir}",
                     "--tasks", str(task_dir / "none.yaml"), "--device", "cpu"])

"""Bad fine-tuning configs get one clear line through the CLI (exit 1, no traceback), naming
the key; good ones fill the strategy from L / T as sweeps do."""

import json

import pytest
from click.testing import CliRunner

from cli import main
from eval.config import ConfigError
from eval.finetune import HarnessEvaluations
from ropescale.training import build_finetune_config, finetune, resolve


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
    ({"stpes": 3}, ["stpes: unknown key; allowed: model, data, original_max_position_embeddings, device, threads,",
                    "output, strategy,", "(did you mean 'steps'?)"]),
    ({"pose": {"chunk": 2}}, ["pose.chunk: unknown key; allowed: enabled, chunks, content, sampling", "'chunks'"]),
    ({"pose": {"chunks": 3}}, ["pose: chunks: 3 with sampling: authors, which draws exactly 2 chunks",
                               "set pose.sampling: paper"]),
    ({"steps": 0}, ["steps: must be at least 1 optimiser step; got 0"]),
    ({"steps": -5}, ["steps: must be at least 1"]),
    ({"strategy": "yarnn"}, ["strategy: unknown strategy 'yarnn'", "did you mean 'yarn'"]),
    ({"strategy": "yarn:beta_fast=-1"}, ["strategy:", "beta_fast=-1", "out of range"]),
    ({"strategy": "yarn:profiles=[1,2]"}, ["strategy: yarn+profiles=1/2: profiles pick a factor per served request"]),
    ({"pose": True, "length": 32}, ["pose: length 32 is not above the model's original window T = 32"]),
    ({"pose": True, "length": 24}, ["pose: length 24 is not above"]),
    ({"pose": True, "strategy": "rerope"}, ["pose: rerope is a relative-position rule", "position_ids"]),
    ({"pose": {"chunks": 40, "sampling": "paper"}}, ["pose.chunks: 40 chunks cannot split a window of T = 32"]),
    ({"pose": {"enabled": False, "window": 16}}, ["pose: window: 16 with enabled: false", "ignores it"]),
    ({"mixed_precision": "fp16"}, ["fp16 needs a CUDA device"]),
    ({"lr": 0}, ["lr: Input should be greater than 0"]),
    ({"eval": {"every": 2, "data": "SAME"}}, ["is also the training data"]),
    ({"eval": {"after": [{"task": "passky"}]}}, ["eval.after.0", "unknown task 'passky'"]),
    ({"eval": {"after": [{"task": "perplexity", "model": "x"}]}}, ["eval.after: entry 0: model are set by"]),
    ({"model": "./no/such/model"}, ["no such model folder"]),
    ({"data": "/no/such/text.txt"}, ["/no/such/text.txt"]),
    ({"attention_path": "fastest", "strategy": "rerope"}, ["attention_path='fastest'"]),
    ({"lr": float("inf")}, ["lr: Input should be a finite number"]),
    ({"weight_decay": float("nan")}, ["weight_decay: Input should be a finite number"]),
    ({"max_grad_norm": float("inf")}, ["max_grad_norm: Input should be a finite number"]),
    ({"adam_betas": [0.9, float("nan")]}, ["adam_betas.1: Input should be a finite number"]),
    ({"adam_betas": [0.9, 1.5]}, ["adam_betas.1: Input should be less than 1"]),
    ({"steps": True}, ["steps: expected an integer, got true"]),
    ({"batch_size": True}, ["batch_size: expected an integer, got true"]),
    ({"lr": True}, ["lr: expected a number, got true"]),
    ({"steps": 100000000000000000000}, ["steps: 100000000000000000000 optimiser steps is more than",
                                        "at most 1000000000"]),
    ({"steps": 10 ** 9, "batch_size": 10 ** 9}, ["steps × grad_accum × batch_size",
                                                 "training windows per process"]),
    ({"eval": {"after": [{"task": "passkey", "lengths": [16]}]}},
     ["eval.after.0 (passkey): length 16 is too short for this prompt"]),
    # refused only once the model is known: checked before the folder is claimed
    ({"strategy": "dca:chunk_size=32,local_window=32"},
     ["strategy: dca: local_window=32 must be below chunk_size=32"]),
    ({"strategy": "dca:chunk_size=4", "eval": None}, ["strategy: dca: local_window=4 must be below chunk_size=4"]),
    ({"lora": {"target_modules": ["q_proj", "qkv_proj"]}}, ["lora.target_modules: 'qkv_proj' matches no layer"]),
    ({"lora": {"r": 10 ** 9}}, ["lora.r: rank 1000000000 is above the smallest dimension", "use r <= 32"]),
    ({"recipe": {"name": "lora", "r": 33}}, ["recipe.r: rank 33 is above", "use r <= 32"]),
    ({"lora": {"modules_to_save": ["nosuch"]}}, ["lora.modules_to_save: 'nosuch' matches no module"]),
    ({"recipe": {"name": "longlora", "trainable_params": "embed,nrom"}},
     ["recipe.trainable_params: 'nrom' is in no parameter name of the model",
      "model.named_parameters(), e.g. model.embed_tokens.weight", "input_layernorm"]),
    ({"recipe": {"name": "longlora", "r": 64}}, ["recipe.r: rank 64 is above", "use r <= 32"]),
    ({"data": "SHORT"}, ["training data too short"]),
])
def test_bad_config_one_line(write, tmp_path, overrides, fragments):
    if (overrides.get("eval") or {}).get("data") == "SAME":
        overrides = {"eval": {"data": json.loads(write().read_text())["data"]}}
    if overrides.get("data") == "SHORT":
        (tmp_path / "short.txt").write_text("In the beginning God created the heaven and the earth.")
        overrides = {"data": str(tmp_path / "short.txt")}
    one_line_error(cli(write(**overrides), "-q", "-o", tmp_path / "out"), *fragments)
    assert not (tmp_path / "out").exists()  # refused before the run folder is claimed: nothing written


def test_a_corrected_rerun_into_the_folder_of_a_refused_one_runs(write, tmp_path):
    """A refused config used to leave its manifest behind, so the corrected rerun was refused as
    another experiment."""
    out = tmp_path / "out"
    one_line_error(cli(write(strategy="dca:chunk_size=32,local_window=32", eval=None), "-q", "-o", out),
                   "local_window=32 must be below chunk_size=32")
    one_line_error(cli(write(lora={"target_modules": ["qkv_proj"]}, eval=None), "-q", "-o", out), "qkv_proj")
    res = cli(write(steps=1, lora={"target_modules": ["q_proj"]}, eval=None), "-q", "-o", out)
    assert res.exit_code == 0, res.output
    assert (out / "model" / "finetune.json").is_file()


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


def test_a_pose_window_shorter_than_t_trains_short_windows_that_reach_the_target(tiny_run, tmp_path):
    from ropescale.training.run import finetune

    cfg = build_finetune_config(tiny_run(strategy="yarn", length=128, pose={"enabled": True, "window": 16}, eval=None,
                                         steps=2, batch_size=1))
    run = resolve(cfg)
    assert run.window == 16 and run.params["factor"] == 4.0  # 16-token windows, positions to L = 128
    plain = build_finetune_config(tiny_run(strategy="yarn", length=128, pose=True, eval=None))
    assert "window" not in plain.identity()["pose"] and cfg.identity()["pose"]["window"] == 16
    with pytest.raises(ConfigError, match=r"pose.window: 64 tokens is above the model's original window T = 32"):
        resolve(build_finetune_config(tiny_run(length=128, pose={"enabled": True, "window": 64}, eval=None)))
    summary = finetune(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 2
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(r.get("tokens", 16) % 16 == 0 for r in log)  # every step trained on 16-token windows


def test_set_overrides_and_flags(tmp_path, write):
    from ropescale.training import load_finetune_config

    cfg = load_finetune_config(write(), ["pose.chunks=3", "pose.sampling=paper", "lr=1e-4"],
                               {"steps": 9, "model": None})
    assert (cfg.pose.enabled and cfg.pose.chunks == 3 and cfg.pose.sampling == "paper" and cfg.lr == 1e-4
            and cfg.steps == 9)
    with pytest.raises(ConfigError, match="steps: must be at least 1"):
        load_finetune_config(write(), ["steps=0"])


def test_cli_runs_and_reports(tmp_path, write):
    res = cli(write(steps=2, eval={"every": 2, "data": json.loads(write().read_text())["eval"]["data"],
                                   "max_windows": 2, "lengths": [64]}), "-q", "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "fine-tuned linear for 2 steps" in res.output and "held-out PPL 64:" in res.output
    assert (tmp_path / "out" / "model" / "finetune.json").is_file()


def test_after_entries_are_checked_before_training(tiny_run):
    # a passkey length shorter than its question failed only after the whole run
    with pytest.raises(ConfigError, match="eval.after.1 \\(passkey\\): length 16 is too short"):
        cfg = build_finetune_config(tiny_run(eval={"data": "x.txt", "after": [
            {"task": "passkey", "lengths": [64]}, {"task": "passkey", "lengths": [16]}]}))
        HarnessEvaluations().check(cfg, resolve(cfg), "config")


def test_an_after_evaluation_vllm_cannot_run_is_refused_before_training(write, tiny_run, tmp_path, monkeypatch):
    """Refused only once the model was trained and saved: vLLM absent, or several launched processes."""
    monkeypatch.setenv("ROPESCALE_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))  # absent wherever it runs
    after = {"data": tiny_run()["eval"]["data"], "after": [{"task": "passkey", "lengths": [64], "engine": "vllm"}]}
    one_line_error(cli(write(eval=after), "-q", "-o", tmp_path / "out"),
                   "eval.after.0: engine: vllm: vLLM is not installed")
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written
    cfg = build_finetune_config(tiny_run(eval=after))
    with pytest.raises(ConfigError, match="eval.after.0: engine: vllm runs in one process and parallelises itself"):
        HarnessEvaluations().check(cfg, resolve(cfg), "config", processes=2)


def test_the_library_loop_refuses_after_entries_without_the_harness(tiny_run, tmp_path):
    cfg = build_finetune_config(tiny_run(eval={"data": "x.txt", "after": [{"task": "passkey", "lengths": [64]}]}))
    with pytest.raises(ConfigError, match="eval.after: harness experiments need the harness"):
        finetune(cfg, tmp_path / "out", progress=False)


def test_a_non_finite_loss_stops_the_run_naming_the_step(write, tmp_path, monkeypatch):
    from ropescale.training import loop

    real, calls = loop.causal_lm_loss, []

    def diverging(*a, **k):  # finite for steps 1 and 2, then NaN (as a run that diverges)
        calls.append(1)
        loss = real(*a, **k)
        return loss * float("nan") if len(calls) > 2 else loss

    monkeypatch.setattr(loop, "causal_lm_loss", diverging)
    out = tmp_path / "out"
    line = one_line_error(cli(write(steps=4, eval=None, checkpoint_every=2), "-q", "-o", out),
                          "step 3: the training loss is nan", "no model saved")
    assert not (out / "model").exists(), line
    assert (out / "checkpoints" / "step-000002").is_dir()  # the run can resume from before the divergence

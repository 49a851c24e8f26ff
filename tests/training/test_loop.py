"""The fine-tuning run end to end on a tiny model: it learns, resumes bit-exactly, keeps one run
per folder, saves a model that reloads with its patch, and trains PoSE and truncation rules."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ropescale
from eval.finetune import run_finetune as finetune  # the CLI's path: training, then eval.after
from ropescale.runs.manifest import ExperimentMismatchError, FolderBusyError, folder_lock
from ropescale.training import build_finetune_config
from ropescale.training.report import read_log


def run(raw, output, **kw):
    return finetune(build_finetune_config(raw), output, progress=False, **kw)


def losses(output):
    return [r["loss"] for r in read_log(output) if "loss" in r]


def test_loss_decreases_and_the_log_holds_every_step(tmp_path, tiny_run):
    out = run(tiny_run(steps=12, lr=1e-2, eval={"every": 6, "data": tiny_run()["eval"]["data"], "max_windows": 2}),
              tmp_path)
    log = read_log(tmp_path)
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    first, last = sum(losses(tmp_path)[:3]) / 3, sum(losses(tmp_path)[-3:]) / 3
    assert last < first - 0.5, (first, last)  # from ≈ ln 4096 = 8.3 nats
    evals = [r for r in log if "ppl" in r]
    assert [r["step"] for r in evals] == [0, 6, 12] and set(evals[0]["ppl"]) == {"32", "64"}
    assert evals[-1]["ppl"]["64"] < evals[0]["ppl"]["64"]
    assert steps[-1]["tokens"] == 12 * 2 * 64 and steps[0]["lr"] == pytest.approx(1e-2)
    assert out["ppl"] == evals[-1]["ppl"] and (tmp_path / "loss.png").stat().st_size > 0
    assert not (tmp_path / "checkpoints").exists()  # removed once the model is saved


def test_resume_after_a_kill_gives_bit_identical_weights(tmp_path, tiny_run):
    raw = tiny_run(steps=5, checkpoint_every=2)
    run(raw, tmp_path / "straight")
    stopped = run(raw, tmp_path / "killed", stop_after=3)  # dies after step 3: steps 3 is lost, checkpoint 2 stays
    assert stopped["model"] is None and (tmp_path / "killed" / "checkpoints" / "step-000002").is_dir()
    resumed = run(raw, tmp_path / "killed")
    assert resumed["resumed_from"] == 2
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_log(tmp_path / "killed") == [{**r, "tokens_per_s": x["tokens_per_s"]} if "loss" in r else r
                                             for r, x in zip(read_log(tmp_path / "straight"),
                                                             read_log(tmp_path / "killed"))]


def test_a_finished_run_is_not_trained_again_and_another_config_is_refused(tmp_path, tiny_run):
    raw = tiny_run(steps=2, eval=None)
    run(raw, tmp_path)
    stamp = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    again = run(raw, tmp_path)
    assert again["steps"] == 2 and (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ExperimentMismatchError, match=r"lr: 0\.001 now, 0\.003 in the folder"):
        run({**raw, "lr": 1e-3}, tmp_path)


def test_two_runs_on_one_folder_are_refused(tmp_path, tiny_run):
    with folder_lock(tmp_path), pytest.raises(FolderBusyError, match="being written by another run"):
        run(tiny_run(steps=1, eval=None), tmp_path)


@pytest.mark.parametrize("strategy,native", [("yarn", True), ("pi_over_2n", False)])
def test_saved_model_reloads_with_its_patch(tmp_path, tiny_run, strategy, native):
    run(tiny_run(strategy=strategy, steps=2, eval=None), tmp_path)
    record = json.loads((tmp_path / "model" / "ropescale.json").read_text())
    summary = json.loads((tmp_path / "model" / "finetune.json").read_text())
    assert record["native"] is native and summary["config"]["strategy"]["name"] == strategy
    expected_params = {"factor": 2.0} if strategy == "yarn" else {"n_max": 64.0}
    assert {k: summary["params"][k] for k in expected_params} == expected_params  # filled from L / T
    model, _ = ropescale.load_model(str(tmp_path / "model"), device="cpu")
    assert ropescale.current_patch(model).strategy == strategy
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        if native:
            plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
            torch.testing.assert_close(plain(ids).logits, logits, rtol=0, atol=1e-5)
    trained = load_file(tmp_path / "model" / "model.safetensors")
    base = load_file(tiny_run()["model"] + "/model.safetensors")
    assert not torch.equal(trained["lm_head.weight"], base["lm_head.weight"])  # it was trained


def test_pose_run_trains_on_windows_of_T(tmp_path, tiny_run):
    out = run(tiny_run(strategy="yarn", pose={"chunks": 2}, steps=3), tmp_path)
    assert out["window"] == 32 and out["tokens"] == 3 * 2 * 32 and out["pose"]["chunks"] == 2
    assert set(out["ppl"]) == {"32", "64"}


def test_truncation_rule_trains_on_the_naive_path_and_evaluates_after(tmp_path, tiny_run):
    raw = tiny_run(strategy="rerope", attention_path="naive", steps=2,
                   eval={"every": 2, "data": tiny_run()["eval"]["data"], "max_windows": 2, "lengths": [64],
                         "after": [{"task": "perplexity", "lengths": [64], "max_windows": 2}]})
    out = run(raw, tmp_path)
    assert out["params"]["window"] == 16  # T / 2, as sweeps fill it
    (record,) = out["evaluations"]["perplexity"]
    assert record["strategy"] == "rerope:window=16" and record["ppl"] == pytest.approx(out["ppl"]["64"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["rerope", "leaky_rerope", "self_extend"])
def test_truncation_rule_trains_through_the_fused_kernel_as_through_the_naive_path(tmp_path, tiny_run, strategy):
    """Three optimiser steps through the default (fused) kernel's backward end where the naive
    path's do: the same losses and weights (float tolerance)."""
    weights = {}
    for path in ("fused", "naive"):
        run(tiny_run(strategy=strategy, attention_path=path, steps=3, eval=None, checkpoint_every=10), tmp_path / path)
        weights[path] = load_file(next((tmp_path / path / "model").glob("*.safetensors")))
    assert losses(tmp_path / "fused") == pytest.approx(losses(tmp_path / "naive"), rel=1e-5)
    for k, w in weights["naive"].items():
        assert (weights["fused"][k] - w).abs().max() <= 1e-4 * w.abs().max(), k

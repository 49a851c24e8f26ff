"""One folder = one experiment: manifest, lock, fingerprints in the resume key."""

import hashlib
import json

import pytest
import torch

from eval.config import ConfigError, build_config
from eval.sweep import RESULTS, experiment_fields, read_results, run_sweep
from eval.tasks.passkey import PasskeyOptions
from ropescale.runs.lifecycle import load_inputs, run_identity
from ropescale.runs.manifest import (
    MANIFEST,
    ExperimentMismatchError,
    FolderBusyError,
    data_fingerprint,
    folder_lock,
    weights_fingerprint,
)


def config(model_dir, data, **kw):
    return build_config({"model": str(model_dir), "data": str(data), "lengths": [32], "strategies": ["vanilla"],
                         "max_windows": 2, "device": "cpu", **kw})


def test_manifest_records_the_experiment(tmp_path, tiny_model_dir, text_file):
    cfg = config(tiny_model_dir, text_file)
    (r,) = run_sweep(cfg, tmp_path, progress=False)
    m = json.loads((tmp_path / MANIFEST).read_text())
    ident = m["identity"]
    assert ident["task"] == "perplexity" and ident["model"] == str(tiny_model_dir) and ident["data"] == str(text_file)
    assert ident["weights"] == weights_fingerprint(tiny_model_dir) and len(ident["data_tokens"]) == 16
    assert set(ident["versions"]) == {"ropescale", "torch", "transformers"}
    assert r["experiment"] == m["identity_hash"] and r["schema"] == 2
    # the recorded config is the run's whole config: read back, it is the same EvalConfig, with dtype: auto
    # recorded as what it resolved to (float32 on the CPU), so results stay comparable
    assert m["config"]["options"]["max_windows"] == 2
    assert build_config(m["config"]) == cfg.model_copy(update={"dtype": "float32"})


def test_manifest_config_keeps_the_task_options_and_reproduces_the_identity(tmp_path, tiny_model_dir):
    cfg = build_config({"task": "passkey", "model": str(tiny_model_dir), "lengths": [128], "strategies": ["vanilla"],
                        "device": "cpu", "passkey": {"trials": 1, "depths": [0.0, 1.0], "digits": 3,
                                                     "candidates": 4, "preamble": True}})
    run_sweep(cfg, tmp_path, progress=False)
    m = json.loads((tmp_path / MANIFEST).read_text())
    options = m["config"]["options"]
    assert (options["trials"], options["depths"], options["digits"], options["candidates"], options["preamble"]) \
        == (1, [0.0, 1.0], 3, 4, True)
    again = build_config(m["config"])
    assert again == cfg.model_copy(update={"dtype": "float32"}) and type(again.options) is PasskeyOptions
    uses_data = m["identity"]["data_tokens"] is not None
    inputs = load_inputs(again.model, again.data.spec() if uses_data else None)  # the run's data, read again
    ident = run_identity(experiment_fields(again, uses_data), model=again.model, docs=inputs.docs)
    assert ident == m["identity"]
    assert hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12] == m["identity_hash"]


def test_options_given_twice_are_refused():
    with pytest.raises(ConfigError, match="passkey: the task's options are given twice"):
        build_config({"task": "passkey", "lengths": [64], "strategies": ["vanilla"], "passkey": {"trials": 2},
                      "options": {"trials": 3}})


def test_other_data_in_the_same_folder_is_refused(tmp_path, tiny_model_dir, text_file):
    run_sweep(config(tiny_model_dir, text_file), tmp_path, progress=False)
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    with pytest.raises(ExperimentMismatchError, match=f"holds another experiment \\(data: '{other}' now"):
        run_sweep(config(tiny_model_dir, other), tmp_path, progress=False)
    # the same source name with other content: the token fingerprint differs
    text_file_copy = tmp_path / "copy"
    text_file_copy.mkdir()
    (text_file_copy / "a.txt").write_text(text_file.read_text())
    run_sweep(config(tiny_model_dir, text_file_copy), tmp_path / "b", progress=False)
    (text_file_copy / "a.txt").write_text(text_file.read_text()[:-500])
    with pytest.raises(ExperimentMismatchError, match="data_tokens: "):
        run_sweep(config(tiny_model_dir, text_file_copy), tmp_path / "b", progress=False)
    assert len(read_results(tmp_path / RESULTS)) == 1


def test_changed_weights_are_another_experiment(tmp_path, tiny_model_dir, text_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "m"
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    m.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(model_dir)
    run_sweep(config(model_dir, text_file), tmp_path / "o", progress=False)
    with torch.no_grad():
        m.lm_head.weight.mul_(1.5)  # retrained: same shapes, other numbers
    m.save_pretrained(model_dir)
    with pytest.raises(ExperimentMismatchError, match="weights: "):
        run_sweep(config(model_dir, text_file), tmp_path / "o", progress=False)


def test_two_runs_cannot_write_one_folder(tmp_path, tiny_model_dir, text_file):
    tmp_path.mkdir(exist_ok=True)
    with folder_lock(tmp_path), pytest.raises(FolderBusyError, match="is being written by another run"):
        run_sweep(config(tiny_model_dir, text_file), tmp_path, progress=False)
    assert not (tmp_path / RESULTS).exists()
    run_sweep(config(tiny_model_dir, text_file), tmp_path, progress=False)  # released


def test_results_from_before_manifests_are_not_mixed(tmp_path, tiny_model_dir, text_file):
    (tmp_path / RESULTS).write_text(json.dumps({"cell": "x", "strategy": "vanilla", "length": 32}) + "\n")
    with pytest.raises(ExperimentMismatchError, match="holds results without a manifest"):
        run_sweep(config(tiny_model_dir, text_file), tmp_path, progress=False)


def test_data_fingerprint_is_order_and_boundary_sensitive():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4])
    assert data_fingerprint([a, b]) != data_fingerprint([b, a])
    assert data_fingerprint([a, b]) != data_fingerprint([torch.tensor([1, 2]), torch.tensor([3, 4])])
    assert data_fingerprint([a, b]) == data_fingerprint([a.clone(), b.clone()]) and data_fingerprint(None) is None


@pytest.mark.parametrize("identity", [["task", "model"], "perplexity", 3, None])
def test_a_hand_edited_manifest_identity_is_one_line(tmp_path, identity):
    from ropescale.runs.manifest import check_manifest

    (tmp_path / MANIFEST).write_text(json.dumps({"identity": identity}))
    with pytest.raises(ExperimentMismatchError, match=f"{tmp_path / MANIFEST}: not a ropescale manifest, or a "
                                                      "corrupt one .identity is not a mapping."):
        check_manifest(tmp_path, {"task": "perplexity"}, {})

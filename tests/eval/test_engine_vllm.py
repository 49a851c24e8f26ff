"""``engine: vllm``: the harness's cells scored by vLLM from what ``patch --engine vllm`` writes.

Without vLLM: the refusals (one line, before anything is written) and the conversion of
log-probabilities into the tasks' parts, checked against the transformers engine's own scoring.
With vLLM (``bench/engines/install.sh vllm``; marked ``engines``, skipped where absent): a sweep
on the bundled model equals the transformers engine's within the parity tolerance, passkey's
greedy answers and candidate choices agree, and a cell whose first example disagrees past the
tolerance is refused with the cells before it kept."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from eval import engines
from eval.config import build_config
from eval.engines.vllm.scoring import EngineDisagrees, transformers_logprobs
from eval.sweep import RESULTS, read_results, run_sweep
from ropescale.runs.config import ConfigError

HAS_VLLM = engines.engine_python("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=engines.engine_status("vllm"))


def _cfg(model, data, **kw):
    return build_config({"model": str(model), "data": str(data), "lengths": [32, 64], "max_windows": 2,
                         "strategies": ["vanilla", "yarn"], "device": "cpu", "engine": "vllm", **kw})


@pytest.mark.parametrize("overrides,fragment", [
    ({"strategies": ["yarn", "rerope"]}, "strategies: rerope: a relative-position rule applied inside attention; "
                                         "vLLM has no setting for it (engine: vllm; use engine: transformers)"),
    ({"strategies": ["yarn:logn=true"]},
     "strategies: yarn+logn: a query temperature (log-n or another rule) has no vLLM setting"),
    ({"strategies": [{"name": "yarn", "temperature": {"kind": "beta", "beta": 0.1}}]},
     "strategies: yarn+beta:beta=0.1: a query temperature (log-n or another rule) has no vLLM setting"),
    ({"strategies": ["dynamic_yarn"]}, "no transformers rope type to translate, so vLLM cannot express it"),
    ({"strategies": ["dynamic_ntk"], "dynamic_block": 8}, "dynamic_block scores block-wise"),
    ({"vllm": {"max_model_len": 40}}, "vllm.max_model_len: 40 is shorter than the 65 tokens a perplexity cell"),
])
def test_what_vllm_cannot_do_is_refused_before_anything_is_written(tmp_path, tiny_model_dir, text_file, overrides,
                                                                  fragment):
    with pytest.raises(ConfigError) as e:
        run_sweep(_cfg(tiny_model_dir, text_file, **overrides), tmp_path / "out", progress=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_absent_vllm_is_one_line_naming_the_install_script(tmp_path, tiny_model_dir, text_file, monkeypatch):
    monkeypatch.setenv("ROPESCALE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    res = CliRunner().invoke(__import__("cli").main, [
        "sweep", "--engine", "vllm", "--model", str(tiny_model_dir), "--data", str(text_file), "--lengths", "32",
        "--strategy", "yarn", "--device", "cpu", "-q", "-o", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    line = res.output.strip()
    assert "\n" not in line and line.startswith("Error: config: engine: vllm: vLLM is not installed")
    assert "bench/engines/install.sh" in line and not (tmp_path / "out").exists()


def test_unknown_vllm_key_is_named(tiny_model_dir, text_file):
    with pytest.raises(ConfigError, match=r"vllm.tensor_paralel_size: unknown key; allowed: tensor_parallel_size, "
                                          r".*\(did you mean 'tensor_parallel_size'\?\)"):
        _cfg(tiny_model_dir, text_file, vllm={"tensor_paralel_size": 2})


def test_a_vllm_section_beside_another_engine_is_refused(tiny_model_dir, text_file):
    """``vllm:`` settings with ``engine: transformers`` (the default) were ignored without a word; a
    config dumped with the transformers engine (the manifest's: no vllm section) still reads back."""
    raw = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32], "strategies": ["yarn"]}
    for extra in ({"vllm": {"tensor_parallel_size": 2}}, {"engine": "transformers", "vllm": {}}):
        with pytest.raises(ConfigError) as e:
            build_config({**raw, **extra}, "x.yaml")
        assert str(e.value) == ("x.yaml: vllm: settings of engine: vllm, but this config's engine is transformers "
                                "(which would ignore them); set engine: vllm, or drop the vllm: section")
    plain = build_config(raw)
    assert plain.engine_options is None and build_config(plain.model_dump(mode="json")) == plain
    served = build_config({**raw, "engine": "vllm"})
    assert served.engine_options.tensor_parallel_size == 1 and build_config(served.model_dump(mode="json")) == served


def test_log_probabilities_become_the_transformers_engines_perplexity(tiny_model_dir, text_file):
    """The engine path's bucketing, fed transformers' own log-probabilities, gives the transformers
    engine's record: ``Perplexity.combine`` over ``window_nll``'s parts (sliding windows: scored
    tokens start inside the window; a BOS shifts them)."""
    from eval.tasks.base import get_task
    from ropescale import load_model
    from ropescale.runs.data import load_documents, tokenize_documents
    from ropescale.strategies import get_strategy

    model, tok = load_model(str(tiny_model_dir), device="cpu")
    cfg = build_config({"model": str(tiny_model_dir), "data": str(text_file), "lengths": [32],
                        "strategies": ["vanilla"], "mode": "sliding", "stride": 12, "max_windows": 5, "add_bos": True})
    docs = tokenize_documents(tok, load_documents(cfg.data.spec()))
    task = get_task("perplexity")(cfg.options, tokenizer=tok, train_length=32, documents=docs)
    windows = task.examples(32)
    vanilla = get_strategy("vanilla")
    ours = task.combine([task.measure(model, windows, list(range(len(windows))), length=32, strategy=vanilla,
                                      device="cpu", desc=None)], windows, length=32, strategy=vanilla)
    bos = [tok.bos_token_id]
    results = [{"logprobs": transformers_logprobs(model, bos + docs[w.doc][w.start:w.end].tolist(), "cpu").tolist()}
               for w in windows]
    theirs = task.combine([task.engine_parts(windows, results, 32)], windows, length=32, strategy=vanilla)
    assert theirs["tokens"] == ours["tokens"] and theirs["windows"] == ours["windows"]
    assert theirs["nll"] == pytest.approx(ours["nll"], rel=1e-6)
    for a, b in zip(theirs["nll_by_position"], ours["nll_by_position"]):
        assert a["tokens"] == b["tokens"] and a["nll"] == pytest.approx(b["nll"], rel=1e-6, abs=1e-9)


def test_retrieval_requests_ask_for_the_answer_and_every_candidate(tiny_model_dir):
    from eval.tasks.base import get_task
    from ropescale.models import load_tokenizer

    cls = get_task("passkey")
    task = cls(cls.Options(depths=[0.5], trials=2, candidates=3), tokenizer=load_tokenizer(str(tiny_model_dir)),
               train_length=32)
    examples = task.examples(96)
    reqs, first = task.engine_requests(examples)
    assert len(reqs) == 2 * (1 + 3) and first == 1
    ex = examples[0]
    assert reqs[0] == {"ids": ex.prompt.ids, "max_tokens": len(ex.prompt.answer_ids) + 2, "prompt_logprobs": False}
    assert reqs[1]["ids"] == ex.prompt.ids + ex.prompt.answer_ids and reqs[1]["prompt_logprobs"]


REQS = [{"ids": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": True},
        {"ids": [5, 6], "max_tokens": 4, "prompt_logprobs": False}]
GOOD = {"results": [{"logprobs": [-1.0, -2.0], "tokens": [9]}, {"logprobs": None, "tokens": [1, 2]}],
        "vllm": "0.fake", "start_seconds": 1.5, "score_seconds": 0.25}


@pytest.mark.parametrize(("answer", "message"), [
    ({**GOOD, "results": GOOD["results"][:1]}, "answered 1 of the 2 requests asked"),
    ({k: v for k, v in GOOD.items() if k != "start_seconds"}, r"answered without a valid start_seconds \(Field "
                                                              r"required\)"),
    ({k: v for k, v in GOOD.items() if k != "vllm"}, r"answered without a valid vllm \(Field required\)"),
    ({**GOOD, "results": [{"logprobs": [-1.0], "tokens": []}, GOOD["results"][1]]},
     r"answered request 0 with 1 log-probabilities for a prompt of 3 tokens \(2 asked\)"),
    ({**GOOD, "results": [{"tokens": [9]}, GOOD["results"][1]]}, r"answered request 0 with no log-probabilities"),
    ({**GOOD, "results": [GOOD["results"][0], {"tokens": [1, 2, 3, 4, 5]}]},
     r"generated 5 tokens for request 1, more than the 4 asked"),
    ({**GOOD, "results": [{"logprobs": ["x", -2.0], "tokens": [9]}, GOOD["results"][1]]},
     r"answered without a valid results.0.logprobs.0"),
], ids=["short", "no_timing", "no_version", "logprobs_short", "logprobs_absent", "tokens_long", "logprob_text"])
def test_the_drivers_answer_is_checked_against_the_request(answer, message):
    from eval.engines import EngineFailed
    from eval.engines.vllm.scoring import checked_answer

    assert checked_answer(GOOD, REQS, "yarn @ 64").vllm == "0.fake"
    with pytest.raises(EngineFailed, match=rf"^yarn @ 64: vLLM's driver {message}.*; the cell is not recorded$"):
        checked_answer(answer, REQS, "yarn @ 64")


def test_a_short_answer_is_not_recorded_and_the_corrected_rerun_is(tmp_path, tiny_model_dir, text_file, monkeypatch):
    """A driver answering one of a cell's two windows was recorded as the cell (windows: 1); now the
    cell is refused in one line and left out, and the rerun with a whole answer records it. The
    answers are log p = -1 at each of a window's 31 scored positions (parity with transformers is
    taken out of the way by the tolerance), so the cell's NLL is 1 exactly."""
    from eval.engines import EngineFailed

    cfg = _cfg(tiny_model_dir, text_file, lengths=[32], strategies=["vanilla"], vllm={"parity_tolerance": 1e9})
    whole = {"results": [{"logprobs": [-1.0] * 31, "tokens": [0]}] * 2, "vllm": "0.fake", "start_seconds": 1.0,
             "score_seconds": 2.0}  # max_windows 2 windows of 32 tokens, no BOS
    answer = tmp_path / "answer.json"
    script = tmp_path / "fake-vllm-python"  # an engine python that answers whatever it is asked with answer.json
    script.write_text(f'#!/bin/sh\ncp "{answer}" "$3"\n')
    script.chmod(0o755)
    monkeypatch.setenv(engines.environment("vllm").variable, str(script))
    monkeypatch.setattr("eval.sweep.write_reports", lambda records, output: None)  # tables and plots: not tested here
    answer.write_text(json.dumps({**whole, "results": whole["results"][:1]}))
    with pytest.raises(EngineFailed, match=r"^vanilla @ 32: vLLM's driver answered 1 of the 2 requests asked; the "
                                           r"cell is not recorded$"):
        run_sweep(cfg, tmp_path / "out", progress=False)
    assert read_results(tmp_path / "out" / RESULTS) == []
    answer.write_text(json.dumps(whole))
    (record,) = run_sweep(cfg, tmp_path / "out", progress=False)
    assert (record["windows"], record["tokens"], record["nll"]) == (2, 62, 1.0)
    assert record["engine_version"] == "0.fake" and record["engine_start_seconds"] == 1.0


# --- with vLLM


@needs_vllm
@pytest.mark.engines
def test_sweep_through_vllm_equals_the_transformers_engine(tmp_path):
    from ropescale.reference import kjv  # noqa: F401  (the bundled model and its data)

    raw = {"model": "reference", "data": "kjv-heldout", "lengths": [128, 256], "max_windows": 2, "device": "cpu",
           "strategies": ["vanilla", "yarn", "dynamic_ntk", "llama3"]}
    ours = run_sweep(build_config(raw), tmp_path / "hf", progress=False)
    theirs = run_sweep(build_config({**raw, "engine": "vllm"}), tmp_path / "vllm", progress=False)
    assert [(r["strategy"], r["length"]) for r in ours] == [(r["strategy"], r["length"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["engine"] == "transformers" and b["engine"] == "vllm" and b["engine_version"].startswith("0.")
        assert b["tokens"] == a["tokens"]
        assert abs(b["nll"] - a["nll"]) <= b["parity"]["tolerance"], (a["strategy"], a["length"], a["nll"], b["nll"])
        assert b["parity"]["mean_nll_diff"] <= 1e-4 and b["parity"]["max_abs_dlogp"] < 1e-3
    manifest = json.loads((tmp_path / "vllm" / "manifest.json").read_text())
    assert manifest["identity"]["engine"] == "vllm" and "engine" not in json.loads(
        (tmp_path / "hf" / "manifest.json").read_text())["identity"]
    assert (tmp_path / "vllm" / "vllm").is_dir()  # the served folders: patch --engine vllm's config


@needs_vllm
@pytest.mark.engines
def test_passkey_through_vllm_gives_the_transformers_engines_answers(tmp_path):
    raw = {"task": "passkey", "model": "reference", "lengths": [128], "device": "cpu", "strategies": ["linear"],
           "passkey": {"depths": [0.0, 1.0], "trials": 2, "candidates": 3}}
    ours = run_sweep(build_config(raw), tmp_path / "hf", progress=False)[0]
    theirs = run_sweep(build_config({**raw, "engine": "vllm"}), tmp_path / "vllm", progress=False)[0]
    for key in ("accuracy", "candidate_accuracy", "trials", "prompt_tokens"):
        assert theirs[key] == ours[key], key
    assert theirs["parity"]["mean_nll_diff"] <= 1e-4


@needs_vllm
@pytest.mark.engines
def test_a_cell_past_the_tolerance_is_refused_and_not_recorded(tmp_path):
    # vLLM's CPU attention takes head_dim 32 (the bundled model's), not the tiny model's 16
    cfg = _cfg("reference", "kjv-heldout", lengths=[128], strategies=["vanilla"], vllm={"parity_tolerance": 1e-12})
    with pytest.raises(EngineDisagrees, match=r"vanilla @ 128: vLLM [\d.]+ and transformers disagree on the cell's "
                                              r"first example: .*> tolerance 1e-12.*the cell is not recorded"):
        run_sweep(cfg, tmp_path, progress=False)
    assert read_results(tmp_path / RESULTS) == []


DRIVER_LEAVING_A_CHILD = """
import json, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(sys.argv[2], "w") as f:
    json.dump({"child": child.pid}, f)
os._exit(0)  # as vllm_driver.py leaves: without tearing its children down
"""


def test_a_driver_leaving_by_os_exit_takes_its_children_with_it(tmp_path, monkeypatch):
    """vllm_driver.py leaves by os._exit once its result is written; vLLM's engine-core and worker
    processes (1.7 GB each) outlived it, one set per cell, until the machine ran out of memory."""
    import sys
    import time

    from eval import engines

    monkeypatch.setattr(engines.process, "require_engine", lambda engine: Path(sys.executable))
    (tmp_path / "driver.py").write_text(DRIVER_LEAVING_A_CHILD)
    out = engines.run_engine("vllm", {"mode": "score"}, script=str(tmp_path / "driver.py"))

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state not in ("Z", "X")  # a zombie waits for init to reap it: it runs no more

    deadline = time.monotonic() + 5
    while alive(out["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(out["child"])

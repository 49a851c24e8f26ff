"""Runs that cannot work are refused in one line before anything is allocated: lengths beyond
any model, trials and candidates past their bounds, lengths whose estimated memory exceeds what
is free (while an 8B model at 128k tokens on an 80 GiB GPU is accepted), needle haystacks that
are a few lines repeated; and a results folder holds one task's experiment."""

import logging

import pytest
import torch
from transformers import LlamaConfig

from eval.config import MAX_LENGTH, ConfigError, build_config
from eval.sweep import run_sweep
from eval.tasks.passkey import Passkey, PasskeyOptions
from eval.tasks.perplexity import Perplexity, PerplexityOptions
from ropescale.errors import RopescaleError
from ropescale.runs import memory
from ropescale.runs.data import DataError
from ropescale.runs.manifest import ExperimentMismatchError
from ropescale.runs.memory import GiB, InsufficientMemoryError, check_fits


def passkey(**kw):
    return {"task": "passkey", "lengths": [128], "strategies": ["vanilla"], "passkey": kw}


@pytest.mark.parametrize("raw,match", [
    ({**passkey(), "lengths": [99999999999999999999]},
     r"lengths: 99999999999999999999 tokens is beyond any model: .* use lengths of at most 16777216$"),
    ({**passkey(), "lengths": [MAX_LENGTH + 1]}, "beyond any model"),
    (passkey(trials=10**23), r"passkey: trials=100000000000000000000000 is more than there are 5-digit keys "
                             r"\(90000\): .*use at most 90000 trials"),
    (passkey(trials=91, digits=2), r"passkey: trials=91 is more than there are 2-digit keys \(90\)"),
    (passkey(candidates=50000), r"passkey: candidates=50000: at most 1000 \(each candidate is one more forward "
                                r"per example in every cell: 50000 × 60 examples = 3000000 forwards per cell"),
])
def test_absurd_sizes_are_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_config(raw, "cfg.yaml")
    assert "\n" not in str(err.value)


def test_the_bounds_leave_real_runs_alone():
    build_config({**passkey(trials=90000), "lengths": [131072, 10_000_000, MAX_LENGTH]})
    build_config(passkey(candidates=1000))


class _Fake:
    """A model as the estimates see it: a config and a dtype, no weights."""

    def __init__(self, config, dtype):
        self.config, self.dtype = config, dtype


LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)


def test_an_8b_model_at_128k_tokens_fits_an_80gb_gpu(monkeypatch):
    task = Passkey(PasskeyOptions(), tokenizer=None, train_length=8192)
    need = task.memory(131072, _Fake(LLAMA3_8B, torch.bfloat16))
    assert 15.9 * GiB < need.device["KV cache"] < 16.1 * GiB  # 2 × 32 layers × 8 × 128 × 2 bytes per token
    assert sum(need.device.values()) < 40 * GiB and sum(need.host.values()) < 4 * GiB
    monkeypatch.setattr(memory, "device_available", lambda device: 80 * GiB - 16 * GiB)  # after the weights
    monkeypatch.setattr(memory, "host_available", lambda: 64 * GiB)
    check_fits(need, "cuda")  # accepted
    ppl = Perplexity(PerplexityOptions(), tokenizer=None, train_length=8192).memory(
        131072, _Fake(LLAMA3_8B, torch.bfloat16))
    check_fits(ppl, "cuda")
    with pytest.raises(InsufficientMemoryError, match=r"passkey at 1048576 tokens \(60 prompts, 10 candidates each\) "
                                                      r"needs about .* GiB on cuda \(KV cache 128 GiB \+ activations"
                                                      r" .*\); this device has 64.0 GiB free"):
        check_fits(task.memory(1 << 20, _Fake(LLAMA3_8B, torch.bfloat16)), "cuda")


def test_a_length_that_cannot_fit_is_refused_before_any_example_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "host_available", lambda: 16 * GiB)
    monkeypatch.setattr(Passkey, "examples", lambda self, length: pytest.fail("examples built before the check"))
    cfg = build_config({**passkey(), "model": "reference", "device": "cpu", "lengths": [128, 10_000_000, 12_000_000]})
    with pytest.raises(InsufficientMemoryError) as err:
        run_sweep(cfg, tmp_path / "o", progress=False)
    line = str(err.value)
    assert (line.startswith("passkey at 10000000 tokens (60 prompts, 10 candidates each) needs about ")
            and "\n" not in line)
    assert "KV cache 76.3 GiB" in line and "this machine has 16.0 GiB free" in line
    assert line.endswith("drop length 10000000 (and 1 longer) from lengths, or run on a device with more memory")
    assert isinstance(err.value, RopescaleError)


@pytest.fixture
def haystack(tmp_path):
    def write(text):
        path = tmp_path / "hay.txt"
        path.write_text(text)
        return path
    return write


@pytest.mark.parametrize("text", ["Hi. " * 3000, " ".join(f"Line {w} is here." for w in ["a", "b", "c", "d"] * 500)],
                         ids=["one-2-token-sentence", "four-sentences"])
def test_needle_refuses_a_haystack_of_a_few_lines_repeated(tmp_path, tiny_model_dir, haystack, text):
    path = haystack(text)
    cfg = build_config({"task": "needle", "model": str(tiny_model_dir), "data": str(path), "lengths": [160],
                        "strategies": ["vanilla"], "device": "cpu",
                        "needle": {"trials": 1, "depths": [0.5], "digits": 4, "candidates": 3}})
    with pytest.raises(DataError, match=rf"^{path}: the needle haystack needs real text, but it has only \d distinct "
                                        r"sentences \(\d+ in all, e.g. .*\); .* at least 10 distinct sentences$"):
        run_sweep(cfg, tmp_path / "o", progress=False)


@pytest.mark.parametrize("text", ["Hi. " * 3000, " ".join(f"Line {w} is here." for w in ["a", "b", "c"] * 500)],
                         ids=["one-2-token-sentence", "three-sentences"])
def test_niah_multikey_refuses_a_haystack_needle_refuses(tmp_path, tiny_model_dir, haystack, text):
    """A haystack of 3 tiled sentences, which needle refuses, was taken by niah_multikey."""
    path = haystack(text)
    common = {"model": str(tiny_model_dir), "data": str(path), "lengths": [224], "strategies": ["vanilla"],
              "device": "cpu"}
    for task, options in (("needle", {"trials": 1, "depths": [0.5], "digits": 4, "candidates": 3}),
                          ("niah_multikey", {"trials": 1, "depths": [0.5], "keys": 2, "digits": 4, "candidates": 3})):
        cfg = build_config({**common, "task": task, task: options})
        with pytest.raises(DataError, match=rf"^{path}: the {task} haystack needs real text, but it has only \d "
                                            r"distinct sentences? \(\d+ in all, e.g. .*\); a few lines repeated are "
                                            r"passkey's filler \(use task: passkey\) — give a text with at least 10 "
                                            r"distinct sentences$"):
            run_sweep(cfg, tmp_path / task, progress=False)
        assert not (tmp_path / task / "results.jsonl").exists()


def test_needle_warns_when_the_haystack_repeats_its_text(tmp_path, tiny_model_dir, haystack, caplog):
    path = haystack(" ".join(f"Sentence number {w} stands alone." for w in
                             ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                              "eleven", "twelve"]))
    cfg = build_config({"task": "needle", "model": str(tiny_model_dir), "data": str(path), "lengths": [400],
                        "strategies": ["vanilla"], "device": "cpu",
                        "needle": {"trials": 1, "depths": [0.5], "digits": 4, "candidates": 3}})
    with caplog.at_level(logging.WARNING, logger="ropescale"):
        run_sweep(cfg, tmp_path / "o", progress=False)
    assert any(f"{path}: its 12 distinct sentences hold" in r.getMessage() and "repeats the text" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_results_folder_holds_one_task(tmp_path, tiny_model_dir, text_file):
    common = {"model": str(tiny_model_dir), "data": str(text_file), "lengths": [160], "strategies": ["vanilla"],
              "device": "cpu"}
    opts = {"trials": 1, "depths": [0.5], "digits": 4, "candidates": 3}
    run_sweep(build_config({**common, "task": "needle", "needle": opts}), tmp_path, progress=False)
    with pytest.raises(ExperimentMismatchError, match=rf"^{tmp_path} holds another experiment \(.*task: 'passkey' "
                                                      r"now, 'needle' in the folder\); give a new output folder"):
        run_sweep(build_config({**common, "task": "passkey", "passkey": opts}), tmp_path, progress=False)
    # more lengths and strategies of the same experiment are welcome
    run_sweep(build_config({**common, "task": "needle", "needle": opts, "lengths": [160, 192],
                            "strategies": ["vanilla", "yarn"]}), tmp_path, progress=False)


def test_the_examples_of_every_length_add_up_on_the_host(tmp_path, monkeypatch):
    # 30 000 prompts of 8192 tokens are 1.8 GiB of token lists, and those of 16384 tokens 3.7 GiB: each
    # fits in 5 GiB, but every length's examples are built before the first cell and held together
    monkeypatch.setattr(memory, "host_available", lambda: 5 * GiB)
    monkeypatch.setattr(Passkey, "examples", lambda self, length: pytest.fail("examples built before the check"))
    cfg = build_config({**passkey(trials=5000, candidates=2), "model": "reference", "device": "cpu",
                        "lengths": [8192, 16384]})
    with pytest.raises(InsufficientMemoryError, match=r"^passkey at 16384 tokens .* examples of shorter lengths "
                                                      r"1.8 GiB\); this machine has 5.0 GiB free; drop length 16384 "):
        run_sweep(cfg, tmp_path / "o", progress=False)


@pytest.mark.parametrize("error,shown", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.1 GiB"),
     "CUDA out of memory. Tried to allocate 20.00 GiB."),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 81920000000 bytes. Error code 12 (Cannot allocate memory)"), "can't allocate memory"),
    (MemoryError(), "MemoryError"),
], ids=["cuda", "cpu", "python"])
def test_running_out_of_memory_past_the_estimate_is_one_line(tmp_path, tiny_model_dir, monkeypatch, error, shown):
    def measure(self, *a, **kw):
        raise error

    monkeypatch.setattr(Passkey, "measure", measure)
    cfg = build_config({**passkey(trials=1, depths=[0.5], digits=3, candidates=2), "model": str(tiny_model_dir),
                        "device": "cpu", "lengths": [64]})
    with pytest.raises(InsufficientMemoryError,
                       match=r"^vanilla @ 64: out of memory on cpu \(.*\); the cells "
                             r"finished before it are saved, so a rerun resumes: drop length 64 ") as err:
        run_sweep(cfg, tmp_path / "o", progress=False)
    assert shown in str(err.value) and "\n" not in str(err.value)


def test_other_runtime_errors_are_not_taken_for_memory(tmp_path, tiny_model_dir, monkeypatch):
    def measure(self, *a, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(Passkey, "measure", measure)
    cfg = build_config({**passkey(trials=1, depths=[0.5], digits=3, candidates=2), "model": str(tiny_model_dir),
                        "device": "cpu", "lengths": [64]})
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        run_sweep(cfg, tmp_path / "o", progress=False)


def test_thousands_of_prompts_show_a_progress_bar_while_built(monkeypatch):
    import eval.tasks.retrieval as retrieval
    from ropescale.models import load_tokenizer

    seen = []
    real = retrieval.progress
    monkeypatch.setattr(retrieval, "progress", lambda total, desc, unit="it": seen.append((total, desc)) or
                        real(total, None, unit))
    task = Passkey(PasskeyOptions(trials=200, depths=[0.0, 0.25, 0.5, 0.75, 1.0], candidates=2),
                   tokenizer=load_tokenizer("reference"), train_length=128)
    task.examples(64)
    assert seen == [(1000, "passkey prompts @ 64")]


def test_a_container_limit_bounds_the_free_memory_without_counting_reclaimable_cache(tmp_path):
    (tmp_path / "memory.max").write_text(f"{32 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{30 * GiB}\n")  # 20 GiB of it page cache of a model just read
    (tmp_path / "memory.stat").write_text(f"anon {10 * GiB}\nfile {20 * GiB}\ninactive_file {18 * GiB}\n")
    assert memory._cgroup_room(tmp_path) == 20 * GiB
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_room(tmp_path) is None
    assert memory._cgroup_room(tmp_path / "none") is None

"""The task layer: registry, config sections, and the harness running a retrieval task
end to end on a tiny random model (finite results, same examples for every strategy, resume)."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.config import ConfigError, build_config
from eval.sweep import RESULTS, read_results, run_sweep
from eval.tasks import Task, UnknownTaskError, get_task, task_names
from eval.tasks.needle import Needle
from eval.tasks.passkey import Passkey, PasskeyOptions
from eval.tasks.retrieval import wilson
from ropescale.runs.data import load_documents, tokenize_documents
from tests.approx import nested_approx


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
    ({"task": "passkey", "passkey": {"trails": 3}}, "passkey.trails: unknown key; allowed: .*did you mean 'trials'"),
    ({"task": "passkey", "passkey": {"depths": [2]}}, r"passkey.depths: depths must lie in \[0, 1\]"),
    ({"task": "passkey", "mode": "chunk"}, "mode: unknown key; allowed: .*passkey"),
    ({"task": "passkey", "paskey": {"trials": 3}}, "paskey: unknown key.*did you mean 'passkey'"),
    # a key that would be ignored: kl_first_tokens splits the KL, which only kl: true measures
    ({"perplexity": {"kl_first_tokens": 16}}, "perplexity: kl_first_tokens=16 is read only with kl: true"),
])
def test_bad_task_configs_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"lengths": [64], "strategies": ["vanilla"], **raw})


def passkey_config(model_dir, **kw):
    return build_config({"task": "passkey", "model": str(model_dir), "lengths": [56, 64],
                         "strategies": ["vanilla", "yarn", "rerope", "dynamic_ntk"], "device": "cpu",
                         "passkey": {"trials": 2, "depths": [0, 1], "digits": 3, "candidates": 4}, **kw})


@torch.no_grad()
def scored_by_hand(model_dir, task, length, match):
    """Each example scored the textbook way, without the harness: greedy answer + 2 tokens by
    full forwards (no cache), candidates by one full forward each; ``match(text, answer)``.
    Returns (greedy hits, candidate hits, depth index) per example."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = []
    for ex in task.examples(length):
        out = []
        for _ in range(len(ex.prompt.answer_ids) + 2):
            out.append(int(model(torch.tensor([ex.prompt.ids + out])).logits[0, -1].argmax()))
        scores = []
        for c in ex.candidates:
            logp = model(torch.tensor([ex.prompt.ids + c])).logits[0].double().log_softmax(-1)
            n = len(ex.prompt.ids)
            scores.append(sum(logp[n - 1 + j, t].item() for j, t in enumerate(c)))
        rows.append((match(task.tokenizer.decode(out), ex.prompt.answer), scores[0] > max(scores[1:]),
                     ex.depth_index))
    return rows


def expected_record(rows, depths):
    def stats(sel):
        n, e, c = len(sel), sum(r[0] for r in sel), sum(r[1] for r in sel)
        return {"trials": n, "accuracy": e / n, "accuracy_ci": list(wilson(e, n)),
                "candidate_accuracy": c / n, "candidate_accuracy_ci": list(wilson(c, n))}
    return stats(rows), [{"depth": d, **stats([r for r in rows if r[2] == i])} for i, d in enumerate(depths)]


def yarn_match(text, answer):  # YaRN's passkey check: the first integer, as an integer
    m = re.search(r"[0-9]+", text)
    return m is not None and int(m.group()) == int(answer)


def test_passkey_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    cfg = passkey_config(tiny_model_dir)
    records = run_sweep(cfg, tmp_path, progress=False)
    assert [(r["strategy"], r["length"]) for r in records] == [
        (s, n) for n in (56, 64) for s in ("vanilla", "yarn", "rerope", "dynamic_ntk")]
    task = Passkey(cfg.options, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), train_length=32)
    for r in records:
        assert r["task"] == "passkey" and r["trials"] == 4 and r["chance"] == 0.25
        assert [(d["depth"], d["trials"]) for d in r["by_depth"]] == [(0.0, 2), (1.0, 2)]
        for key in ("accuracy", "candidate_accuracy"):  # counts out of 4, their Wilson intervals
            hits = round(r[key] * 4)
            assert r[key] == hits / 4 and r[key + "_ci"] == pytest.approx(list(wilson(hits, 4)), abs=1e-12)
            assert sum(round(d[key] * d["trials"]) for d in r["by_depth"]) == hits
        if r["strategy"] == "vanilla":  # the unpatched model: the harness's scores are the textbook ones
            overall, by_depth = expected_record(scored_by_hand(tiny_model_dir, task, r["length"], yarn_match),
                                                [0.0, 1.0])
            assert {k: r[k] for k in overall} == nested_approx(overall)
            assert [{k: d[k] for k in e} for d, e in zip(r["by_depth"], by_depth)] == nested_approx(by_depth)
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
    assert (tmp_path / "depth_heatmap.png").exists()
    # the same examples from the same text, scored by hand: RULER's check (the number appears)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    docs = tokenize_documents(tok, load_documents(cfg.data.spec()))
    task = Needle(cfg.options, tokenizer=tok, train_length=32, documents=docs)
    overall, by_depth = expected_record(scored_by_hand(tiny_model_dir, task, 160, lambda text, a: a in text), [0.5])
    assert {k: r[k] for k in overall} == nested_approx(overall)
    assert [{k: d[k] for k in e} for d, e in zip(r["by_depth"], by_depth)] == nested_approx(by_depth)

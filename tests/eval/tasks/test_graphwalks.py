"""``graphwalks`` (OpenAI's GraphWalks): the prompt is the card's, byte for byte, against released rows; the exact
solver reproduces their answers and hand-derived ones; generated samples have the card's format and the answers an
independent solver finds; the metric is lm-evaluation-harness's (transcribed below, and the installed one where
lm-eval is there); samples fill L; the task end to end on a tiny model and on the bundled one.

Released rows: ``tests/data/graphwalks/rows.json`` (four rows of openai/graphwalks at its 2026-02-27 revision or
later, as NVIDIA-NeMo/Gym redistributes them; where they come from is in the file)."""

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.config import ConfigError, build_config
from eval.sweep import run_sweep
from eval.tasks import get_task
from eval.tasks.prompts import PromptError
from eval.tasks.synthetic.graphwalks import final_answer, set_f1
from eval.tasks.synthetic.graphwalks_gen import bfs_at_depth, draw_graph, parents_of, render_prompt
from ropescale.models import REFERENCE_MODEL

ROWS = json.loads((Path(__file__).parents[2] / "data" / "graphwalks" / "rows.json").read_text())["rows"]
EDGES_AT = "Here is the graph to operate on:\nThe graph has the following edges:\n"


def md5_id(i):
    return hashlib.md5(str(i).encode()).hexdigest()[:10]


def read_prompt(prompt):
    """A prompt read back without the code under test: its edges, operation line, asked node and depth (0: parents)."""
    _, rest = prompt.split(EDGES_AT, 1)
    edge_text, tail = rest.split("\n\n\nOperation:\n", 1)
    edges = [tuple(line.split(" -> ")) for line in edge_text.split("\n")]
    op = tail.split("\n", 1)[0]
    m = re.fullmatch(r"Perform a BFS from node (\w+) and return only the nodes at exactly depth (\d+) \(not nodes at "
                     r"intermediate depths\)\.", op) or re.fullmatch(r"Find the parents of node (\w+)\.", op)
    return edges, op, m[1], int(m[2]) if m.lastindex == 2 else 0


def levels(edges, start, depth):
    """Oracle BFS: every node's shortest distance by relaxing all edges until nothing changes (no queue, no
    frontier), then the nodes at ``depth``."""
    dist = {start: 0}
    changed = True
    while changed:
        changed = False
        for s, t in edges:
            if s in dist and dist[s] + 1 < dist.get(t, float("inf")):
                dist[t], changed = dist[s] + 1, True
    return {n for n, d in dist.items() if d == depth}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['problem_type']}-{r['nemo_task_index']}")
def test_the_card_prompt_renders_released_rows_byte_for_byte(row):
    edges, op, _, depth = read_prompt(row["prompt"])
    assert render_prompt(edges, op) == row["prompt"]
    sources = list(dict.fromkeys(s for s, _ in edges))  # the card's layout: node i's edges, i = 0, 1, …
    assert sources == [md5_id(i) for i in range(len(sources))]
    assert {t for _, t in edges} <= set(sources) and len({sum(s == x for s, _ in edges) for x in sources}) == 1
    assert (row["problem_type"] == "bfs") == (depth > 0)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['problem_type']}-{r['nemo_task_index']}")
def test_the_solver_reproduces_the_released_answers(row):
    edges, _, node, depth = read_prompt(row["prompt"])
    got = bfs_at_depth(edges, node, depth) if depth else parents_of(edges, node)
    assert got == set(row["expected_answer"])


HAND = [  # a -> b, a -> c, b -> c, c -> d, d -> a, d -> d, e -> a: answers derived by hand
    ("bfs", "a", 1, {"b", "c"}),
    ("bfs", "a", 2, {"d"}),  # c is at depth 1, not again at 2 through b
    ("bfs", "a", 3, set()),  # d's targets are a (the start) and d (seen)
    ("bfs", "e", 2, {"b", "c"}),
    ("bfs", "b", 3, {"a"}),
    ("parents", "c", 0, {"a", "b"}),
    ("parents", "d", 0, {"c"}),  # d -> d: not its own parent
    ("parents", "e", 0, set()),
    ("parents", "a", 0, {"d", "e"}),
]
HAND_EDGES = [("a", "b"), ("a", "c"), ("b", "c"), ("c", "d"), ("d", "a"), ("d", "d"), ("e", "a")]


@pytest.mark.parametrize("problem,node,depth,want", HAND)
def test_the_solver_on_a_graph_solved_by_hand(problem, node, depth, want):
    got = bfs_at_depth(HAND_EDGES, node, depth) if problem == "bfs" else parents_of(HAND_EDGES, node)
    assert got == want
    if problem == "bfs":
        assert levels(HAND_EDGES, node, depth) == want  # the oracle agrees with the hand too


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))


def make(tok, **options):
    cls = get_task("graphwalks")
    return cls(cls.Options(**{"cache": False, **options}), tokenizer=tok, train_length=128)


def test_generated_samples_have_the_cards_format_and_exact_answers(tok):
    row = ROWS[0]["prompt"]
    head, tail = row.split(EDGES_AT)[0] + EDGES_AT, "\n" + row.split("\n\n\nOperation:\n")[1].split("\n", 1)[1]
    task = make(tok, num_samples=6, tokens_to_generate=32, out_degree=2, depths=[1, 2, 3])
    for i, ex in enumerate(task.examples(2048)):
        s = ex.sample
        edges, _, node, depth = read_prompt(s.prompt)
        assert s.prompt.startswith(head) and s.prompt.endswith(tail) and s.answer_prefix == ""
        n = len(edges) // 2
        assert [e[0] for e in edges] == [md5_id(j) for j in range(n) for _ in range(2)]  # out-degree 2, in order
        assert (depth > 0) == (i % 2 == 0) and depth in (0, 1, 2, 3)  # bfs, parents, bfs, …
        want = levels(edges, node, depth) if depth else {a for a, b in edges if b == node and a != node}
        assert list(s.outputs) == sorted(want) and s.index == depth


def test_samples_fill_the_length(tok):
    L, budget = 2048, 32
    examples = make(tok, num_samples=4, tokens_to_generate=budget).examples(L)
    total = [len(tok(ex.sample.prompt)["input_ids"]) + budget for ex in examples]
    assert all(t <= L for t in total) and [ex.sample.length for ex in examples] == total
    nodes = len(read_prompt(examples[0].sample.prompt)[0]) // 3
    bigger = draw_graph(42, L, 0, nodes + 1, out_degree=3, problem="bfs", depths=[1, 2])
    assert len(tok(bigger.prompt)["input_ids"]) + budget > L


def test_options_and_lengths_are_refused_in_one_line(tok):
    with pytest.raises(PromptError, match=r"^graphwalks at 512 tokens: no example fits: two nodes of out-degree 3 and "
                                          r"the operation take \d+ tokens with the generation budget, more than 512$"):
        make(tok, num_samples=1).examples(512)
    with pytest.raises(ConfigError, match=r"graphwalks\.depths: .*BFS depths are at least 1, got \[0, 2\]"):
        build_config({"task": "graphwalks", "lengths": [1024], "strategies": ["vanilla"],
                      "graphwalks": {"depths": [0, 2]}})
    with pytest.raises(ConfigError, match=r"graphwalks\.problems"):
        build_config({"task": "graphwalks", "lengths": [1024], "strategies": ["vanilla"],
                      "graphwalks": {"problems": ["dfs"]}})
    empty = make(tok, num_samples=8, tokens_to_generate=16, problems=["parents"], out_degree=1)
    assert any(not ex.sample.outputs for ex in empty.examples(1024))  # out-degree 1: some nodes have no parent
    full = make(tok, num_samples=8, tokens_to_generate=16, problems=["parents"], out_degree=1, empty_answers=False)
    assert all(ex.sample.outputs for ex in full.examples(1024))


# --- lm-evaluation-harness 0.4.13, lm_eval/tasks/graphwalks/utils.py (MIT): extract_answer_list,
# extract_answer_list_flexible and process_results, as written there (comments left out)
def lm_eval_extract_answer_list(response):
    line = response.rstrip("\n").split("\n")[-1]
    if "Final Answer:" not in line:
        return [], True
    match = re.search(r"Final Answer:\s*\[(.*)\]", line)
    if match:
        bracket_content = match.group(1)
        if not bracket_content.strip():
            return [], False
        result_list = [item.strip().strip("'\"") for item in bracket_content.split(",") if item.strip()]
        return result_list, False
    else:
        return [], True


def lm_eval_extract_answer_list_flexible(response):
    lines = response.rstrip("\n").split("\n")
    for line in reversed(lines):
        match = re.search(r"Final Answer:\s*\[(.*)\]", line)
        if match:
            bracket_content = match.group(1)
            if not bracket_content.strip():
                return [], False
            result_list = [item.strip().strip("'\"") for item in bracket_content.split(",") if item.strip()]
            return result_list, False
    return [], True


def lm_eval_process_results(doc, results, extract=lm_eval_extract_answer_list,
                            flexible=lm_eval_extract_answer_list_flexible):
    def f1_of(predicted):
        sampled_set, truth_set = set(predicted), set(doc["answer_nodes"])
        n_overlap, n_sampled, n_golden = len(sampled_set & truth_set), len(sampled_set), len(truth_set)
        recall = n_overlap / n_golden if n_golden > 0 else 0.0
        precision = n_overlap / n_sampled if n_sampled > 0 else 0.0
        return 2 * (recall * precision) / (recall + precision) if (recall + precision) > 0 else 0.0
    return {"f1": f1_of(extract(results[0])[0]), "flexible_f1": f1_of(flexible(results[0])[0])}


METRIC_CASES = [  # (response, gold, f1, flexible_f1): worked out by hand
    ("Final Answer: [a, b]", ["a", "b"], 1.0, 1.0),
    ("Final Answer: ['a', \"b\", c]\n\n", ["a", "b"], 0.8, 0.8),  # quotes stripped; P = 2/3, R = 1
    ("Final Answer: [a]\nsome words after", ["a"], 0.0, 1.0),  # not on the last line: only the flexible parse
    ("the answer is [a, b]", ["a", "b"], 0.0, 0.0),
    ("Final Answer: []", [], 0.0, 0.0),  # lm-eval: an empty gold set scores 0 (NeMo-Gym: 1; the card's snippet: 1)
    ("Final Answer: [a]", [], 0.0, 0.0),
    ("Final Answer: []", ["a"], 0.0, 0.0),
    ("Final Answer:[a,a,c,d]", ["a", "b"], 0.4, 0.4),  # a set: {a, c, d} vs {a, b}: P = 1/3, R = 1/2
    ("Final Answer: [a] Final Answer: [b]", ["b"], 0.0, 0.0),  # greedy: "a] Final Answer: [b" is one item
    ("Final Answer: [ , a, ]", ["a"], 1.0, 1.0),
]


def _installed_lm_eval():
    """lm-eval's own graphwalks utils where lm-eval is installed (the ``lm-eval`` extra), else None."""
    spec = importlib.util.find_spec("lm_eval")
    path = Path(spec.origin).parent / "tasks" / "graphwalks" / "utils.py" if spec and spec.origin else None
    if path is None or not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location("lm_eval_graphwalks_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("response,gold,f1,flexible", METRIC_CASES)
def test_the_metric_is_lm_evals(response, gold, f1, flexible):
    want = {"f1": pytest.approx(f1), "flexible_f1": pytest.approx(flexible)}
    assert lm_eval_process_results({"answer_nodes": gold}, [response]) == want  # the transcription, by hand
    installed = _installed_lm_eval()
    if installed is not None:
        assert installed.process_results({"answer_nodes": gold}, [response]) == want
    got = {"f1": set_f1(final_answer(response), gold), "flexible_f1": set_f1(final_answer(response, True), gold)}
    assert got == want


def hf_greedy(model, ids, n, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    gen = out[0, len(ids):].tolist()
    return gen[: gen.index(eos)] if eos in gen else gen


def test_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir):
    """The records' scores recomputed from transformers' generate and lm-eval's metric (transcribed)."""
    cfg = build_config({"task": "graphwalks", "model": str(tiny_model_dir), "lengths": [1024], "device": "cpu",
                        "strategies": ["vanilla", "ntk"],
                        "graphwalks": {"num_samples": 3, "batch_size": 2, "tokens_to_generate": 8}})
    records = run_sweep(cfg, tmp_path / "run", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = get_task("graphwalks")(cfg.options, tokenizer=tok, train_length=32).examples(1024)
    with torch.no_grad():
        preds = [tok.decode(hf_greedy(model, ex.ids, 8, tok.eos_token_id), skip_special_tokens=True)
                 for ex in examples]
    want = [lm_eval_process_results({"answer_nodes": list(ex.sample.outputs)}, [p]) for p, ex in zip(preds, examples)]
    r = records[0]
    assert (r["strategy"], r["length"]) == ("vanilla", 1024) and r["predictions"] == preds
    assert r["sample_scores"] == [w["f1"] for w in want]
    assert r["f1"] == round(100 * sum(w["f1"] for w in want) / 3, 2)
    assert r["flexible_f1"] == round(100 * sum(w["flexible_f1"] for w in want) / 3, 2)
    assert r["depths"] == [ex.sample.index for ex in examples] and r["gold_over_budget"] >= 0
    assert "set F1" in (tmp_path / "run" / "results.md").read_text()


def test_end_to_end_on_the_bundled_model(tmp_path):
    """The bundled model (T = 128): the card's instructions alone take ~540 of its tokens, so 8T; a frequency
    strategy and a relative-position rule."""
    cfg = build_config({"task": "graphwalks", "model": "reference", "lengths": [1024], "device": "cpu",
                        "strategies": ["yarn", "self_extend"],
                        "graphwalks": {"num_samples": 2, "tokens_to_generate": 8}})
    records = run_sweep(cfg, tmp_path / "run", progress=False)
    assert [(r["strategy"], r["length"]) for r in records] == [("yarn", 1024), ("self_extend", 1024)]
    assert all(0 <= r["f1"] <= 100 and r["prompt_tokens_max"] + 8 <= 1024 and r["samples"] == 2 for r in records)


def test_empty_answers_false_refuses_a_depth_that_only_draws_empty_sets(tok):
    # draw_graph gives up after 100 draws and kept the empty answer: a sample scored 0 whatever the model said
    task = make(tok, num_samples=1, tokens_to_generate=8, problems=["bfs"], depths=[1000], empty_answers=False)
    with pytest.raises(PromptError, match=r"^graphwalks at 1024 tokens: empty_answers is false but sample 0 \(bfs at "
                                          r"depth 1000\) drew an empty answer 100 times over; ask smaller depths"):
        task.examples(1024)


def test_a_depth_past_the_graph_stops_at_its_last_level():
    # the BFS stepped through every one of 10**12 empty levels: a sample of depths: [10**12] never came back
    edges = [("a", "b"), ("b", "c"), ("c", "a")]
    assert bfs_at_depth(edges, "a", 10**12) == set() and bfs_at_depth(edges, "a", 2) == {"c"}

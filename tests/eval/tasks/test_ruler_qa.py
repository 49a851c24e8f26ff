"""qa_1 / qa_2 against RULER's qa.py (NVIDIA/RULER c3f5e3b4) written out below, on hand-made data
sets in RULER's raw JSON layout (SQuAD v2, HotpotQA: the real ones are not available offline);
and the offline refusal."""

import json
import os
import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from eval.config import ConfigError, build_config
from eval.tasks import get_task
from eval.tasks.prompts import PromptError
from eval.tasks.ruler.qa_gen import hotpot_from_rows, read_hotpotqa, read_squad, squad_from_rows
from ropescale.models import REFERENCE_MODEL
from ropescale.runs.data import DataError

TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
            "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query} Answer:")


def ruler_read_squad(data):
    total_docs = [p['context'] for d in data['data'] for p in d['paragraphs']]
    total_docs = sorted(list(set(total_docs)))
    total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}
    total_qas = []
    for d in data['data']:
        more_docs = [total_docs_dict[p['context']] for p in d['paragraphs']]
        for p in d['paragraphs']:
            for qas in p['qas']:
                if not qas['is_impossible']:
                    total_qas.append({
                        'query': qas['question'],
                        'outputs': [a['text'] for a in qas['answers']],
                        'context': [total_docs_dict[p['context']]],
                        'more_context': [idx for idx in more_docs if idx != total_docs_dict[p['context']]]
                    })
    return total_qas, total_docs


def ruler_read_hotpotqa(data):
    total_docs = [f"{t}\n{''.join(p)}" for d in data for t, p in d['context']]
    total_docs = sorted(list(set(total_docs)))
    total_docs_dict = {c: idx for idx, c in enumerate(total_docs)}
    total_qas = []
    for d in data:
        total_qas.append({
            'query': d['question'],
            'outputs': [d['answer']],
            'context': [total_docs_dict[f"{t}\n{''.join(p)}"] for t, p in d['context']],
        })
    return total_qas, total_docs


def ruler_generate(QAS, DOCS, TOKENIZER, max_seq_length, num_samples, random_seed, tokens_to_generate=32):
    """qa.py's generate_input_output and generate_samples, globals made arguments."""
    random.seed(random_seed)
    np.random.seed(random_seed)
    DOCUMENT_PROMPT = "Document {i}:\n{document}"

    def generate_input_output(index, num_docs):
        curr_q = QAS[index]['query']
        curr_a = QAS[index]['outputs']
        curr_docs = QAS[index]['context']
        curr_more = QAS[index].get('more_context', [])
        if num_docs < len(DOCS):
            if (num_docs - len(curr_docs)) > len(curr_more):
                addition_docs = [i for i, d in enumerate(DOCS) if i not in curr_docs + curr_more]
                all_docs = curr_docs + curr_more + random.sample(
                    addition_docs, max(0, num_docs - len(curr_docs) - len(curr_more)))
            else:
                all_docs = curr_docs + random.sample(curr_more, num_docs - len(curr_docs))
            all_docs = [DOCS[idx] for idx in all_docs]
        else:
            repeats = (num_docs + len(DOCS) - 1) // len(DOCS)
            all_docs = (DOCS * repeats)[:num_docs]
        random.Random(random_seed).shuffle(all_docs)
        context = '\n\n'.join([DOCUMENT_PROMPT.format(i=i+1, document=d) for i, d in enumerate(all_docs)])
        input_text = TEMPLATE.format(context=context, query=curr_q)
        return input_text, curr_a

    incremental = 10
    sample_input_text, _ = generate_input_output(0, incremental)
    sample_tokens = len(TOKENIZER.tokenize(sample_input_text))
    tokens_per_doc = sample_tokens / incremental
    estimated_max_docs = int((max_seq_length / tokens_per_doc) * 3)
    lower_bound = incremental
    upper_bound = max(estimated_max_docs, incremental * 2)
    optimal_num_docs = None
    while lower_bound <= upper_bound:
        mid = (lower_bound + upper_bound) // 2
        input_text, answer = generate_input_output(0, mid)
        total_tokens = len(TOKENIZER.tokenize(input_text)) + tokens_to_generate
        if total_tokens <= max_seq_length:
            optimal_num_docs = mid
            lower_bound = mid + 1
        else:
            upper_bound = mid - 1
    num_docs = optimal_num_docs if optimal_num_docs is not None else incremental
    write_jsons = []
    for index in range(num_samples):
        used_docs = num_docs
        while True:
            try:
                input_text, answer = generate_input_output(index, used_docs)
                length = len(TOKENIZER.tokenize(input_text)) + tokens_to_generate
                assert length <= max_seq_length, f"{length} exceeds max_seq_length."
                break
            except:  # noqa: E722
                if used_docs > incremental:
                    used_docs -= incremental
        answer_prefix_index = input_text.rfind(" Answer:"[:10])
        write_jsons.append({"index": index, "input": input_text[:answer_prefix_index], "outputs": answer,
                            "length": length, "answer_prefix": input_text[answer_prefix_index:]})
    return write_jsons


def squad_json():
    rng = random.Random(3)
    words = ["river", "stone", "light", "field", "north", "wind", "bread", "salt", "iron", "cedar", "gate", "morning"]
    data = []
    for a in range(6):
        paragraphs = []
        for p in range(3):
            context = " ".join(rng.choice(words) for _ in range(40)) + f" Article {a} paragraph {p}."
            qas = [{"question": f"What is in article {a} paragraph {p} number {q}?", "is_impossible": q == 2,
                    "answers": [] if q == 2 else [{"text": f"answer {a}-{p}-{q}"}, {"text": f"alt {a}{p}{q}"}]}
                   for q in range(3)]
            paragraphs.append({"context": context, "qas": qas})
        data.append({"title": f"Article {a}", "paragraphs": paragraphs})
    return {"data": data}


def hotpot_json():
    rng = random.Random(4)
    words = ["valley", "tower", "harbor", "king", "song", "lamp", "field", "road"]
    return [{"question": f"Which {i}?", "answer": f"ans{i}",
             "context": [[f"T{i}-{j}", [" ".join(rng.choice(words) for _ in range(12)) + ".", f" Fact {i}{j}."]]
                         for j in range(4)]} for i in range(8)]


@pytest.mark.parametrize(("name", "make"), [("qa_1", squad_json), ("qa_2", hotpot_json)])
@pytest.mark.parametrize("seed", [42, 7, 1234])
def test_qa_equals_rulers(tmp_path, name, make, seed):
    tok = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    path = tmp_path / "data.json"
    raw = make()
    path.write_text(json.dumps(raw))
    qas, docs = (ruler_read_squad if name == "qa_1" else ruler_read_hotpotqa)(raw)
    cls = get_task(name)
    for length in (1024, 1536, 2048):  # lengths where RULER's loop ends (at 512 it never would for qa_1)
        want = ruler_generate(qas, docs, tok, length, 2, seed)
        t = cls(cls.Options(num_samples=2, seed=seed, dataset_path=str(path), cache=False), tokenizer=tok,
                train_length=128)
        got = [e.sample.to_json() for e in t.examples(length)]
        assert got == [{k: (list(v) if k == "outputs" else v) for k, v in w.items()} for w in want], (name, length)
    if name == "qa_1":  # ten SQuAD paragraphs (RULER's smallest step) take ~700 tokens: refused, where RULER hangs
        with pytest.raises(PromptError, match=r"^qa_1 at 512 tokens: no example fits"):
            cls(cls.Options(num_samples=1, dataset_path=str(path), cache=False), tokenizer=tok,
                train_length=128).examples(512)


def test_hub_rows_rebuild_rulers_json():
    raw = squad_json()
    rows = [{"title": d["title"], "context": p["context"], "question": q["question"],
             "answers": {"text": [a["text"] for a in q["answers"]], "answer_start": [0] * len(q["answers"])}}
            for d in raw["data"] for p in d["paragraphs"] for q in p["qas"]]
    assert read_squad(squad_from_rows(rows)) == ruler_read_squad(raw)
    hot = hotpot_json()
    hrows = [{"question": d["question"], "answer": d["answer"],
              "context": {"title": [t for t, _ in d["context"]], "sentences": [s for _, s in d["context"]]}}
             for d in hot]
    assert read_hotpotqa(hotpot_from_rows(hrows)) == ruler_read_hotpotqa(hot)


def test_offline_without_data_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"^config: qa_2: hotpotqa/hotpot_qa is read through datasets, but this "
                                          r"session is offline"):
        build_config({"task": "qa_2", "lengths": [1024], "strategies": ["vanilla"]})
    with pytest.raises(ConfigError, match=r"ruler.tasks.qa_1: rajpurkar/squad_v2 is read through datasets"):
        build_config({"task": "ruler", "lengths": [1024], "strategies": ["vanilla"], "ruler": {"tasks": ["qa_1"]}})
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("qa_1", "{not json", r"qa_1: dataset_path .*data.json: not JSON \(Expecting property name enclosed in double "
                          r"quotes at line 1, column 2\); give SQuAD v2's dev-v2.0.json as RULER downloads it"),
    ("qa_1", b"\xff\xfe{}", r"qa_1: dataset_path .*data.json: not a UTF-8 text file"),
    ("qa_1", "[]", r"qa_1: dataset_path .*: not SQuAD v2's dev-v2.0.json as RULER reads it \(the top level: expected "
                   r"a JSON object, got list\)"),
    ("qa_2", json.dumps(squad_json()), r"qa_2: dataset_path .*: not HotpotQA's hotpot_dev_distractor_v1.json as "
                                       r"RULER reads it \(the top level: expected a JSON list, got dict\)"),
    ("qa_1", json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": []}]}]}]}),
     r"\(data.0.paragraphs.0.qas.0.is_impossible: Field required\)"),
    ("qa_1", json.dumps({"data": []}), r"^qa_1: .*data.json has 0 answerable questions, fewer than the 3 asked "
                                       r"\(pre_samples 2 \+ num_samples 1\)$"),
], ids=["not_json", "not_utf8", "a_list", "squad_for_hotpot", "a_key_missing", "too_few"])
def test_a_dataset_path_that_is_not_rulers_json_is_one_line(tmp_path, name, content, message):
    """A JSONDecodeError, a TypeError or an IndexError from RULER's readers before: one DataError line."""
    path = tmp_path / "data.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    cls = get_task(name)
    task = cls(cls.Options(num_samples=1, pre_samples=2, dataset_path=str(path), cache=False),
               tokenizer=AutoTokenizer.from_pretrained(str(REFERENCE_MODEL)), train_length=128)
    with pytest.raises(DataError, match=message) as e:
        task.examples(1024)
    assert "\n" not in str(e.value)

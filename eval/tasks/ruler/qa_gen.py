"""RULER's QA generator (NVIDIA/RULER ``c3f5e3b4``, ``scripts/data/synthetic/qa.py``), draw for draw:
a question of SQuAD v2 dev (``qa_1``) or HotpotQA dev distractor (``qa_2``) with its gold paragraphs
among as many other paragraphs as fit ("Document i:\\n…"), shuffled; metric ``string_match_part``.

RULER reads the data sets' raw JSON (``dev-v2.0.json``, ``hotpot_dev_distractor_v1.json``);
``read_squad``/``read_hotpotqa`` take that JSON, ``squad_from_rows``/``hotpot_from_rows`` rebuild it
from the ``datasets`` rows of ``rajpurkar/squad_v2`` / ``hotpotqa/hotpot_qa`` (same articles,
paragraphs and questions in the same order).
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable, Iterable

from .spec import FAMILIES, RulerSample, binary_search, fitting, shrink_until_fits, split_answer_prefix
from .text import Draws

__all__ = ["DOCUMENT_PROMPT", "generate_qa", "hotpot_from_rows", "read_hotpotqa", "read_squad", "squad_from_rows"]

DOCUMENT_PROMPT = "Document {i}:\n{document}"


def read_squad(data: dict) -> tuple[list[dict], list[str]]:
    """qa.py ``read_squad`` on SQuAD v2's JSON: (answerable questions, sorted distinct paragraphs)."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for q in p["qas"]:
                if not q["is_impossible"]:
                    qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                "context": [index[p["context"]]],
                                "more_context": [i for i in more if i != index[p["context"]]]})
    return qas, docs


def read_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """qa.py ``read_hotpotqa`` on HotpotQA's dev JSON."""
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return qas, docs


def squad_from_rows(rows: Iterable[dict]) -> dict:
    """SQuAD v2's JSON from ``rajpurkar/squad_v2`` rows (title, context, question, answers)."""
    articles: dict[str, dict[str, list]] = {}
    for r in rows:
        paragraphs = articles.setdefault(r["title"], {})
        paragraphs.setdefault(r["context"], []).append(
            {"question": r["question"], "answers": [{"text": t} for t in r["answers"]["text"]],
             "is_impossible": not r["answers"]["text"]})
    return {"data": [{"title": t, "paragraphs": [{"context": c, "qas": q} for c, q in ps.items()]}
                     for t, ps in articles.items()]}


def hotpot_from_rows(rows: Iterable[dict]) -> list:
    """HotpotQA's dev JSON from ``hotpotqa/hotpot_qa`` (distractor) rows."""
    return [{"question": r["question"], "answer": r["answer"],
             "context": [[t, list(s)] for t, s in zip(r["context"]["title"], r["context"]["sentences"])]}
            for r in rows]


def generate_qa(qas: list[dict], docs: list[str], *, count: Callable[[str], int], template: str,
                max_seq_length: int, num_samples: int, seed: int, tokens_to_generate: int = 32,
                pre_samples: int = 0, what: str = "qa", max_draws: int | None = None) -> list[RulerSample]:
    """``qa.py``'s samples over ``read_squad``/``read_hotpotqa``'s output."""
    d = Draws(seed)

    @functools.cache
    def doc_tokens(i: int) -> int:
        return count(docs[i])

    def shortest(pool: list[int], k: int) -> list[int]:  # the k paragraphs of fewest tokens: nothing drawn
        if not 0 <= k <= len(pool):
            raise ValueError(f"{k} paragraphs to choose from {len(pool)}")
        return heapq.nsmallest(k, pool, key=doc_tokens)

    def input_output(index: int, num_docs: int, pick: Callable = d.py.sample) -> tuple[str, list[str]]:
        q = qas[index]
        curr_docs, curr_more = q["context"], q.get("more_context", [])
        if num_docs < len(docs):
            if (num_docs - len(curr_docs)) > len(curr_more):
                addition = [i for i, _ in enumerate(docs) if i not in curr_docs + curr_more]
                chosen = curr_docs + curr_more + pick(addition, max(0, num_docs - len(curr_docs) - len(curr_more)))
            else:
                chosen = curr_docs + pick(curr_more, num_docs - len(curr_docs))
            all_docs = [docs[i] for i in chosen]
        else:
            repeats = (num_docs + len(docs) - 1) // len(docs)
            all_docs = (docs * repeats)[:num_docs]
        random.Random(seed).shuffle(all_docs)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=x) for i, x in enumerate(all_docs))
        return template.format(context=context, query=q["query"]), q["outputs"]

    incremental = 10
    sample_text, _ = input_output(0, incremental)
    per_doc = count(sample_text) / incremental
    estimated = int((max_seq_length / per_doc) * 3)
    found = binary_search(lambda n: count(input_output(0, n)[0]) + tokens_to_generate, incremental,
                          max(estimated, incremental * 2), max_seq_length)
    num_docs = found if found is not None else incremental

    family = FAMILIES["qa"]
    out = []
    for index in range(num_samples):
        attempt = fitting(lambda size, index=index: input_output(index + pre_samples, size), count,
                          tokens_to_generate, max_seq_length)

        def floor(size: int, index=index) -> int:  # the question's own paragraphs and the shortest others
            return count(input_output(index + pre_samples, size, pick=shortest)[0]) + tokens_to_generate

        text, answer, length = shrink_until_fits(attempt, num_docs, incremental, what=f"{what} at {max_seq_length} "
                                                 "tokens", floor=floor, max_draws=max_draws)
        prompt, prefix = split_answer_prefix(family, text)
        out.append(RulerSample(index, prompt, tuple(answer), length, prefix))
    return out

"""The Pareto front of a search with two objectives (perplexity term, passkey answer NLL):
``pareto_front`` against a naive O(n²) dominance check on random point sets with ties and
duplicates, and a search with the retrieval term on the bundled model writes ``pareto.png``."""

from __future__ import annotations

import random

import pytest

from eval.search.report import pareto_front


def naive_front(points) -> set[int]:
    """Every index no other point dominates (≤ in both, < in one), by comparing all pairs."""
    def dominates(p, q):
        return p[0] <= q[0] and p[1] <= q[1] and (p[0] < q[0] or p[1] < q[1])

    return {i for i, q in enumerate(points) if not any(dominates(p, q) for j, p in enumerate(points) if j != i)}


@pytest.mark.parametrize("seed", range(200))
def test_front_matches_the_naive_dominance_check(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 40)
    if seed % 2:  # a coarse grid: many ties in one objective or both, and exact duplicates
        points = [(rng.randint(0, 5), rng.randint(0, 5)) for _ in range(n)]
    else:
        points = [(rng.random(), rng.random()) for _ in range(n)]
        points += [points[rng.randrange(n)] for _ in range(rng.randint(0, 5))] if n else []
    front = pareto_front(points)
    assert len(front) == len(set(front))
    assert set(front) == naive_front(points)
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)  # ordered along the front


def test_small_cases():
    assert pareto_front([]) == []
    assert pareto_front([(1, 1)]) == [0]
    assert pareto_front([(1, 1), (1, 1)]) == [0, 1]  # duplicates do not dominate each other
    assert pareto_front([(1, 2), (1, 1), (2, 1)]) == [1]  # ties in one objective are dominated
    assert pareto_front([(3, 0), (0, 3), (1, 1), (2, 2)]) == [1, 2, 0]


@pytest.mark.slow
def test_a_search_with_the_retrieval_term_writes_pareto_png(tmp_path):
    from eval.search.config import build_search_config
    from eval.search.run import run_search

    raw = {"model": "reference", "strategy": "yarn", "fixed": {"factor": 4}, "lengths": [512],
           "search": {"beta_fast": [4, 64], "beta_slow": [0.25, 2], "attention_factor": [0.9, 1.4]},
           "budget": 2, "max_windows": 2, "retrieval_weight": 1, "retrieval_trials": 2, "seed": 0}
    run_search(build_search_config(raw), tmp_path / "s", progress=False)
    png = tmp_path / "s" / "pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Pareto front" in (tmp_path / "s" / "results.md").read_text(encoding="utf-8")
    run_search(build_search_config({**raw, "retrieval_weight": 0}), tmp_path / "p", progress=False)
    assert not (tmp_path / "p" / "pareto.png").exists()  # one objective: no front to draw

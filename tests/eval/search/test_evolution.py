"""LongRoPE's evolutionary search (eval/search/evolution.py) against the authors' rules.

The rules are written out naively here from microsoft/LongRoPE c9e56aa (evolution/algorithms/
dim_mono.py, dim_piece_mono.py, genetic_base.py, default_hyper_params/*.json). Synthetic
objectives only: no model.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eval.search import evolution as evo
from eval.search.evolution import DEFAULTS, START_TOKEN_GRID, run_evolution, yarn_init_factors
from ropescale.errors import InvalidInput

STEP = 0.01


def _layout(n, scale, piece=False, start=False, grid=()):
    return evo._Layout(n=n, scale=scale, step=STEP, piece=piece, start=start, start_grid=grid)


def _monotone(f) -> bool:
    return all(b >= a for a, b in zip(f, f[1:]))


def _on_step_grid(value: float, origin: float) -> bool:
    k = (value - origin) / STEP
    return k > -1e-6 and abs(k - round(k)) < 1e-6


def _sq(target):
    target = np.asarray(target, dtype=float)
    return lambda f, s: float(np.sum((np.asarray(f) - target) ** 2))


# ---------------------------------------------------------------- defaults


def test_defaults_are_the_authors_and_give_1344_evaluations():
    # default_hyper_params/dim_mono.json == dim_piece_mono.json at c9e56aa; 0.3 / 0.5 hard-coded
    assert DEFAULTS["population"] == 64 and DEFAULTS["iterations"] == 40 and DEFAULTS["elite"] == 32
    assert DEFAULTS["max_crossover_try"] == 20 and DEFAULTS["list_step"] == 0.01
    assert DEFAULTS["mutation_prob"] == 0.3 and DEFAULTS["crossover_prob"] == 0.3
    r = run_evolution(_sq(np.linspace(1, 4, 8)), dim=16, scale=4.0, yarn_factors=[1.0] * 4 + [4.0] * 4)
    assert r.evaluations == 64 + 40 * 32 == 1344 and r.stop == "iterations"
    gens = [h["generation"] for h in r.history]
    assert gens.count(0) == 64 and all(gens.count(g) == 32 for g in range(1, 41))
    # 16 mutations then 16 crossovers (or mutants where a crossover fails) per generation
    assert all(h["origin"] == "mutation" for h in [h for h in r.history if h["generation"] == 1][:16])


# ---------------------------------------------------------------- mutation


def _naive_check_pass(before, after, touched, lay):
    """Their dim_mono rule per touched pair, neighbours read left to right as changed so far."""
    n = lay.n
    top = float(np.arange(1.0, 1.0 + lay.scale + STEP, STEP).max())
    cur = list(before)
    for k in range(n):
        if not touched[k]:
            assert after[k] == before[k], f"untouched pair {k} changed"
            continue
        v = after[k]
        if k == 0:
            ok = (_on_step_grid(v, 1.0) and v < cur[1]) or (v == before[0] and not cur[1] > 1.0)
        elif k == n - 1:
            ok = _on_step_grid(v, cur[n - 2]) and v < top + STEP
        else:
            ok = _on_step_grid(v, cur[k - 1]) and v < cur[k + 1] + STEP
        assert ok, f"pair {k}: {v} off the grid/bounds from {before}"
        cur[k] = v


def test_mutation_pass_follows_their_grid_and_touch_rate():
    n, scale = 16, 8.0
    lay = _layout(n, scale)
    rng = np.random.default_rng(1)
    base = np.linspace(1.0, 8.0, n)  # wide gaps: a touched pair almost always moves
    draws, touched_total, changed_total = 2000, 0, 0
    for _ in range(draws):
        after, touched = evo._mutation_pass(base, rng, lay, 0.3)
        _naive_check_pass(base, after, touched, lay)
        touched_total += int(touched.sum())
        changed_total += int((after != base).sum())
    trials = draws * n
    rate = touched_total / trials
    sd = math.sqrt(0.3 * 0.7 / trials)
    assert abs(rate - 0.3) < 5 * sd, (rate, sd)  # 5 σ: a wrong rule (0.25, 0.35) is far outside
    assert changed_total <= touched_total and changed_total > 0.95 * touched_total


@pytest.mark.parametrize("p", [0.0, 0.1, 0.75, 1.0])
def test_mutation_touch_rate_is_the_configured_probability(p):
    n = 8
    lay = _layout(n, 4.0)
    rng = np.random.default_rng(7)
    base = np.linspace(1.0, 4.0, n)
    counts = np.zeros(n)
    draws = 1500
    for _ in range(draws):
        counts += evo._mutation_pass(base, rng, lay, p)[1]
    sd = math.sqrt(max(p * (1 - p), 1e-12) / draws)
    assert np.all(np.abs(counts / draws - p) <= 5 * sd + 1e-12), counts / draws


def test_every_candidate_is_monotone_new_and_within_bounds():
    scale = 4.0
    r = run_evolution(_sq([1, 1, 1.2, 1.5, 2, 2.6, 3.3, 4]), dim=16, scale=scale,
                      yarn_factors=[1, 1, 1, 1.5, 2.5, 4, 4, 4], population=16, elite=8, iterations=10, seed=3)
    top = float(np.arange(1.0, 1.0 + scale + STEP, STEP).max())
    rows = [tuple(h["factors"]) for h in r.history]
    for f in rows:
        assert _monotone(f) and min(f) >= 1.0 and max(f) < top + STEP
    arr = np.array(rows)
    for i in range(len(arr)):  # numpy.allclose novelty, as their Individual.__eq__
        assert not np.isclose(arr[:i], arr[i]).all(axis=1).any(), f"candidate {i} repeats an earlier one"


def test_piece_mono_pass_pins_the_ends_and_keeps_alpha_below_beta():
    n, scale = 12, 6.0
    lay = _layout(n, scale, piece=True)
    rng = np.random.default_rng(5)
    genome = np.concatenate([[3.0, 8.0], np.linspace(1.0, 6.0, n)])
    for _ in range(500):
        after, touched = evo._mutation_pass(genome, rng, lay, 0.3)
        alpha, beta = after[0], after[1]
        assert 0 <= alpha < beta < n and alpha == int(alpha) and beta == int(beta)
        f0, f1 = genome[2:], after[2:]
        for k in range(n):
            if not touched[k]:
                assert f1[k] == f0[k]
            elif k <= alpha:
                assert f1[k] == 1.0
            elif k > beta:
                assert f1[k] == scale


# ---------------------------------------------------------------- crossover


def _random_monotone(rng, n, scale):
    return np.sort(np.round(rng.uniform(1.0, scale, n), 2))


def test_crossover_children_take_each_gene_from_a_parent_and_stay_monotone():
    n, scale = 10, 4.0
    lay = _layout(n, scale)
    rng = np.random.default_rng(11)
    made = evo._Made(n)
    children = 0
    for _ in range(300):
        p1, p2 = _random_monotone(rng, n, scale), _random_monotone(rng, n, scale)
        made.append(p1)
        made.append(p2)
        child = evo._crossover(p1, p2, rng, lay, 0.3, 20, made.seen)
        if child is None:
            continue
        children += 1
        assert all(c in (a, b) for c, a, b in zip(child, p1, p2)), (child, p1, p2)
        assert _monotone(list(child)) and not made.seen(child)
        made.append(child)
    assert children > 100
    same = _random_monotone(rng, n, scale)
    assert evo._crossover(same, same.copy(), rng, lay, 0.3, 20, made.seen) is None  # identical parents


def test_piece_crossover_moves_alpha_and_beta_together():
    n = 8
    lay = _layout(n, 4.0, piece=True)
    rng = np.random.default_rng(2)
    made = evo._Made(n + 2)
    for _ in range(200):
        p1 = np.concatenate([[1.0, 5.0], _random_monotone(rng, n, 4.0)])
        p2 = np.concatenate([[2.0, 6.0], _random_monotone(rng, n, 4.0)])
        child = evo._crossover(p1, p2, rng, lay, 0.3, 20, made.seen)
        if child is not None:
            assert tuple(child[:2]) in {(1.0, 5.0), (2.0, 6.0)}
            assert all(c in (a, b) for c, a, b in zip(child[2:], p1[2:], p2[2:]))
            made.append(child)


# ---------------------------------------------------------------- the loop, from the history


def test_children_come_from_the_elite_of_the_previous_population():
    """Rebuild populations naively (stable sort, keep ``elite``, add the children) and check each
    child's parents are in the elite, crossover genes come from its parents, and the result is the
    best ever evaluated."""
    pop, elite = 12, 5
    r = run_evolution(_sq([1, 1.1, 1.3, 2, 2.5, 3, 3.5, 4]), dim=16, scale=4.0,
                      yarn_factors=[1, 1, 1, 2, 3, 4, 4, 4], population=pop, elite=elite, iterations=8, seed=4)
    h = r.history
    population = [i for i, x in enumerate(h) if x["generation"] == 0]
    assert len(population) == pop and h[0]["origin"] == "init"
    assert all(x["parents"] == [0] for x in h[1:pop])  # initial mutants are mutants of the YaRN individual
    for g in range(1, 9):
        kept = sorted(population, key=lambda i: h[i]["value"])[:elite]
        kids = [i for i, x in enumerate(h) if x["generation"] == g]
        assert len(kids) == pop - elite
        for i in kids:
            assert set(h[i]["parents"]) <= set(kept)
            if h[i]["origin"] == "crossover":
                a, b = (h[j]["factors"] for j in h[i]["parents"])
                assert all(c in (x, y) for c, x, y in zip(h[i]["factors"], a, b))
                assert kept.index(h[i]["parents"][0]) < kept.index(h[i]["parents"][1])  # better parent first
        # the elite survives: the best so far is in the next population
        best_so_far = min(range(kids[-1] + 1), key=lambda i: h[i]["value"])
        population = kept + kids
        assert best_so_far in population
    best = min(h, key=lambda x: x["value"])
    assert r.value == best["value"] and r.factors == best["factors"]


def test_synthetic_optimum_is_found_in_a_small_budget():
    target = np.array([1.0, 1.0, 1.2, 1.5, 2.0, 2.6, 3.3, 4.0])  # monotone, on the 0.01 grid
    init = [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0]
    obj = _sq(target)
    for seed in (0, 1):
        r = run_evolution(obj, dim=16, scale=4.0, yarn_factors=init, population=16, elite=8, iterations=30,
                          seed=seed)
        assert r.evaluations == 16 + 30 * 8
        assert r.value < 0.01 * obj(init, 0)
        assert np.abs(np.asarray(r.factors) - target).max() < 0.15


def test_budget_caps_the_evaluations():
    calls = []
    r = run_evolution(lambda f, s: calls.append(1) or sum(f), dim=8, scale=2.0, population=8, elite=4,
                      iterations=10, budget=21)
    assert r.evaluations == 21 == len(calls) and r.stop == "budget"


def test_a_search_that_cannot_make_a_new_candidate_stops():
    r = run_evolution(lambda f, s: sum(f), dim=8, scale=2.0, population=8, elite=4, mutation_prob=0.0)
    assert r.stop == "exhausted" and r.evaluations == 1 and r.factors == [2.0] * 4


def test_start_tokens_gene_is_searched_on_their_grid_and_zero_otherwise():
    seen = set()

    def obj(f, s):
        seen.add(s)
        return float(np.sum((np.asarray(f) - 2.0) ** 2)) + abs(s - 8) * 0.1

    r = run_evolution(obj, dim=8, scale=3.0, population=16, elite=8, iterations=10,
                      search_start_tokens=True, max_start_tokens=20)
    assert seen <= {0, *[g for g in START_TOKEN_GRID if g <= 20]} and len(seen) > 3
    assert r.start_tokens == 8
    seen.clear()
    run_evolution(obj, dim=8, scale=3.0, population=6, elite=3, iterations=2)
    assert seen == {0}


def test_yarn_init_factors_are_their_linear_blend():
    f = yarn_init_factors(128, 10000.0, 4096, 8.0)
    assert len(f) == 64 and f[0] == 1.0 and abs(f[-1] - 8.0) < 1e-6 and _monotone(f)
    assert any(1.0 < x < 8.0 for x in f)
    assert yarn_init_factors(16, 10000.0, 4096, 1.0) == [1.0] * 8


def _naive_yarn_init(dim: int, base: float, train: int, s: float, beta_fast: float = 32.0,
                     beta_slow: float = 1.0) -> list[float]:
    """jquesnelle/yarn's ramp written out in Python floats (float64), pair by pair, and LongRoPE's
    ``search.py`` blend s·(1 − mask) + 1·mask with mask = 1 − ramp."""
    def correction_dim(rotations):
        return dim * math.log(train / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        mask = 1.0 - ramp
        out.append(s * (1.0 - mask) + 1.0 * mask)
    return out


def test_yarn_init_factors_by_hand_for_llama2():
    # Llama-2 (d 128, b 1e4, T 4096): low 20, high 46 (peers' notes); s = 8: 1 + 7·(i − 20)/26 between
    f = yarn_init_factors(128, 10000.0, 4096, 8.0)
    assert f[:21] == [1.0] * 21 and f[46:] == [8.0] * 18
    for i in range(21, 46):
        assert f[i] == pytest.approx(1 + 7 * (i - 20) / 26, rel=1e-15, abs=0)


@pytest.mark.parametrize(("dim", "base", "train", "s", "betas"), [
    (128, 10000.0, 4096, 8.0, (32.0, 1.0)),  # Llama-2
    (128, 10000.0, 4096, 2.5, (32.0, 1.0)),
    (32, 10000.0, 128, 8.0, (32.0, 1.0)),  # the bundled model at 8T
    (128, 500000.0, 8192, 16.0, (32.0, 1.0)),  # Llama-3's base
    (128, 1000000.0, 32768, 4.0, (128.0, 2.0)),  # Mistral's betas in LongRoPE's search.py
    (64, 10000.0, 2048, 3.0, (16.0, 8.0)),  # a narrow ramp
])
def test_yarn_init_factors_are_float64_exact(dim, base, train, s, betas):
    # on main they were read back from the float32 yarn frequencies and rounded to 6 decimals:
    # 1e-7-sized errors in the first individual of every LongRoPE search
    got = yarn_init_factors(dim, base, train, s, *betas)
    want = _naive_yarn_init(dim, base, train, s, *betas)
    assert len(got) == dim // 2
    assert got == pytest.approx(want, rel=4e-16, abs=0)


# ---------------------------------------------------------------- determinism and resume

_KW = dict(dim=16, scale=4.0, yarn_factors=[1, 1, 1, 1.5, 2.5, 4, 4, 4], population=10, elite=4, iterations=6)
_TARGET = [1, 1.05, 1.2, 1.6, 2.2, 2.9, 3.5, 4]


@pytest.mark.parametrize("variant", ["dim_mono", "dim_piece_mono"])
def test_same_seed_same_search(variant):
    a = run_evolution(_sq(_TARGET), seed=5, variant=variant, **_KW)
    b = run_evolution(_sq(_TARGET), seed=5, variant=variant, **_KW)
    c = run_evolution(_sq(_TARGET), seed=6, variant=variant, **_KW)
    assert a == b and a.history != c.history


class _Killed(Exception):
    pass


@pytest.mark.parametrize("variant,start", [("dim_mono", False), ("dim_piece_mono", True)])
def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, variant, start):
    kw = dict(_KW, variant=variant, search_start_tokens=start, max_start_tokens=16 if start else 0, seed=9)
    full = run_evolution(_sq(_TARGET), **kw)
    journal = tmp_path / "evo.jsonl"
    calls = {"n": 0}

    def dying(f, s):
        if calls["n"] == 23:
            raise _Killed
        calls["n"] += 1
        return _sq(_TARGET)(f, s)

    with pytest.raises(_Killed):
        run_evolution(dying, journal=journal, **kw)
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 23  # header + one flushed line per finished evaluation
    with journal.open("a") as fh:  # a kill in the middle of a write leaves a cut line
        fh.write('{"n": 23, "fac')
    resumed_calls = []
    resumed = run_evolution(lambda f, s: resumed_calls.append(1) or _sq(_TARGET)(f, s), journal=journal, **kw)
    assert resumed == full
    assert len(resumed_calls) == full.evaluations - 23
    again = run_evolution(lambda f, s: pytest.fail("all recorded"), journal=journal, **kw)
    assert again == full
    records = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
    assert [r["value"] for r in records] == [x["value"] for x in full.history]


def test_journal_from_other_settings_is_refused(tmp_path):
    journal = tmp_path / "evo.jsonl"
    run_evolution(_sq(_TARGET), journal=journal, seed=1, **_KW)
    with pytest.raises(InvalidInput, match="other settings"):
        run_evolution(_sq(_TARGET), journal=journal, seed=2, **_KW)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kw,match", [
    (dict(dim=15), "even"),
    (dict(dim=2), "dim"),
    (dict(scale=0.5), "scale"),
    (dict(scale=float("nan")), "scale"),
    (dict(mutation_prob=1.5), "mutation_prob"),
    (dict(crossover_prob=-0.1), "crossover_prob"),
    (dict(population=1), "population"),
    (dict(population=8, elite=8), "elite"),
    (dict(elite=0), "elite"),
    (dict(iterations=-1), "iterations"),
    (dict(variant="dim_poly"), "unknown variant"),
    (dict(budget=0), "budget"),
    (dict(yarn_factors=[1.0, 2.0]), "entries"),
    (dict(yarn_factors=[2.0, 1.0, 1.0, 1.0]), "non-decreasing"),
    (dict(yarn_factors=[1.0, 1.0, 1.0, float("inf")]), "finite"),
    (dict(search_start_tokens=True, max_start_tokens=0), "max_start_tokens"),
    (dict(seed=-1), "seed"),
])
def test_bad_arguments_get_one_line(kw, match):
    args = dict(dim=8, scale=2.0) | kw
    with pytest.raises(InvalidInput, match=match) as err:
        run_evolution(lambda f, s: 0.0, **args)
    assert "\n" not in str(err.value) and str(err.value).startswith("run_evolution: ")

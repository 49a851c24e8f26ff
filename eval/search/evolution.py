"""LongRoPE's evolutionary search for per-pair rescale factors (Ding et al. 2024, arXiv:2402.13753).

Followed: microsoft/LongRoPE ``main`` at commit c9e56aa54007c328399677232a489feec446e4b8
(2024-08-23): ``evolution/algorithms/genetic_base.py`` (the loop), ``dim_mono.py`` and
``dim_piece_mono.py`` (mutation, crossover), ``evolution/search.py`` (YaRN initial factors) and
``evolution/default_hyper_params/{dim_mono,dim_piece_mono}.json`` (identical for both variants:
``population_size`` 64, ``max_time_budget`` 40, ``mutation_numbers`` 16, ``crossover_size`` 16,
``max_crossover_try`` 20, ``parents_size`` 32, ``list_step`` 0.01, ``evo_scale`` 1.0). The leading
un-interpolated tokens gene follows the ``longrope`` branch at 5d6e10ae05607306b644211779772facfb66f9b3
(``evolution/dim_mono_n``: gene 0 of the genome is ``start_token``; grid {1, 2, 4, 8, 12, 16, 20, 24,
28, 32, 48, 64} in ``GeneticAlgorithm.try_start_token``) and ``rope/longrope.py``'s
``start_token_idx`` on ``main`` (cos/sin of the first ``start_token_idx`` positions are the
original, un-scaled ones).

The algorithm (their rules; n = d/2 pairs, s = ``scale``, step = 0.01):

* Genome: the n factors; ``dim_piece_mono`` prepends two integers α < β (pairs k ≤ α are pinned to
  1, pairs k > β to s when mutated); with ``search_start_tokens`` a start-tokens gene comes first.
  The objective receives the n factors and the start-tokens count (0 when not searched).
* Initial population: the YaRN factors (evaluated first), then ``population − 1`` mutants *of that
  initial individual* (each mutated from it, not chained).
* Generation (``iterations`` of them): parents = the ``elite`` best of the population (stable sort
  by value); ``(population − elite) // 2`` mutants of uniformly drawn parents, then the rest as
  crossovers of two distinct parents (the better one first); the next population is parents +
  children, so the elite always survives. Evaluations: population + iterations × (population −
  elite) = 64 + 40 × 32 = 1,344 with the defaults.
* Mutation pass: each factor is touched with probability ``mutation_prob`` (their hard-coded 0.3)
  and, when touched, set to a uniform draw from ``arange(left, right + step, step)`` with left/right
  its (current) neighbours; pair 0 draws from ``arange(1, f[1], step)``, the last pair from
  ``arange(f[n−2], top + step, step)`` with top = max(``arange(1, 1 + s + step, step)``) ≈ 1 + s.
  Passes repeat, on the already-changed vector, until it is monotone non-decreasing and differs
  (``numpy.allclose``) from every individual ever made.
* ``dim_piece_mono`` pass: first one of α, β (½ each) moves by ``int(normal(·, 2))``, redrawn until
  0 ≤ α < β < n; then each touched pair k gets 1 if k ≤ α, s if k > β, else the grid draw above.
* Crossover: start from parent 1; up to ``max_crossover_try`` sweeps over the genes; a gene is
  touched with probability ``crossover_prob`` (their hard-coded 0.3) and then takes parent 2's
  value with probability ½ (α and β travel together); the first touched state that is monotone (and
  α ≤ β) and new is the child. Identical parents or no success → a mutant of parent 1 instead.

Deviations (named):

1. ``yarn_factors=None`` falls back to s for every pair (position interpolation). Their
   ``search.py`` always computes YaRN's factors (β_fast 32, β_slow 1; 128 and 2 for Mistral) and has no
   such fallback; ``yarn_init_factors`` below reproduces their formula 1 + (s − 1)·ramp_i (linear in
   the factor, not YaRN's own θ_i / θ'_i, which differs mid-ramp) — pass its output.
2. ``dim_piece_mono``'s mutation touches every pair; theirs loops ``range(2, len − 2)`` over the
   genome and so never mutates the last two pairs (and its last-pair branch is unreachable).
3. The start-tokens gene is an ordinary gene here: mutated with ``mutation_prob`` to a uniform draw
   from {0} ∪ their grid ∩ [1, ``max_start_tokens``], crossed like a factor, 0 in the initial
   individual. Their ``dim_mono_n`` never mutates it and instead spends extra evaluations outside the
   1,344 (all 12 grid values for half the initial population, 5 random values per mutant) on a
   greedy local search.
4. Randomness from one ``numpy.random.Generator(seed)`` (theirs: the global ``np.random`` seeded
   42), so the same seed does not give their exact draws. The mutation/crossover probabilities and
   population/elite sizes are arguments (their 0.3 is hard-coded); mutants per generation are
   ⌊(population − elite)/2⌋ and crossovers the rest (theirs: two JSON entries, 16 and 16); with
   ``elite`` 1 all children are mutants. ``max_crossover_try`` (20) and ``list_step`` (0.01) are fixed.
5. Novelty and monotonicity tests as theirs (in ``dim_piece_mono`` novelty covers α and β too, so two
   candidates can hand the objective the same factors, as theirs can); but a mutation that finds no
   new monotone vector in ``_MAX_PASSES`` passes (a search space exhausted) stops the search early
   (theirs loops forever).
6. A value that is NaN counts as +∞ (theirs would sort NaN arbitrarily). ``budget`` stops after that
   many evaluations (theirs has no cap). The result is the best individual ever evaluated (theirs:
   the best of the final population — the same thing, since the elite always survives).
7. Resume: a JSONL journal of every evaluation, replayed in order (theirs: ``--recovery`` from the
   JSON log of the last finished generation, which restarts that generation with new draws). The
   journal's first line holds the settings (not ``budget``: a rerun with a larger budget goes on where
   a capped run stopped). One process writes it; candidates are evaluated one at a time (theirs: a
   batch per free GPU evaluator, which does not change the draws).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ropescale.errors import InvalidInput

__all__ = ["DEFAULTS", "START_TOKEN_GRID", "VARIANTS", "EvolutionResult", "check_options", "run_evolution",
           "split_over_processes", "yarn_init_factors", "yarn_ramp64"]

DEFAULTS: dict[str, Any] = {
    "population": 64,  # population_size
    "iterations": 40,  # max_time_budget
    "elite": 32,  # parents_size
    "mutation_prob": 0.3,  # hard-coded in dim_mono.py / dim_piece_mono.py
    "crossover_prob": 0.3,  # hard-coded in crossover()
    "crossover_take": 0.5,  # hard-coded: a touched gene takes parent 2's value
    "max_crossover_try": 20,
    "list_step": 0.01,
    "piece_std": 2.0,  # dim_piece_mono: std of α/β moves
}
"""The authors' defaults (``default_hyper_params/*.json`` and the constants in their code)."""

VARIANTS = ("dim_mono", "dim_piece_mono")
START_TOKEN_GRID = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64)
"""``try_start_token``'s candidate counts of leading un-interpolated tokens (``longrope`` branch)."""

_MAX_PASSES = 10_000
_JOURNAL_VERSION = 1


@dataclass
class EvolutionResult:
    """The best candidate found and the full trace.

    ``factors``: d/2 per-pair rescale factors (``longrope``'s ``long_factor``); ``start_tokens``: the
    leading un-interpolated tokens (0 unless searched); ``value``: its objective value;
    ``history``: one dict per evaluation (``generation`` — 0 for the initial population —,
    ``origin`` — ``"init"``, ``"mutation"`` or ``"crossover"`` —, ``parents`` — their indices in
    ``history`` —, ``factors``, ``start_tokens``, ``value``), in evaluation order; ``evaluations``: their count;
    ``stop``: ``"iterations"``, ``"budget"`` or ``"exhausted"`` (no new monotone vector found).
    """

    factors: list[float]
    start_tokens: int
    value: float
    history: list[dict] = field(default_factory=list)
    evaluations: int = 0
    stop: str = "iterations"


def yarn_ramp64(dim: int, rope_theta: float, original_max_position_embeddings: int, beta_fast: float = 32.0,
                beta_slow: float = 1.0) -> np.ndarray:
    """YaRN's interpolation ramp per rotary pair, in float64: ``[d/2]``, 0 = extrapolated (fast
    pairs), 1 = interpolated (slow pairs).

    jquesnelle/yarn ``find_correction_range`` / ``linear_ramp_mask``: the correction dim for r
    rotations in the training window is fcd(r) = d·ln(L/(2π·r)) / (2·ln b); low = ⌊fcd(β_fast)⌋,
    high = ⌈fcd(β_slow)⌉, both clamped to [0, d − 1] (high = low + 0.001 when equal); ramp_i =
    clamp((i − low) / (high − low), 0, 1) for pairs i = 0 … d/2 − 1 (d: rotary dim, b: rope_theta,
    L: original_max_position_embeddings [tokens])."""
    def fcd(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low = max(math.floor(fcd(beta_fast)), 0)
    high = min(math.ceil(fcd(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # their guard against a zero-width ramp
    return np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def yarn_init_factors(dim: int, rope_theta: float, original_max_position_embeddings: int, scale: float,
                      beta_fast: float = 32.0, beta_slow: float = 1.0) -> list[float]:
    """Their initial factors, per rotary pair: 1 + (s − 1)·ramp_i (``[d/2]``), ramp_i YaRN's
    interpolation ramp (``yarn_ramp64``, float64; 0 = extrapolate), s = ``scale``.

    ``search.py`` builds ``inv_freq_mask = 1 − ramp`` and takes s·(1 − mask) + 1·mask, in float64
    here (the initial individual is the search's first candidate, and every value of the grid the
    operators draw from is a multiple of 0.01 away from 1: float32 noise would shift it)."""
    if scale <= 1:
        return [1.0] * (dim // 2)
    ramp = yarn_ramp64(dim, rope_theta, original_max_position_embeddings, beta_fast, beta_slow)
    return (1.0 + (scale - 1.0) * ramp).tolist()


# ---------------------------------------------------------------- operators (pure, rng passed in)

@dataclass(frozen=True)
class _Layout:
    """Where the genes sit in the flat genome: [start?] [α, β]? [factors]."""

    n: int
    scale: float
    step: float
    piece: bool
    start: bool
    start_grid: tuple[int, ...]

    @property
    def f0(self) -> int:
        return int(self.start) + 2 * int(self.piece)

    @property
    def top(self) -> float:
        return float(np.arange(1.0, 1.0 + self.scale + self.step, self.step).max())

    def factors(self, genome: np.ndarray) -> np.ndarray:
        return genome[self.f0:]

    def start_tokens(self, genome: np.ndarray) -> int:
        return int(genome[0]) if self.start else 0

    def valid(self, genome: np.ndarray) -> bool:
        if self.piece and genome[int(self.start)] > genome[int(self.start) + 1]:
            return False
        return bool(np.all(np.diff(self.factors(genome)) >= 0))


def _pair_choices(f: np.ndarray, k: int, lay: _Layout) -> np.ndarray:
    """Their grid for pair k given its current neighbours."""
    n, step = f.shape[0], lay.step
    if k == 0:
        return np.arange(1.0, f[1], step)
    if k == n - 1:
        return np.arange(f[n - 2], lay.top + step, step)
    return np.arange(f[k - 1], f[k + 1] + step, step)


def _mutation_pass(genome: np.ndarray, rng: np.random.Generator, lay: _Layout,
                   prob: float) -> tuple[np.ndarray, np.ndarray]:
    """One sweep: a copy of ``genome`` and the mask of the factors it touched (drew < ``prob``)."""
    g = genome.copy()
    if lay.start and rng.random() < prob:
        grid = (0, *lay.start_grid)
        g[0] = grid[int(rng.integers(len(grid)))]
    if lay.piece:
        a_i = int(lay.start)
        alpha, beta = g[a_i], g[a_i + 1]
        if rng.random() < 0.5:
            alpha = int(rng.normal(alpha, DEFAULTS["piece_std"]))
        else:
            beta = int(rng.normal(beta, DEFAULTS["piece_std"]))
        while not (0 <= alpha < beta < lay.n):
            if rng.random() < 0.5:
                alpha = int(rng.normal(alpha, DEFAULTS["piece_std"]))
            else:
                beta = int(rng.normal(beta, DEFAULTS["piece_std"]))
        g[a_i], g[a_i + 1] = alpha, beta
    f = g[lay.f0:]  # a view: changes land in g, and neighbours read the changed values
    touched = np.zeros(lay.n, dtype=bool)
    for k in range(lay.n):
        if rng.random() < prob:
            touched[k] = True
            if lay.piece and k <= g[int(lay.start)]:
                f[k] = 1.0
            elif lay.piece and k > g[int(lay.start) + 1]:
                f[k] = lay.scale
            else:
                choices = _pair_choices(f, k, lay)
                if choices.shape[0] > 0:
                    f[k] = choices[int(rng.integers(choices.shape[0]))]
    return g, touched


def _crossover(p1: np.ndarray, p2: np.ndarray, rng: np.random.Generator, lay: _Layout, prob: float,
               tries: int, seen: Callable[[np.ndarray], bool]) -> np.ndarray | None:
    """Their crossover: parent 1 with touched genes taken from parent 2 (½), first valid new state."""
    if np.allclose(p1, p2):
        return None
    g = p1.copy()
    piece_at = int(lay.start) if lay.piece else -1
    for _ in range(tries):
        for i in range(g.shape[0]):
            if rng.random() < prob:
                g = g.copy()
                if rng.random() < DEFAULTS["crossover_take"]:
                    if piece_at >= 0 and i in (piece_at, piece_at + 1):  # α and β travel together
                        g[piece_at:piece_at + 2] = p2[piece_at:piece_at + 2]
                    else:
                        g[i] = p2[i]
                if seen(g) or not lay.valid(g):
                    continue
                return g
    return None


# ---------------------------------------------------------------- the search

class _Made:
    """Every genome created so far, for their novelty test (``numpy.allclose`` against each)."""

    def __init__(self, width: int):
        self.rows, self.buf = 0, np.empty((256, width))

    def append(self, g: np.ndarray) -> None:
        if self.rows == self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.empty_like(self.buf)])
        self.buf[self.rows] = g
        self.rows += 1

    def seen(self, g: np.ndarray) -> bool:
        return bool(np.isclose(self.buf[:self.rows], g).all(axis=1).any())


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _fail(msg: str) -> None:
    raise InvalidInput(f"run_evolution: {msg}")


def _check_prob(name: str, p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        _fail(f"{name}={p!r} must be a probability in [0, 1]")
    return float(p)


def _check_int(name: str, v: Any, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        _fail(f"{name}={v!r} must be an integer ≥ {low}")
    return int(v)


class _Journal:
    """Append-only JSONL: a header line (the settings), then one line per evaluation."""

    def __init__(self, path: Path | None, header: dict, write: bool = True):
        self.path, self.records = path, []
        if path is None:
            return
        path = Path(path)
        self.path = path
        if not write:  # another process of a parallel search writes it: read what is there, never write
            self.path = None
            if path.exists():
                parsed = []
                for line in path.read_text().split("\n")[:-1]:
                    try:
                        parsed.append(json.loads(line))
                    except json.JSONDecodeError:
                        break
                if parsed and parsed[0] != header:
                    _fail(f"journal {path} was written by a search with other settings; "
                          "use a new journal or the same seed and arguments")
                self.records = parsed[1:]
            return
        if path.exists():
            text = path.read_text()
            parsed = []
            for line in text.split("\n")[:-1]:  # the part after the last newline is cut or empty
                try:
                    parsed.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a kill: drop it and what follows
            if parsed:
                if parsed[0] != header:
                    _fail(f"journal {path} was written by a search with other settings; "
                          "use a new journal or the same seed and arguments")
                self.records = parsed[1:]
            keep = "".join(json.dumps(r) + "\n" for r in parsed) if parsed else ""
            if keep != text:
                path.write_text(keep)
            if parsed:
                self._fh = path.open("a")
                return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("w")
        self._write(header)

    def _write(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()

    def append(self, rec: dict) -> None:
        if self.path is not None:
            self._write(rec)

    def close(self) -> None:
        if self.path is not None:
            self._fh.close()


def split_over_processes(objective: Callable[[list[float], int], float], state=None):
    """An ``evaluate_batch`` for ``run_evolution`` under ``accelerate launch``: candidate k of a
    generation is scored by process k mod P, and every process gets all values in order
    (``gather_object``). ``state``: accelerate's ``PartialState`` (made here when None)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = state if state is not None else PartialState()

    def evaluate_batch(cands: list[tuple[list[float], int]]) -> list[float]:
        mine = [(k, float(objective(list(f), s))) for k, (f, s) in enumerate(cands)
                if k % state.num_processes == state.process_index]
        values = dict(gather_object(mine) if state.num_processes > 1 else mine)
        return [values[k] for k in range(len(cands))]

    return evaluate_batch


def check_options(*, population: int | None = None, iterations: int | None = None, elite: int | None = None,
                  mutation_prob: float | None = None, crossover_prob: float | None = None, variant: str = "dim_mono",
                  seed: int = 0, budget: int | None = None, search_start_tokens: bool = False,
                  max_start_tokens: int | None = 0) -> dict[str, Any]:
    """``run_evolution``'s hyper-parameters checked (no model needed: a search config checks them
    before it claims its folder) and resolved: ``population``, ``iterations``, ``elite``,
    ``mutation_prob``, ``crossover_prob`` (None → ``DEFAULTS``), ``variant``, ``seed``, ``budget``
    and ``start_grid`` (the start-tokens values searched; empty unless ``search_start_tokens``).
    Raises ``InvalidInput`` (one line) naming the first bad one: a bool or a float where a whole
    number is needed, a probability outside [0, 1] (or NaN), ``elite`` ≥ ``population``."""
    if variant not in VARIANTS:
        _fail(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    pop = _check_int("population", DEFAULTS["population"] if population is None else population, 2)
    iters = _check_int("iterations", DEFAULTS["iterations"] if iterations is None else iterations, 0)
    n_elite = _check_int("elite", DEFAULTS["elite"] if elite is None else elite, 1)
    if n_elite >= pop:
        _fail(f"elite={n_elite} must be below population={pop} (the rest are the children)")
    p_mut = _check_prob("mutation_prob", DEFAULTS["mutation_prob"] if mutation_prob is None else mutation_prob)
    p_cross = _check_prob("crossover_prob", DEFAULTS["crossover_prob"] if crossover_prob is None else crossover_prob)
    seed = _check_int("seed", seed, 0)
    if budget is not None:
        budget = _check_int("budget", budget, 1)
    start_grid: tuple[int, ...] = ()
    if search_start_tokens:
        max_start_tokens = _check_int("max_start_tokens", max_start_tokens, 1)
        start_grid = tuple(g for g in START_TOKEN_GRID if g <= max_start_tokens)
    elif max_start_tokens not in (0, None):
        _check_int("max_start_tokens", max_start_tokens, 0)
    return {"population": pop, "iterations": iters, "elite": n_elite, "mutation_prob": p_mut,
            "crossover_prob": p_cross, "variant": variant, "seed": seed, "budget": budget, "start_grid": start_grid}


def run_evolution(objective: Callable[[list[float], int], float], *, dim: int, scale: float,
                  yarn_factors: list[float] | None = None, population: int | None = None,
                  iterations: int | None = None, mutation_prob: float | None = None,
                  crossover_prob: float | None = None, elite: int | None = None, variant: str = "dim_mono",
                  search_start_tokens: bool = False, max_start_tokens: int = 0, seed: int = 0,
                  journal: Path | None = None, budget: int | None = None,
                  progress: bool = False,
                  evaluate_batch: Callable[[list[tuple[list[float], int]]], list[float]] | None = None,
                  write_journal: bool = True) -> EvolutionResult:
    """LongRoPE's evolutionary search; ``objective(factors, start_tokens)`` is minimised.

    ``factors``: d/2 per-pair rescale factors (``longrope``'s ``long_factor``, θ_i / factor_i);
    ``start_tokens``: how many leading positions keep the original, un-scaled cos/sin (their
    ``start_token_idx``). ropescale's ``longrope`` strategy has no such parameter: the objective
    must apply it itself; it is always 0 unless ``search_start_tokens`` (then drawn from
    {0} ∪ {1, 2, 4, …, 64} up to ``max_start_tokens``).

    ``dim``: rotary dim d (even, ≥ 4); ``scale``: s = L / T ≥ 1 (the grid's top is ≈ 1 + s);
    ``yarn_factors``: the initial individual (see ``yarn_init_factors``), s everywhere when None.
    Hyper-parameters left None take the authors' defaults (``DEFAULTS``). ``budget`` caps the
    evaluations (default: all, population + iterations × (population − elite)). ``journal``: a JSONL
    file; a rerun with the same arguments replays its values instead of calling the objective, so
    a killed search resumes to the result of an uninterrupted one. Deterministic for a ``seed``.

    Parallel: each generation's candidates are made first (they depend only on earlier
    generations' values), then scored together by ``evaluate_batch([(factors, start_tokens),
    …]) -> [value, …]`` (default: ``objective`` on each in turn). A batch scorer that splits the
    candidates over processes and gathers the values (every process running this same search with
    the same seed; one of them with ``write_journal``, the others replaying the journal read-only)
    gives exactly the serial search's candidates and values.

    Raises ``InvalidInput`` (one line) for bad arguments or a journal from other settings.
    """
    dim = _check_int("dim", dim, 4)
    if dim % 2:
        _fail(f"dim={dim} must be even (the rotary dim: two coordinates per pair)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 1:
        _fail(f"scale={scale!r} must be a finite number ≥ 1")
    scale = float(scale)
    opts = check_options(population=population, iterations=iterations, elite=elite, mutation_prob=mutation_prob,
                         crossover_prob=crossover_prob, variant=variant, seed=seed, budget=budget,
                         search_start_tokens=search_start_tokens, max_start_tokens=max_start_tokens)
    init = _initial_factors(yarn_factors, dim, scale)
    lay = _Layout(n=dim // 2, scale=scale, step=DEFAULTS["list_step"], piece=variant == "dim_piece_mono",
                  start=bool(search_start_tokens), start_grid=opts["start_grid"])
    header = {"journal": "ropescale.evolution", "version": _JOURNAL_VERSION, "dim": dim, "scale": scale,
              "variant": variant, "population": opts["population"], "iterations": opts["iterations"],
              "elite": opts["elite"], "mutation_prob": opts["mutation_prob"],
              "crossover_prob": opts["crossover_prob"], "seed": opts["seed"], "search_start_tokens": lay.start,
              "start_grid": list(opts["start_grid"]), "init": init.tolist()}
    book = _Journal(journal, header, write=write_journal)
    search = _Evolution(objective, evaluate_batch, lay, opts, book, journal)
    try:
        stop = search.run(init, progress)
    finally:
        book.close()
    history = search.history
    if not history:  # budget can't be 0, so the init individual is always evaluated
        raise AssertionError("no evaluation")
    best = min(range(len(history)), key=lambda i: history[i]["value"])  # first of the best on ties
    b = history[best]
    if progress:
        print(f"evolution: done ({stop}), best {b['value']:.6g} after {len(history)} evaluations",
              file=sys.stderr, flush=True)
    return EvolutionResult(factors=list(b["factors"]), start_tokens=int(b["start_tokens"]), value=float(b["value"]),
                           history=history, evaluations=len(history), stop=stop)


def _initial_factors(yarn_factors: list[float] | None, dim: int, scale: float) -> np.ndarray:
    """The initial individual's factors ``[d/2]``: ``yarn_factors`` checked (finite, positive,
    non-decreasing up to float noise, then made exactly monotone), or s everywhere when None."""
    n = dim // 2
    if yarn_factors is None:
        return np.full(n, scale)
    try:
        init = np.asarray(yarn_factors, dtype=float)
    except (TypeError, ValueError):
        _fail("yarn_factors must be a list of numbers")
    if init.shape != (n,):
        _fail(f"yarn_factors has {init.size} entries; dim={dim} needs {n}")
    if not np.all(np.isfinite(init)) or np.any(init <= 0):
        _fail("yarn_factors must be finite and positive")
    drops = np.diff(init)
    if np.any(drops < -1e-6 * np.abs(init[1:])):
        _fail("yarn_factors must be non-decreasing over pairs (the searched factors are kept monotone)")
    return np.maximum.accumulate(init)


class _Evolution:
    """One run of the search (``run_evolution``): the draws (one ``numpy`` generator), every genome
    made (novelty), the evaluations in order (``history``), the journal replayed or appended."""

    def __init__(self, objective, evaluate_batch, lay: _Layout, opts: dict[str, Any], book: _Journal,
                 journal: Path | None):
        self.objective, self.evaluate_batch, self.lay, self.book, self.journal = (objective, evaluate_batch, lay,
                                                                                 book, journal)
        self.pop, self.iters, self.n_elite = opts["population"], opts["iterations"], opts["elite"]
        self.p_mut, self.p_cross = opts["mutation_prob"], opts["crossover_prob"]
        self.rng = np.random.default_rng(opts["seed"])
        self.n_mut = (self.pop - self.n_elite) // 2 if self.n_elite >= 2 else self.pop - self.n_elite
        self.n_cross = self.pop - self.n_elite - self.n_mut
        total = self.pop + self.iters * (self.pop - self.n_elite)
        self.cap = total if opts["budget"] is None else min(opts["budget"], total)
        self.full = "budget" if self.cap < total else "iterations"
        self.history: list[dict] = []
        self.generation_no = 0
        self.made: _Made | None = None  # every individual ever created (their self.history)

    def run(self, init: np.ndarray, progress: bool) -> str:
        """Run the generations; returns why the search stopped."""
        lay = self.lay
        prefix = ([0.0] if lay.start else []) + ([0.0, 0.0] if lay.piece else [])  # their init α = β = 0
        init_genome = np.concatenate([np.array(prefix, dtype=float), init])
        self.made = _Made(init_genome.shape[0])
        try:
            self.made.append(init_genome)
            first_index = len(self.history)
            pop_list = self.generation([lambda: (init_genome, "init", [])]
                                       + [lambda: (self.mutate(init_genome), "mutation", [first_index])]
                                       * (self.pop - 1))
            for it in range(self.iters):
                self.generation_no = it + 1
                parents = sorted(pop_list, key=lambda t: t[1])[:self.n_elite]  # stable: earlier first on ties
                if progress:
                    print(f"evolution: generation {it + 1}/{self.iters}, best {parents[0][1]:.6g}, "
                          f"{len(self.history)}/{self.cap} evaluations", file=sys.stderr, flush=True)
                pop_list = list(parents) + self.generation([lambda p=parents: self.mutant(p)] * self.n_mut
                                                           + [lambda p=parents: self.cross(p)] * self.n_cross)
        except _Stop as s:
            return s.reason
        return "iterations"

    def mutant(self, parents: list) -> tuple[np.ndarray, str, list]:
        par = parents[int(self.rng.integers(self.n_elite))]
        return self.mutate(par[0]), "mutation", [par[2]]

    def cross(self, parents: list) -> tuple[np.ndarray, str, list]:
        i1, i2 = sorted(int(x) for x in self.rng.choice(self.n_elite, 2, replace=False))
        p1, p2 = parents[i1], parents[i2]
        child = _crossover(p1[0], p2[0], self.rng, self.lay, self.p_cross, DEFAULTS["max_crossover_try"],
                           self.made.seen)
        if child is None:  # identical parents or no valid new child: a mutant of parent 1
            return self.mutate(p1[0]), "mutation", [p1[2]]
        self.made.append(child)
        return child, "crossover", [p1[2], p2[2]]

    def mutate(self, parent: np.ndarray) -> np.ndarray:
        g, seen, lay = parent, self.made.seen, self.lay
        for _ in range(_MAX_PASSES):
            if not (seen(g) or not lay.valid(g)):
                break
            g, _touched = _mutation_pass(g, self.rng, lay, self.p_mut)
        else:
            if seen(g) or not lay.valid(g):
                raise _Stop("exhausted")
        self.made.append(g)
        return g

    def generation(self, make: list) -> list[tuple[np.ndarray, float, int]]:
        """Make this generation's candidates (``make``: callables returning (genome, origin,
        parents)), at most as many as the budget leaves, then score them together."""
        room = self.cap - len(self.history)
        if room <= 0:
            raise _Stop(self.full)
        batch, stopped = [], None
        try:
            for m in make[:room]:
                batch.append(m())
        except _Stop as s:  # no new valid candidate: score those made, then stop
            stopped = s
        entries = self.score(batch)
        if stopped is not None:
            raise stopped
        if len(make) > room:
            raise _Stop(self.full)
        return entries

    def score_all(self, cands: list[tuple[list[float], int]]):
        """Values of ``cands`` in order, each yielded as soon as it is known (serially: one by
        one, so the journal keeps every finished evaluation; with ``evaluate_batch``: the batch)."""
        if self.evaluate_batch is None:
            for f, s in cands:
                yield self.objective(list(f), s)
            return
        values = list(self.evaluate_batch(cands))
        if len(values) != len(cands):
            raise AssertionError(f"evaluate_batch returned {len(values)} values for {len(cands)} candidates")
        yield from values

    def score(self, batch: list[tuple[np.ndarray, str, list]]) -> list[tuple[np.ndarray, float, int]]:
        """Score one generation's candidates in order (journal values where recorded); their
        population entries (genome, value, index in history)."""
        base, lay, book = len(self.history), self.lay, self.book
        rows = []
        for k, (g, origin, parents) in enumerate(batch):
            factors, start = [float(x) for x in lay.factors(g)], lay.start_tokens(g)
            value = None
            if base + k < len(book.records):
                rec = book.records[base + k]
                if rec.get("start_tokens") != start or rec.get("factors") != factors:
                    _fail(f"journal {self.journal} entry {base + k} is another candidate; the search it records "
                          "differs (code version or arguments); use a new journal")
                value = float(rec["value"])
            rows.append([g, origin, parents, factors, start, value])
        todo = [k for k, row in enumerate(rows) if row[5] is None]
        for k, v in zip(todo, self.score_all([(rows[k][3], rows[k][4]) for k in todo])):
            rows[k][5] = float(v)
            g, origin, parents, factors, start, value = rows[k]
            book.append({"n": base + k, "generation": self.generation_no, "origin": origin, "parents": parents,
                         "factors": factors, "start_tokens": start, "value": value})
        out = []
        for g, origin, parents, factors, start, value in rows:
            value = math.inf if math.isnan(value) else value
            out.append((g, value, len(self.history)))
            self.history.append({"generation": self.generation_no, "origin": origin, "parents": parents,
                                 "factors": factors, "start_tokens": start, "value": value})
        return out

"""``method: evolution``: LongRoPE's evolutionary search of ``longrope``'s per-pair factors, run on
the search objective (``eval.search.objective``) and written as a search folder.

The algorithm is ``eval.search.evolution.run_evolution`` (the authors' operators and defaults);
this module supplies what it needs from the model — rotary dim d, base b, training window T, scale
s = max(lengths) / T, YaRN's per-pair factors as the initial individual — and scores a candidate
``long_factor`` (d/2 factors, θ_i / factor_i) by J + ``PENALTY`` · max(0, c): the objective and the
PPL-at-T constraint of the tuner, as a penalty since the evolution has no constraint of its own.
``short_factor`` (used at L ≤ T) is fixed: 1 per pair unless given under ``fixed:``. Kill and
resume: the evolution's JSONL journal (``evolution.jsonl``) replays finished evaluations.

Outputs as the tuner's (``best.json``, ``trials.csv`` — one row per evaluation —, ``results.md``,
``search.png``) plus ``factors.png``: the searched factor per rotary pair against YaRN's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ropescale.models import resolve_device
from ropescale.patching import find_rotary_modules
from ropescale.rotary import rope_context
from ropescale.runs.config import ConfigError
from ropescale.runs.lifecycle import RunInputs
from ropescale.runs.plotting import pyplot, save_figure
from ropescale.runs.processes import process_state
from ropescale.runs.protocol import RunFolder

from .config import SearchConfig
from .objective import SearchRun, check_engine
from .report import (
    BEST,
    PLOT,
    REPORT,
    TRIALS,
    fmt,
    plot_objective,
    replacing,
    spec_string,
    write_csv,
    write_text,
)
from .trackers import SearchTrackers, trial_numbers
from .tuner import PENALTY, SearchFailed

__all__ = ["FACTORS_PLOT", "JOURNAL", "EvolutionSearch"]

JOURNAL, FACTORS_PLOT = "evolution.jsonl", "factors.png"


class EvolutionSearch(SearchRun):
    """LongRoPE's evolution as a run kind (``ropescale.runs.protocol``). Under ``accelerate
    launch`` every process runs this same search; each generation's candidates are split over them
    (``split_over_processes``) and the main process alone writes the folder. The process group
    stays open for a later run in the process (``ropescale.runs.processes``)."""

    def __init__(self, cfg: SearchConfig, *, progress: bool = True):
        self.state = process_state(cpu=resolve_device(cfg.device).type == "cpu")
        super().__init__(cfg, progress=progress and self.state.is_main_process)

    def check(self) -> None:
        try:
            from .evolution import run_evolution  # noqa: F401 — what this method runs
        except ImportError:
            raise ConfigError("method: evolution (LongRoPE's search) is not available in this version; "
                              "use tpe or cmaes") from None
        check_engine(self.cfg, processes=self.state.num_processes)

    def prepare(self, inputs: RunInputs, folder: RunFolder | None) -> None:
        from .evolution import yarn_init_factors

        super().prepare(inputs, folder)
        objective = self.objective
        ctx = rope_context(objective.model, find_rotary_modules(objective.model)[0][1])
        self.dim, self.theta, self.train = ctx["dim"], ctx["rope_theta"], objective.train_length
        self.scale = max(1.0, max(self.cfg.lengths) / self.train)
        self.short = self.cfg.fixed.get("short_factor", [1.0] * (self.dim // 2))
        self.yarn = yarn_init_factors(self.dim, self.theta, self.train, self.scale)
        # the strategy's output on the initial individual, before the folder: not at the first evaluation
        objective.check_candidate({"long_factor": [float(f) for f in self.yarn], "short_factor": self.short})

    def execute(self, folder: RunFolder) -> dict:
        from .evolution import run_evolution, split_over_processes

        cfg, state, objective, output = self.cfg, self.state, self.objective, folder.path
        main = state.is_main_process
        objective.serve_from(output)  # an engine outside this process: where it serves candidates from

        def score(factors, start_tokens: int) -> float:
            _, m = objective({"long_factor": [float(f) for f in factors], "short_factor": self.short})
            return m.objective + PENALTY * max(0.0, m.constraint)

        batch = split_over_processes(score, state) if state.num_processes > 1 else None
        result = run_evolution(score, dim=self.dim, scale=self.scale, yarn_factors=self.yarn, seed=cfg.seed,
                               journal=output / JOURNAL, budget=cfg.budget, progress=self.progress,
                               evaluate_batch=batch, write_journal=main, **cfg.evolution)
        if not math.isfinite(result.value):
            raise SearchFailed(f"no usable evaluation in {result.evaluations}: every candidate's objective was "
                               f"not a finite number (the journal {output / JOURNAL} has each value); check the "
                               "model in float32 (dtype) and the lengths")
        params, m = objective({"long_factor": [float(f) for f in result.factors], "short_factor": self.short})
        best = {"strategy": cfg.strategy, "params": params, "spec": spec_string(cfg.strategy, params),
                "objective": m.objective, "feasible": m.constraint <= 0, "trial": _best_index(result),
                "ppl": {str(k): v for k, v in m.ppl.items()}, "ppl_train": m.ppl_train,
                "evaluations": result.evaluations, "stop": result.stop}
        if main:
            self._write(folder, result, best)
        state.wait_for_everyone()  # all processes leave together
        return best

    def _write(self, folder: RunFolder, result, best: dict) -> None:
        """The folder's files from the finished evolution: the trackers' values, ``trials.csv``, the
        plots, ``results.md``, then ``best.json`` (it marks the search done)."""
        from .evolution import yarn_ramp64

        cfg, output = self.cfg, folder.path
        rows = [{"trial": i, "generation": h["generation"], "origin": h["origin"], "objective": h["value"],
                 "feasible": None, "factors": json.dumps(h["factors"])} for i, h in enumerate(result.history)]
        trackers = SearchTrackers(cfg.report_to, output, folder.identity)
        try:  # the evaluations' objective, from the journal, once the evolution ends
            for r in rows:
                trackers.log(r["trial"], trial_numbers({"objective": r["objective"]}, {}))
        finally:
            trackers.close()
        write_csv(rows, output / TRIALS)
        plot_objective(rows, output / PLOT, cfg)
        # YaRN's own per-pair factors θ_i / θ'_i (its defaults: θ'_i = θ_i · (ramp_i / s + 1 − ramp_i)),
        # beside LongRoPE's initial individual
        ramp = yarn_ramp64(self.dim, self.theta, self.train)
        yarn_own = (1.0 / (ramp / self.scale + 1.0 - ramp)).tolist()
        _plot_factors(result.factors, self.yarn, yarn_own, output / FACTORS_PLOT, cfg)
        write_text(output / REPORT, _markdown(cfg, best, rows, self.objective.vanilla_ppl_train, self.train))
        write_text(output / BEST, json.dumps(best, indent=1) + "\n")  # last: it marks the search done


def _best_index(result) -> int:
    values = [h["value"] for h in result.history]
    return values.index(min(values)) if values else -1


def _plot_factors(found: list[float], init: list[float], yarn_own: list[float], path: Path,
                  cfg: SearchConfig) -> None:
    """Searched factor per rotary pair against the initial individual (LongRoPE's 1 + (s − 1)·ramp)
    and YaRN's own effective factors θ_i / θ'_i (β 32 / 1)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    pairs = range(len(found))
    ax.plot(pairs, init, "--", color="grey", label="initial individual (LongRoPE's YaRN: 1 + (s − 1)·ramp)")
    ax.plot(pairs, yarn_own, ":", color="black", label="YaRN's own θ_i / θ'_i (β 32 / 1)")
    ax.plot(pairs, found, "o-", ms=3, label="searched (LongRoPE evolution)")
    ax.set_xlabel("rotary pair i (fast → slow)")
    ax.set_ylabel("rescale factor θ_i / θ'_i")
    ax.set_title(f"longrope on {cfg.model}: searched factors at {max(cfg.lengths)} tokens", fontsize=10)
    ax.legend(fontsize=8)
    with replacing(path) as tmp:
        save_figure(fig, tmp)


def _markdown(cfg: SearchConfig, best: dict, rows: list[dict], vanilla: float, train: int) -> str:
    lines = [
        f"# Parameter search: longrope (LongRoPE evolution) on {cfg.model}", "",
        f"- model: `{cfg.model}`; search data: `{cfg.data.spec().describe()}` ({cfg.max_windows} windows per "
        f"length, evenly spaced over the split); held-out data kept out: "
        f"`{cfg.heldout.spec().describe() if cfg.heldout else '—'}`",
        f"- evolution {json.dumps(cfg.evolution) or 'defaults'}, seed {cfg.seed}, budget {cfg.budget}; "
        f"{best['evaluations']} evaluations (stop: {best['stop']}); LongRoPE's default is 64 + 40 × 32 = 1,344",
        f"- target lengths: {', '.join(map(str, cfg.lengths))}; T = {train}",
        f"- value = J + {PENALTY:g} · max(0, c), c = PPL_T / ((1 + {cfg.epsilon:g}) · {vanilla:.3f}) − 1", "",
        f"**Best** (evaluation {best['trial']}): J {best['objective']:.4f}, PPL "
        + ", ".join(f"@{k} {v:.3f}" for k, v in best["ppl"].items()) + f", PPL@T {best['ppl_train']:.3f}"
        + ("" if best["feasible"] else " (over the PPL-at-T limit)"), "",
        "| evaluation | generation | origin | value |", "|---|---|---|---|",
    ]
    lines += [f"| {r['trial']} | {r['generation']} | {r['origin']} | {fmt(r['objective'])} |" for r in rows]
    return "\n".join(lines) + "\n"

"""``engine: mlx``: the harness's cells scored by mlx-lm, serving what ``ropescale patch --engine mlx`` writes.

mlx-lm (``pip install "mlx[cpu]" mlx-lm``, which runs on a Linux CPU; ``bench/engines/install.sh mlx``)
answers log-probabilities (its driver's ``logprobs`` mode: one forward per sequence, float64
log-softmax), not generations: it scores the tasks that ask for log-probabilities only
(``Task.engine_asks``: perplexity). Per cell the patched model's MLX export (``ropescale.serving.engines.mlx``)
is written as a model folder (``<output>/mlx/<strategy>@<L>/``, the weights saved in it), mlx-lm loads it
once and scores every request; the first request is also scored by the patched transformers model and
the cell is refused (``EngineDisagrees``, one line, the cells before it kept) when the mean NLL over its
positions differs by more than 1e-4 nats (float32; ``ropescale parity`` measured ≤ 6.5e-5 per position
on the bundled model). Before that, the driver's log-probabilities pass the checks every scoring engine's
answers pass (``eval.engines.scoring.check_answers``: one list per request, of its length, finite and ≤ 0):
otherwise ``EngineFailed``, one line, and the cell is not recorded.

The export and the driver are ``MlxScoring.answer``'s, which a search's candidates go through as well
(``eval.search.objective``); the checks and the parity check are every engine's (``eval.engines.answering``).

Refused before anything loads (one ``ConfigError`` line): mlx-lm not installed (how to install it), a task
asking for generations, options an engine cannot score (``Task.engine_refusal``), several launched
processes. What mlx-lm cannot express (relative-position rules, a query temperature, a model type whose
rope keys ropescale has not read) is refused at its cell, in one line (the export's reason).
"""

from __future__ import annotations

from typing import Any

from ropescale.runs.config import ConfigError

from .. import process
from ..answering import Answered
from ..process import EngineAbsent, EngineFailed
from ..scoring import Demand, ScoringEngine
from . import ENVIRONMENT

__all__ = ["TOLERANCE", "MlxScoring"]

TOLERANCE = 1e-4  # largest |Δ mean NLL| [nats] against transformers on a cell's first request (float32)


class MlxScoring(ScoringEngine):
    """mlx-lm serving the patch's MLX export (see the module docstring)."""

    name = "mlx"
    title = "mlx-lm"
    answers = frozenset({"logprobs"})
    environment = ENVIRONMENT

    def check_demand(self, demand: Demand, options: Any, source: str = "config", processes: int = 1) -> None:
        if processes > 1:
            raise ConfigError(f"{source}: engine: mlx runs in one process; do not launch it with accelerate launch")
        try:
            process.require_engine(self.name)
        except EngineAbsent as e:
            raise ConfigError(f"{source}: engine: mlx: {e}") from None

    def tolerance(self, options: Any, dtype: str) -> float:
        return TOLERANCE

    def answer(self, requests: list[dict[str, Any]], serving) -> Answered:
        """The requests' log-probabilities from mlx-lm's driver on the patch's MLX export, written (weights
        saved) to ``serving.folder``. Raises ``ExportRefused`` (the export's reason) and ``EngineFailed``."""
        from ropescale.serving.engines import get_engine

        engine = get_engine("mlx")
        serve = max(len(r["ids"]) for r in requests)
        translation = engine.translate(serving.handle, serve, freeze_dynamic_at=serving.freeze)
        engine.write(serving.model, serving.tokenizer, translation, serving.folder)
        got = process.run_engine(self.name, {"mode": "logprobs", "jobs": [{"model": str(serving.folder),
                                                                          "ids": [r["ids"] for r in requests]}]},
                                 log_dir=serving.log_dir, timeout=24 * 3600)
        job = (got.get("jobs") or [{}])[0]
        if "error" in job:
            raise EngineFailed(f"{serving.where}: mlx-lm {got.get('mlx', '')} did not score the cell: "
                               f"{job['error']}; {serving.stops}")
        answered = job.get("logprobs")
        results = [{"logprobs": lp, "tokens": []} for lp in answered] if isinstance(answered, list) else answered
        return Answered(results=results, version=got.get("mlx", "mlx-lm"), record={"mlx_export": translation.notes})

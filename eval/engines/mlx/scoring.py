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

Refused before anything loads (one ``ConfigError`` line): mlx-lm not installed (how to install it), a task
asking for generations, options an engine cannot score (``Task.engine_refusal``), several launched
processes. What mlx-lm cannot express (relative-position rules, a query temperature, a model type whose
rope keys ropescale has not read) is refused at its cell, in one line (the export's reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ropescale.runs.config import ConfigError

from .. import process
from ..process import EngineAbsent, EngineFailed
from ..scoring import DEFAULT, ScoringEngine, check_answers, scoring_engine
from . import ENVIRONMENT

__all__ = ["TOLERANCE", "MlxScoring"]

TOLERANCE = 1e-4  # largest |Δ mean NLL| [nats] against transformers on a cell's first request (float32)


class MlxScoring(ScoringEngine):
    """mlx-lm serving the patch's MLX export (see the module docstring)."""

    name = "mlx"
    answers = frozenset({"logprobs"})
    environment = ENVIRONMENT

    def check(self, cfg, source: str = "config", processes: int = 1) -> None:
        from ...tasks.base import get_task

        super().check(cfg, source, processes)  # a task asking for generations
        why = get_task(cfg.task).engine_refusal(cfg.options)
        if why:
            raise ConfigError(f"{source}: {why} — use engine: transformers")
        if processes > 1:
            raise ConfigError(f"{source}: engine: mlx runs in one process; do not launch it with accelerate launch")
        try:
            process.require_engine(self.name)
        except EngineAbsent as e:
            raise ConfigError(f"{source}: engine: mlx: {e}") from None

    def score_cell(self, cfg, task, model, examples, spec, params: dict, length: int, train_length: int, device,
                   output: Path) -> dict[str, Any]:
        from ropescale.patching import patch
        from ropescale.serving.engines import get_engine
        from ropescale.serving.rope import ExportRefused
        from ropescale.strategies import get_strategy

        from ..vllm.scoring import EngineDisagrees, transformers_logprobs

        reqs, checked = task.engine_requests(examples)
        serve = max(len(r["ids"]) for r in reqs)
        slug = "".join(c if c.isalnum() or c in "._=-" else "_" for c in spec.display)[:48] + f"@{length}"
        folder = Path(output) / "mlx" / slug
        engine = get_engine("mlx")
        with patch(model, spec.name, original_max_position_embeddings=train_length, logn=spec.logn,
                   temperature=spec.temperature, **params) as handle:
            try:  # dynamic NTK: the one scale the transformers engine uses for a window of L
                freeze = length if handle.strategy_obj.served == "freeze" else None
                translation = engine.translate(handle, serve, freeze_dynamic_at=freeze)
            except ExportRefused as e:
                raise ConfigError(f"{spec.display} @ {length}: {e} (engine: mlx)") from None
            engine.write(model, task.tokenizer, translation, folder)
            ours = transformers_logprobs(model, reqs[checked]["ids"], device)
        got = process.run_engine(self.name, {"mode": "logprobs", "jobs": [{"model": str(folder),
                                                                          "ids": [r["ids"] for r in reqs]}]},
                                 log_dir=Path(output) / "logs", timeout=24 * 3600)
        job = (got.get("jobs") or [{}])[0]
        if "error" in job:
            raise EngineFailed(f"{spec.display} @ {length}: mlx-lm {got.get('mlx', '')} did not score the cell: "
                               f"{job['error']}; the cell is not recorded")
        answered = job.get("logprobs")
        results = [{"logprobs": lp, "tokens": []} for lp in answered] if isinstance(answered, list) else answered
        check_answers(reqs, results, "mlx-lm's driver", f"{spec.display} @ {length}")  # every engine's checks
        theirs = torch.tensor(results[checked]["logprobs"], dtype=torch.float64)
        d_mean = abs(float(theirs.mean() - ours.mean()))  # theirs finite (check_answers); ours NaN: refused
        if not d_mean <= TOLERANCE:
            raise EngineDisagrees(f"{spec.display} @ {length}: mlx-lm and transformers disagree on the cell's first "
                                  f"request: |Δ mean NLL| {d_mean:.3g} > {TOLERANCE:g} nats; the cell is not recorded")
        metrics = task.combine([task.engine_parts(examples, results, length)], examples, length=length,
                               strategy=get_strategy(spec.name))
        return {**metrics, "engine": self.name, "engine_version": got.get("mlx", "mlx-lm"),
                "parity": {"mean_nll_diff": d_mean, "max_abs_dlogp": float((theirs - ours).abs().max()),
                           "tokens": int(ours.numel()), "tolerance": TOLERANCE,
                           "against": f"transformers {scoring_engine(DEFAULT).version()}"},
                "examples": len(examples), "mlx_export": translation.notes}

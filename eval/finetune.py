"""Fine-tuning as an experiment: the library's training loop plus the harness evaluations of
``eval.after`` on the saved model.

``ropescale.training.finetune`` trains, checkpoints and saves; it knows nothing of tasks. Here
each ``eval.after`` entry becomes a harness experiment (``EvalConfig``) on the saved model with
the trained strategy, every parameter fixed, and all of them are checked before step 1 — the
configs, then each task's examples at each length (a passkey length shorter than its question,
data too short for a perplexity length) — so a bad evaluation fails now, not after training.
Results go to ``OUTPUT/eval/<task>/`` as any harness run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ropescale.models import load_tokenizer
from ropescale.runs.config import ConfigError
from ropescale.runs.data import load_documents, tokenize_documents
from ropescale.training import FinetuneConfig, ResolvedRun, finetune

from .config import EvalConfig, build_config
from .engines.scoring import scoring_engine
from .sweep import run_sweep
from .tasks.base import get_task

__all__ = ["HarnessEvaluations", "after_configs", "run_finetune"]


def after_configs(cfg: FinetuneConfig, run: ResolvedRun, model: str, source: str = "config"
                  ) -> list[tuple[str, EvalConfig]]:
    """``(folder name, EvalConfig)`` of each ``eval.after`` experiment on ``model`` (the saved
    model) with the trained strategy, every parameter fixed. Raises ``ConfigError``."""
    out, names = [], []
    for i, entry in enumerate(cfg.eval.after if cfg.eval else []):
        raw = {"data": cfg.eval.data.model_dump(), **entry, "model": model,
               "strategies": [run.strategy_spec(cfg)],
               "original_max_position_embeddings": cfg.original_max_position_embeddings}
        raw.setdefault("device", cfg.device)
        raw.setdefault("threads", cfg.threads)
        task = str(entry.get("task", "perplexity"))
        name = task if task not in names else f"{task}-{i}"
        names.append(name)
        try:
            out.append((name, build_config(raw, f"{source}: eval.after.{i}")))
        except ConfigError as e:
            raise ConfigError(" ".join(str(e).split())) from None
    return out


class HarnessEvaluations:
    """The ``after`` hook of ``ropescale.training.finetune``: checks every ``eval.after``
    experiment before training and runs them on the saved model after it."""

    def check(self, cfg: FinetuneConfig, run: ResolvedRun, source: str, *, processes: int = 1) -> None:
        """Build every experiment's examples at every length, as the harness will on the saved
        model (same tokenizer, same window T), and check what an experiment's engine refuses
        (``eval.engines.scoring``; ``engine: vllm``: not installed, a rule it cannot serve, ``processes`` > 1
        launched).
        Raises ``ConfigError`` in one line."""
        configs = after_configs(cfg, run, cfg.model, source)
        if not configs:
            return
        for i, (_, ecfg) in enumerate(configs):
            scoring_engine(ecfg.engine).check(ecfg, f"{source}: eval.after.{i}", processes=processes)
        tokenizer = load_tokenizer(cfg.model)
        for i, (_, ecfg) in enumerate(configs):
            task_cls = get_task(ecfg.task)
            try:
                docs = (tokenize_documents(tokenizer, load_documents(ecfg.data.spec())) if task_cls.uses_data
                        else None)
                task = task_cls(ecfg.options, tokenizer=tokenizer,
                                train_length=ecfg.original_max_position_embeddings or run.train_length, documents=docs)
                for length in ecfg.lengths:
                    task.examples(length)
            except ValueError as e:
                raise ConfigError(f"{source}: eval.after.{i} ({ecfg.task}): {' '.join(str(e).split())}") from None

    def run(self, cfg: FinetuneConfig, run: ResolvedRun, model_dir: Path, output: Path, *, progress: bool,
            say) -> dict[str, list[dict]]:
        """Run each experiment on ``model_dir`` into ``output/eval/<name>``; ``{name: records}``."""
        evaluations = {}
        for name, ecfg in after_configs(cfg, run, str(model_dir)):
            say(f"evaluating the saved model: {name} (harness) → {output / 'eval' / name}")
            evaluations[name] = run_sweep(ecfg, output / "eval" / name, progress=progress)
        return evaluations


def run_finetune(cfg: FinetuneConfig, output: str | Path, **kwargs: Any) -> dict[str, Any]:
    """``ropescale.training.finetune`` with the harness evaluations of ``eval.after``; same
    arguments, summary and errors."""
    return finetune(cfg, output, after=HarnessEvaluations(), **kwargs)

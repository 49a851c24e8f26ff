"""A sweep's cell as one object: a strategy at a length, its parameters resolved once.

``eval.sweep`` resolves every cell when it prepares (``Strategy.resolve`` at the cell's length L for the
loaded model's training window T) and hands each cell, whole, to what scores it: the in-process measure or a
scoring engine (``ScoringEngine.score_cell(cell, examples, bench)``). Nothing downstream resolves again or
re-reads a parameter by name.

This module imports nothing of the harness (the sweep and the engines both import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Bench", "Cell"]


@dataclass(frozen=True)
class Cell:
    """One (strategy, length) cell.

    spec: the strategy entry (``eval.config.StrategySpec``: ``name``, ``display``, ``logn``, ``temperature``).
    length: L [tokens].
    id: the cell's stable id (``eval.sweep.cell_id``: the experiment, the entry and L, hashed).
    params: the strategy's parameters resolved for L and T (auto ones filled), as patched and recorded.
    train_length: T [tokens], the loaded model's training window.
    rotation: the patch's rotation fingerprint on the loaded model (``check_strategy``), None where the cell
        must run whatever it is.
    note: why this cell equals another by construction (an attention rule whose window is ≥ L), or None.
    """

    spec: Any
    length: int
    id: str
    params: dict
    train_length: int
    rotation: str | None = None
    note: str | None = None

    @property
    def where(self) -> str:
        """How messages name the cell: ``yarn:factor=4 @ 1024``."""
        return f"{self.spec.display} @ {self.length}"

    def patch(self, model):
        """``ropescale.patch`` of this cell on ``model`` (a context manager; the patch's handle)."""
        from ropescale.patching import patch

        spec = self.spec
        return patch(model, spec.name, original_max_position_embeddings=self.train_length, logn=spec.logn,
                     temperature=spec.temperature, **self.params)


@dataclass(frozen=True)
class Bench:
    """What every cell of one sweep is scored on.

    cfg: the experiment (``eval.config.EvalConfig``, dtype resolved).
    task: the task instance (its tokenizer, options, documents).
    model: the loaded transformers model, unpatched between cells.
    device: where inputs go (``torch.device``).
    output: the run folder (an engine's exports and logs go under it).
    state: the process state (``accelerate``'s: index, count, main process).
    progress: show the task's progress bars.
    """

    cfg: Any
    task: Any
    model: Any
    device: Any
    output: Path
    state: Any
    progress: bool = False

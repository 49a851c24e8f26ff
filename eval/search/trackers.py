"""``report_to`` in a search: each finished trial's numbers sent to accelerate's trackers
(TensorBoard, W&B, MLflow, …), as a fine-tuning run sends its log (``ropescale.runs.trackers``:
the same names, the same check that each is installed, before anything is written).

Per complete trial, at step = its index (``trials.csv``'s ``trial``): ``objective``, ``constraint``,
``ppl@L`` per target length, ``ppl_train``, ``retrieval_nll`` / ``needle_nll`` / ``nll@<task>`` when measured,
``seconds`` and every sampled parameter as ``param/<name>``; a refused or failed trial has no
numbers and is not sent. The trackers' run is named after the search folder, with the search's
identity as its settings. The evolution (method ``evolution``) sends its evaluations' objective
(``objective``, step = evaluation index) when it ends, from its journal. Trackers only watch:
``report_to`` is not in the search's identity, so a search resumes across it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ropescale.runs.trackers import flat_settings

__all__ = ["SearchTrackers", "trial_numbers"]


def trial_numbers(attrs: dict[str, Any], params: dict[str, Any]) -> dict[str, float]:
    """The scalars of one complete trial (its Optuna user attributes and sampled parameters)."""
    keys = ("objective", "constraint", "ppl_train", "kl_train", "retrieval_nll", "needle_nll", "seconds", "parity")
    out = {k: attrs[k] for k in keys if isinstance(attrs.get(k), (int, float))}
    out |= {k: v for k, v in attrs.items() if k.startswith(("ppl@", "nll@")) and isinstance(v, (int, float))}
    out |= {f"param/{k}": v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: float(v) for k, v in out.items() if math.isfinite(float(v))}


class SearchTrackers:
    """The trackers of ``names`` on the search folder ``output`` (none: every call does nothing).
    ``identity``: the search's (``eval.search.report.identity``), their run's settings."""

    def __init__(self, names: list[str], output: Path, identity: dict[str, Any]):
        self.acc = None
        if names:
            from accelerate import Accelerator

            self.acc = Accelerator(log_with=names, project_dir=str(output))
            self.acc.init_trackers(Path(output).name, config=flat_settings(identity))

    def log(self, step: int, numbers: dict[str, float]) -> None:
        """Report one finished trial's numbers (nothing without trackers).

        Args:
            step: the trial's index.
            numbers: ``{name: value}`` (objective, PPL per length, parameters).
        """
        if self.acc is not None and numbers:
            self.acc.log(numbers, step=step)

    def close(self) -> None:
        """Flush and close the trackers (every way a search ends)."""
        if self.acc is not None:
            self.acc.end_training()
            self.acc = None

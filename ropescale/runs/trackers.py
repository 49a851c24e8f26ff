"""``report_to``: accelerate's experiment trackers (TensorBoard, W&B, MLflow, …) as every run kind
takes them — a fine-tuning run reports its loss, learning rate and held-out PPL, a parameter search
each finished trial.

- ``tracker_names``: the config's value checked when the config is read (a name or a list of
  accelerate's ``LoggerType`` names; one ``ValueError`` line naming the unknown one);
- ``check_installed``: every tracker installed, before anything is written (one ``ConfigError``
  line naming the package to install);
- ``flat_settings``: a run's identity as the flat scalar settings trackers take
  (``init_trackers(config=…)``).

The trackers themselves are accelerate's (``Accelerator(log_with=…, project_dir=…)``), started by the
run that reports to them. Where a run stands is never decided by them: ``report_to`` is left out of
every run's identity.
"""

from __future__ import annotations

import json
from typing import Any

from ropescale.runs.config import ConfigError

__all__ = ["check_installed", "flat_settings", "tracker_names"]


def tracker_names(value: Any) -> list[str]:
    """``report_to`` as a list of accelerate tracker names (a single name is a list of one).
    Raises ``ValueError`` (one line) for anything else, or a name accelerate does not know."""
    from accelerate.utils import LoggerType

    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"a tracker name or a list of them (accelerate's: tensorboard, wandb, ...); got {value!r}")
    known = sorted(t.value for t in LoggerType if t.value != "all")
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown tracker {bad[0]!r}; accelerate's trackers: {', '.join(known)}")
    return names


def check_installed(names: list[str], source: str) -> list[str]:
    """``names``, each installed; ``ConfigError`` (``SOURCE: report_to: NAME is not installed``, one
    line with the package to install) otherwise. Run before anything is written."""
    from accelerate.tracking import get_available_trackers

    available = {str(t.value if hasattr(t, "value") else t) for t in get_available_trackers()}
    missing = [t for t in names if t not in available]
    if missing:
        raise ConfigError(f"{source}: report_to: {missing[0]} is not installed (pip install {missing[0]}); "
                          f"installed trackers: {', '.join(sorted(available)) or 'none'}")
    return list(names)


def flat_settings(identity: dict[str, Any]) -> dict[str, Any]:
    """A run's identity as a tracker's settings: nested keys joined by dots (a strategy's ``params``
    kept whole), values that are not scalars as JSON, None left out."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and k != "params":
                walk(v, f"{prefix}{k}.")
            elif v is not None:
                out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)

    walk(identity, "")
    return out

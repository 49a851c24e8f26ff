"""Run any lm-evaluation-harness task on a ropescale-patched model.

Registers the model type ``ropescale`` with lm-eval (``pip install "ropescale[lm-eval]"``): an
``HFLM`` whose model is loaded with ``ropescale.load_model`` (bundled names, local paths, hub
ids) and patched with ``ropescale.patch``. ``model_args`` take the strategy, its parameters and
the patch options next to lm-eval's own ``HFLM`` arguments::

    ropescale lm-eval --model ropescale \\
        --model_args pretrained=reference,strategy=yarn,factor=8 --tasks TASK ...

lm-eval 0.4.13 finds models only in its own registry (it has no plugin entry points), so the
``ropescale`` model exists once this module is imported: the command above imports it and then
hands the arguments to lm-eval's own CLI unchanged (``main``); from Python, ``import eval.lmeval`` before
``lm_eval.simple_evaluate(model="ropescale", ...)``.

``max_length`` (lm-eval's context window for rolling perplexity and truncation) defaults to the reach
s × T of the strategy's scale factor s (its ``auto="scale"`` parameter, ``Strategy.scale_param``: YaRN's,
linear's, NTK's ``factor``, DCA's ``scale``), else to the model's own window (dynamic NTK has no fixed
reach: its ``factor`` is a slope, not a scale).

Bad ``model_args`` (no ``pretrained``, a model folder that is not there, an unknown strategy, key
or dtype, a parameter out of range or missing, a bad patch option) raise ``ModelArgsError`` (a
``ValueError``) in one line naming the key and what is allowed. ``main`` checks them, and the
``--include_path``, before lm-eval loads anything (lm-eval's CLI lets exceptions from a model's
constructor end in a traceback); ``ropescale lm-eval`` prints the line and exits 1.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import inspect
import io
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import ropescale
from ropescale.errors import RopescaleError
from ropescale.strategies import get_strategy

__all__ = ["ModelArgsError", "RopescaleLM", "check_model_args", "check_tasks", "main"]

_PATCH_OPTIONS = ("original_max_position_embeddings", "layer_types", "dynamic_cache", "dynamic_block", "logn",
                  "attention_path", "block_size")
_OWN = ("pretrained", "strategy", "dtype", "device", "max_length")
USAGE = ("ropescale lm-eval --model ropescale --model_args pretrained=reference,strategy=yarn,factor=8 "
         "--tasks TASK [--include_path DIR] [any lm_eval option] (--help: lm-eval's options)")


class ModelArgsError(RopescaleError, ValueError):
    """Bad ``model_args`` or lm-eval arguments, in one line."""


def _hflm_keys() -> list[str]:
    return [n for n, p in inspect.signature(HFLM.__init__).parameters.items()
            if n not in ("self", "pretrained") and p.kind is not p.VAR_KEYWORD]


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_model_args(args: dict[str, Any]) -> dict[str, Any]:
    """Check the ``ropescale`` model's arguments without loading the model: ``pretrained`` given
    and resolvable, the strategy known, every key known (the strategy's parameters, the patch
    options, ``dtype``/``device``/``max_length`` and ``HFLM``'s own), parameters in range and
    present, patch options of the right kind. Returns the validated strategy parameters.
    Raises ``ModelArgsError`` in one line."""
    from ropescale.models import DTYPES, MODEL_ALIASES, ModelLoadError, resolve_model
    from ropescale.patching import DYNAMIC_CACHE_MODES
    from ropescale.strategies import UnknownStrategyError

    def fail(msg: str) -> ModelArgsError:
        return ModelArgsError(f"model_args: {msg}")

    if args.get("pretrained") in (None, ""):
        raise fail(f"pretrained: missing; give pretrained=NAME (a bundled name: {', '.join(MODEL_ALIASES)}; "
                   "a local model folder; or a hub id)")
    try:
        resolve_model(str(args["pretrained"]))
    except (ModelLoadError, OSError) as e:
        raise fail(str(e)) from None
    name = args.get("strategy", "vanilla")
    try:
        strat = get_strategy(str(name))
    except UnknownStrategyError as e:
        raise fail(f"strategy: {e}") from None
    names = [p.name for p in strat.params]
    allowed = [*names, *_PATCH_OPTIONS, *_OWN]
    for key in args:
        if key not in allowed and key not in _hflm_keys():
            hint = difflib.get_close_matches(key, [*allowed, *_hflm_keys()], n=1)
            raise fail(f"{key}: unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                       + f"; allowed: {strat.name}'s parameters ({', '.join(names) or 'none'}), the patch options "
                       f"({', '.join(_PATCH_OPTIONS)}), {', '.join(_OWN[2:])} and HFLM's own arguments")
    try:
        params = strat.validate({k: args[k] for k in names if k in args})
    except ValueError as e:
        raise fail(str(e)) from None
    dtype = args.get("dtype", "float32")
    if dtype not in DTYPES:
        raise fail(f"dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    checks = {
        "original_max_position_embeddings": (lambda v: _whole(v, 2), "must be a whole number of tokens >= 2"),
        "dynamic_cache": (lambda v: v in DYNAMIC_CACHE_MODES, f"; choose one of {', '.join(DYNAMIC_CACHE_MODES)}"),
        "dynamic_block": (lambda v: _whole(v, 1), "must be a whole number >= 1"),
        "logn": (lambda v: isinstance(v, bool), "must be True or False"),
        "attention_path": (lambda v: v in ("fused", "flex", "blocked", "naive"),
                           "; choose one of fused, flex, blocked, naive"),
        "block_size": (lambda v: _whole(v, 1), "must be a whole number >= 1"),
        "max_length": (lambda v: v is None or _whole(v, 1), "must be a whole number of tokens >= 1"),
    }
    for key, (ok, what) in checks.items():
        if key in args and not ok(args[key]):
            raise fail(f"{key}={args[key]!r}{'' if what.startswith(';') else ' '}{what}")
    return params


@register_model("ropescale")
class RopescaleLM(HFLM):
    """lm-eval's ``HFLM`` over a model loaded and patched by ropescale."""

    def __init__(self, pretrained: str, strategy: str = "vanilla", dtype: str = "float32", device: str = "cpu",
                 max_length: int | None = None, **kwargs: Any):
        from ropescale.models import ModelLoadError
        from ropescale.rotary import NoRotaryEmbeddingError

        check_model_args({"pretrained": pretrained, "strategy": strategy, "dtype": dtype, "max_length": max_length,
                          **kwargs})
        strat = get_strategy(strategy)
        names = {p.name for p in strat.params}
        params = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _PATCH_OPTIONS}
        if isinstance(options.get("layer_types"), str):
            options["layer_types"] = options["layer_types"].split("|")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI asks for cuda by default; its own HFLM falls back to the CPU too
            logging.getLogger(__name__).warning("device %s is not available; running on the CPU", device)
            device = "cpu"
        try:  # what needs the model (a hub id offline, unreadable weights, layer types): one line too
            model, tokenizer = ropescale.load_model(str(pretrained), dtype=dtype, device=str(device))
            ropescale.unpatch(model)  # a saved patch would stack under this one
            handle = ropescale.patch(model, strategy, **options, **params)
        except (ModelLoadError, NoRotaryEmbeddingError, ValueError) as e:
            raise ModelArgsError(f"model_args: {e}") from None
        scale = handle.strategy_obj.scale_param
        if max_length is None and handle.params.get(scale) is not None:  # the reach s·T of its scale factor s
            max_length = int(handle.params[scale] * handle.context["original_max_position_embeddings"])
        self.patch_handle = handle
        super().__init__(pretrained=model, tokenizer=tokenizer, max_length=max_length, device=device, **kwargs)


def _task_list(tasks) -> list[str]:
    """``--tasks`` as lm-eval reads it (``EvaluatorConfig.process_tasks``): comma-separated names."""
    return tasks.split(",") if isinstance(tasks, str) else [t for task in tasks for t in task.split(",")]


def check_tasks(tasks, task_manager) -> None:
    """Every ``--tasks`` entry names what lm-eval can run (``process_tasks``'s rules): a task, group
    or tag lm-eval knows (or a pattern matching some), YAML files that exist, or — alone — a folder
    of YAML files. ``task_manager``: lm-eval's ``TaskManager``, or a function making one (called
    only when there are names to look up: it indexes every task YAML, seconds). Raises
    ``ModelArgsError`` in one line naming the unknown ones with their closest names (lm-eval
    raised ``ValueError: Tasks not found`` with a traceback)."""
    names = _task_list(tasks)
    if len(names) == 1 and Path(names[0]).is_dir():
        return  # a folder of task YAML files (or a registered task of that name)
    files = [n for n in names if n.endswith(".yaml") and not glob.glob(str(Path(n).absolute()))]
    if files:
        raise ModelArgsError(f"--tasks: no YAML file matches {', '.join(files)}")
    names = [n for n in names if not n.endswith(".yaml")]
    if not names:
        return
    manager = task_manager() if callable(task_manager) else task_manager
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise ModelArgsError(f"--tasks: no lm-eval task, group or tag named {'; '.join(hints)}; `ropescale lm-eval "
                             "ls tasks` lists them (--include_path DIR adds your own)")


def _check_run(namespace) -> None:
    """What ``lm-eval run`` would refuse late or with a traceback, refused before it loads anything.
    ``--tasks`` are checked against a ``TaskManager`` built as lm-eval's run builds its own (it
    indexes every task YAML: ~30 s on 2 cores, done twice for a run that goes on), or, first, one of the
    ``--include_path`` tasks alone (a fraction of a second), which settles a run of the user's own tasks."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a --config's settings; lm-eval does again
            cfg = EvaluatorConfig.from_cli(namespace)
    except (ValueError, TypeError, OSError) as e:
        raise ModelArgsError(" ".join(str(e).split())) from None
    if not cfg.tasks:  # lm-eval finds out after loading the model
        raise ModelArgsError("no --tasks; give --tasks TASK[,TASK ...] (`ropescale lm-eval ls tasks` lists them)")
    if cfg.include_path is not None:
        paths = cfg.include_path if isinstance(cfg.include_path, list) else [cfg.include_path]
        for p in paths:
            if not Path(p).exists():
                raise ModelArgsError(f"--include_path {p}: no such file or folder (give the folder of your task "
                                     "YAML files)")
    if cfg.model == "ropescale":
        check_model_args(dict(cfg.model_args or {}))
    if cfg.include_path is not None:  # the --include_path tasks alone first: lm-eval's own take ~30 s to index
        with contextlib.suppress(ModelArgsError):
            return check_tasks(cfg.tasks, lambda: TaskManager(include_path=cfg.include_path, include_defaults=False,
                                                              metadata=cfg.metadata or {}))
    check_tasks(cfg.tasks, lambda: TaskManager(include_path=cfg.include_path, metadata=cfg.metadata or {}))


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``ropescale`` model registered. Raises ``ModelArgsError``
    (one line) for no arguments, bad ``model_args``, a missing ``--include_path``, ``--tasks``
    lm-eval does not know (with the closest names) or arguments lm-eval's configuration refuses,
    before lm-eval loads a task or the model."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise ModelArgsError(f"no arguments; e.g. {USAGE}")
    sys.argv = [sys.argv[0], *args]
    setup_logging()  # as lm-eval's own cli_evaluate does
    parser = HarnessCLI()
    namespace = parser.parse_args()
    if getattr(namespace, "command", None) == "run":
        _check_run(namespace)
    parser.execute(namespace)

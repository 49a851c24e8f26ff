"""The harness: one task over every (strategy, length) cell, on the same examples, resumable.

The model is loaded once; the task builds its examples once per length (``eval.tasks``); each
strategy is patched in and removed in place per cell. Each
finished cell is appended to ``results.jsonl`` at once (flushed), so an interrupted run loses
at most the cell in progress and a rerun with the same output folder skips finished cells.
When the run ends, ``results.csv``, ``results.md`` and the task's plots are written from every
cell of the experiment in ``results.jsonl``: this run's and those earlier runs into the folder
computed (other lengths, other strategies).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from accelerate.utils import gather_object

from ropescale.errors import InvalidInput
from ropescale.models import resolve_device
from ropescale.runs.lifecycle import (
    RunInputs,
    check_strategy,
    configured_context,
    configured_window,
    load_run_model,
    loaded_window,
)
from ropescale.runs.manifest import record_patch
from ropescale.runs.memory import InsufficientMemoryError, check_fits
from ropescale.runs.processes import process_state
from ropescale.runs.protocol import RunFolder, RunKind, execute_run
from ropescale.strategies import get_strategy

from .cells import Bench, Cell
from .config import EvalConfig, StrategySpec, resolved_dtype
from .engines.scoring import DEFAULT, scoring_engine
from .report import write_reports
from .results import RESULTS, ResultsFileError, append_safely, read_results, rebuild_reports
from .schema import SCHEMA_VERSION
from .tasks.base import Task, get_task

# RESULTS, ResultsFileError, read_results, rebuild_reports: the results file (eval.results), importable here as before
__all__ = ["RESULTS", "ResultsFileError", "Sweep", "cell_id", "experiment_fields", "read_results", "rebuild_reports",
           "resolve_cells", "run_sweep"]

def cell_id(experiment: str, spec: StrategySpec, length: int) -> str:
    """Stable id of a cell: the experiment's identity hash (task, options, model weights, data
    tokens, dtype, library versions: ``ropescale.runs.manifest``) with the strategy and length, hashed."""
    key = {"experiment": experiment, "strategy": spec.name, "params": spec.params, "logn": spec.logn,
           **({"temperature": spec.temperature} if spec.temperature else {}),
           **({"profiles": spec.profiles} if spec.profiles else {}), "length": length}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def experiment_fields(cfg: EvalConfig, uses_data: bool) -> dict:
    """A sweep's own part of its identity (``ropescale.runs.lifecycle.run_identity`` adds the
    weights, data tokens and versions): task and options, model, data source, dtype, T override,
    and the engine when it is not transformers (its cells are another experiment; folders from
    before the key resume)."""
    return {"task": cfg.task, "options": cfg.options.key(), "model": cfg.model,
            "data": cfg.data.spec().describe() if uses_data else None, "dtype": cfg.dtype,
            "original_max_position_embeddings": cfg.original_max_position_embeddings,
            **({"engine": cfg.engine} if cfg.engine != DEFAULT else {})}


def resolve_cells(cfg: EvalConfig, train_length: int) -> dict[tuple[str, int], dict]:
    """Every cell's strategy parameters, ``{(strategy display name, length): params}``, checked in
    full before any cell runs: ``Strategy.resolve`` at each length L for the training window T =
    ``train_length`` — the auto-filled ones (``factor`` = max(1, L / T), DCA's ``scale``) and the
    cross-checks a strategy makes with the window (DCA's local_window < chunk_size, STRING's
    W < S, with their defaults: T-derived, or DCA's from the model's ``dual_chunk_attention_config``,
    read from its config). Raises ``InvalidInput`` in one line naming the cell."""
    out = {}
    context = configured_context(cfg.model)
    for length in cfg.lengths:
        for spec in cfg.strategies:
            try:
                out[spec.display, length] = spec.resolve(length=length, train_length=train_length, context=context)
            except ValueError as e:
                raise InvalidInput(f"strategy {spec.display} at length {length} (training window T = "
                                   f"{train_length}): {' '.join(str(e).split())}") from None
    return out


def _check_not_stale(done: dict[str, dict], grid: list, resolved: dict, results_path) -> None:
    """A cell's id hashes the parameters the user gave, not the defaults they resolve to: a finished cell
    whose recorded parameters differ from what its strategy resolves to now (a default changed since) is
    refused in one line, never reused as this cell's numbers. Raises ``InvalidInput``."""
    for spec, length, cid in grid:
        record = done.get(cid)
        if record is None or "params" not in record:
            continue
        now = json.loads(json.dumps(resolved[spec.display, length], default=str))
        if json.dumps(record["params"], sort_keys=True) != json.dumps(now, sort_keys=True):
            raise InvalidInput(f"{results_path}: {spec.display} at {length} was measured with {record['params']}; "
                               f"it now resolves to {now} (a default changed): write to a new output folder, or give "
                               "the recorded parameters")


def _check_output(model, cell: Cell) -> str | None:
    """The cell's strategy computed on ``model`` as the cell will patch it (``check_strategy``): a strategy
    whose output is not frequencies (NaN, a wrong shape, a list, a NaN attention factor) is refused
    before the manifest is written — a refused run leaves no folder — in one line naming the cell. Returns
    the rotation's fingerprint (``rotation_fingerprint``; None where the cell must run whatever it is)."""
    spec = cell.spec
    try:
        return check_strategy(model, spec.name, length=cell.length, original_max_position_embeddings=cell.train_length,
                              logn=spec.logn, temperature=spec.temperature, **cell.params)
    except InvalidInput as e:
        if type(e) is not InvalidInput:  # a refusal of its own kind (the model's attention, ...) as it is
            raise
        raise InvalidInput(f"strategy {spec.display} at length {cell.length} (training window T = "
                           f"{cell.train_length}): {' '.join(str(e).split())}") from None


def _note(spec: StrategySpec, params: dict, length: int, train_length: int, context: dict | None) -> str | None:
    """Why the cell equals vanilla RoPE by construction, or None: a relative-position rule that is vanilla for
    every distance below w (``Strategy.exact_below``, read from the rule it builds, not from a parameter's name)
    with w ≥ L, and no query temperature on top."""
    if spec.logn or spec.temperature:
        return None
    w = get_strategy(spec.name).exact_below(params, train_length=train_length, context=context)
    if w is None or w < length:
        return None
    return (f"every distance below {w} is plain RoPE under this rule and the sequence holds {length} tokens: "
            "the rule never applies at this length, so this cell equals vanilla RoPE")


def _score_cell(cell: Cell, examples, bench: Bench) -> dict:
    """Patch, measure this process's share of the examples (or hand the cell to its scoring engine), gather
    the parts, combine, unpatch; the cell's record (without id and environment)."""
    cfg, spec, length = bench.cfg, cell.spec, cell.length
    if cell.note:
        logging.getLogger("ropescale").warning("%s: %s", cell.where, cell.note)
    t0 = time.perf_counter()
    scorer = scoring_engine(cfg.engine)
    engine = {"engine": scorer.name, "engine_version": scorer.version()} if scorer.in_process else {}
    try:
        if not scorer.in_process:  # the engine scores the cell from the task's requests (eval.engines.scoring)
            result = scorer.score_cell(cell, examples, bench)
        else:
            result = _measure(cell, examples, bench)
    except (RuntimeError, MemoryError) as e:
        if not _out_of_memory(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InsufficientMemoryError(
            f"{cell.where}: out of memory on {bench.device} ({first}); the cells finished before it are "
            f"saved, so a rerun resumes: drop length {length} and longer from lengths, or use a device with more "
            "memory") from None
    seconds = time.perf_counter() - t0
    return {"task": cfg.task, "strategy": spec.display, "name": spec.name, "params": cell.params, "logn": spec.logn,
            **({"temperature": spec.temperature} if spec.temperature else {}), "length": length,
            "train_length": cell.train_length, "model": cfg.model,
            "data": cfg.data.spec().describe() if bench.task.uses_data else None, "options": cfg.options.key(),
            "dtype": cfg.dtype, "device": str(bench.device), **engine, **result,
            **({"note": cell.note} if cell.note else {}), "seconds": round(seconds, 3)}


def _measure(cell: Cell, examples, bench: Bench) -> dict:
    """The transformers engine: this process's share measured on the patched model, the parts
    gathered and combined; what the patch does per layer goes to the manifest (``record_patch``)."""
    state, task = bench.state, bench.task
    strat = get_strategy(cell.spec.name)
    share = list(range(state.process_index, len(examples), state.num_processes))
    with cell.patch(bench.model) as handle:
        if state.is_main_process:
            record_patch(bench.output, cell.spec.display, handle.report())
        part = task.measure(bench.model, examples, share, length=cell.length, strategy=strat, device=bench.device,
                            desc=cell.where if bench.progress else None)
    parts = gather_object([part]) if state.num_processes > 1 else [part]
    return task.combine(parts, examples, length=cell.length, strategy=strat)


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's out-of-memory error (CUDA, CPU, MPS), which the estimate
    (``_check_memory``, a lower bound) let through."""
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def _check_memory(task: Task, model, lengths: list[int], device) -> None:
    """Refuse, before building any example, the first length whose estimated memory
    (``Task.memory``) cannot fit: one line naming the estimate and the free memory. ``device``
    None (a model spread over devices by ``device_map``): only the host's share is checked. Every
    length's examples are built before the first cell and held to the end, so the host's share
    adds up over the lengths; the device holds one cell at a time."""
    held = 0  # host bytes of the shorter lengths' examples
    for i, length in enumerate(lengths):
        need = task.memory(length, model)
        if need is None:
            continue
        own = sum(need.host.values())
        if held:
            need.host["examples of shorter lengths"] = held
        held += own
        longer = f" (and {len(lengths) - i - 1} longer)" if i < len(lengths) - 1 else ""
        check_fits(need, device, hint=f"drop length {length}{longer} from lengths, or run on a device with more memory")


def _report_records(records: list[dict], done, experiment: str) -> list[dict]:
    """What the folder's reports show: this run's ``records`` (in their order), then every other record of
    the experiment in ``results.jsonl`` (``done``, in file order: cells of earlier runs into the folder,
    other lengths or strategies) — one per (strategy, length), a table having one place for it: this run's
    record, else the latest."""
    shown = {(r["strategy"], r["length"]) for r in records}
    earlier: dict[tuple[str, int], dict] = {}
    for r in done:
        key = (r["strategy"], r["length"])
        if r.get("experiment") == experiment and key not in shown:
            earlier[key] = r
    return records + list(earlier.values())


def _headline(task: type[Task], record: dict) -> str:
    m = task.metrics[0]
    return f"{m.label} {'—' if record[m.key] is None else m.fmt.format(record[m.key])}"


def run_sweep(cfg: EvalConfig, output: str | Path, *, progress: bool = True) -> list[dict]:
    """Run (or resume) an experiment: its task over strategies × lengths.

    Launched with ``accelerate launch`` (several GPUs or nodes, or CPU processes with gloo), every
    process measures its share of each cell's examples, the parts are gathered, and only the main
    process writes: the records equal a single-process run's. A refused run leaves no folder
    behind (``ropescale.runs.protocol``).

    Args:
        cfg: the experiment (``EvalConfig``).
        output: its folder (``results.jsonl``, appended cell by cell: a rerun skips finished cells).
        progress: print each cell and the task's progress bars (the main process of a launch only).

    Returns:
        This experiment's records (``eval.schema.Record``) in (length, strategy) order.

    Raises:
        ropescale.errors.InvalidInput: strategy parameters that fail at one of the lengths
            (``resolve_cells``), before the output folder is created; a strategy whose output on the
            model is not frequencies (NaN, a wrong shape, a list), before the manifest: no folder left.
        ropescale.runs.data.DataError: data that cannot be read or is too short (``ValueError``
            subclasses also for a length that cannot hold the task's prompts), before any cell runs.
        ropescale.rotary.NoRotaryEmbeddingError: a model without RoPE.
        ropescale.runs.manifest.ExperimentMismatchError: the folder holds another experiment.
    """
    return execute_run(Sweep(cfg, progress=progress), output)


def _same_as(record: dict, cell: Cell) -> dict:
    """``record``'s numbers as the record of ``cell``, whose patch rotates bit for bit as ``record``'s did
    (``rotation_fingerprint``), with ``same_as`` naming the measured cell."""
    spec = cell.spec
    out = {k: v for k, v in record.items() if k not in ("temperature", "note", "same_as")}
    return {**out, "cell": cell.id, "strategy": spec.display, "name": spec.name, "params": cell.params,
            "logn": spec.logn, **({"temperature": spec.temperature} if spec.temperature else {}),
            "same_as": record.get("same_as") or record["strategy"], "seconds": 0.0}


def _resolved_cell(model, spec: StrategySpec, length: int, cid: str, params: dict, train_length: int,
                   context: dict | None) -> Cell:
    """The cell of ``spec`` at ``length`` with its resolved ``params``, its note and its rotation's
    fingerprint on ``model`` (``_check_output``: a strategy whose output is not frequencies refused here)."""
    cell = Cell(spec=spec, length=length, id=cid, params=params, train_length=train_length,
                note=_note(spec, params, length, train_length, context))
    return replace(cell, rotation=_check_output(model, cell))


class Sweep(RunKind):
    """The sweep as a run kind (``ropescale.runs.protocol``): its identity is the task, options,
    model, data and dtype (``experiment_fields``); its preparation the finished cells read back,
    then — when a cell is left — the model, T, the task's examples of every length and the memory
    check; its execution the cells, each appended as it finishes, then the reports."""

    def __init__(self, cfg: EvalConfig, *, progress: bool = True):
        # cpu=True makes processes started by torchrun (`accelerate launch --multi_gpu` on a machine
        # without GPUs) one gloo group; without it each would measure every example and write alone. The
        # group is the process's: set up by its first run, kept for the next (a fine-tuning run's
        # after-training evaluations run here on its group), closed at exit (ropescale.runs.processes)
        self.state = state = process_state(cpu=resolve_device(cfg.device).type == "cpu")
        # a device that is not there fails before any work; launched processes take their own
        self.device = state.device if state.num_processes > 1 and cfg.device == "auto" else resolve_device(cfg.device)
        self.cfg = cfg.model_copy(update={"dtype": resolved_dtype(cfg.dtype, self.device)})  # recorded resolved
        self.task_cls = get_task(cfg.task)
        self.progress = progress and state.is_main_process
        self.todo: list[Cell] = []  # the cells left to score, resolved in prepare
        self.configured: dict | None = None  # each cell's parameters at the config's T (check), for the stale check

    def check(self) -> None:
        cfg = self.cfg
        # what the scoring engine cannot do is refused before anything loads or is written
        scoring_engine(cfg.engine).check(cfg, processes=self.state.num_processes)
        # T as the model's config gives it (no weights loaded): every cell's parameters first
        train_length = configured_window(cfg.model, cfg.original_max_position_embeddings, missing_ok=True)
        self.configured = resolve_cells(cfg, train_length) if train_length else None  # kept for prepare's stale check

    def data(self):
        return self.cfg.data.spec() if self.task_cls.uses_data else None

    def identity(self, inputs: RunInputs):
        return experiment_fields(self.cfg, self.task_cls.uses_data), inputs.docs

    def prepare(self, inputs: RunInputs, folder: RunFolder) -> None:
        cfg, results_path = self.cfg, folder.path / RESULTS
        self.done = {r["cell"]: r for r in read_results(results_path) if "cell" in r}
        self.grid = [(spec, length, cell_id(folder.experiment, spec, length))  # every cell's id, in record order
                     for length in cfg.lengths for spec in cfg.strategies]
        if self.configured is not None:  # the check's cells, at the config's T
            _check_not_stale(self.done, self.grid, self.configured, results_path)
        left = [g for g in self.grid if g[2] not in self.done]
        if self.progress and len(left) < len(self.grid):
            print(f"resuming: {len(self.grid) - len(left)} of {len(self.grid)} cells already in {results_path}")
        if not left:
            return
        # a patch saved with the model is removed: it would stack under the sweep's strategies
        model = load_run_model(cfg.model, inputs, dtype=cfg.dtype, device=str(self.device),
                               device_map=cfg.device_map, local_attention=True)
        if cfg.device_map:
            self.device = model.get_input_embeddings().weight.device  # inputs go where the embeddings are
        train_length = loaded_window(model, cfg.model, cfg.original_max_position_embeddings, purpose="sweep")
        resolved = resolve_cells(cfg, train_length)  # the loaded model's T: each cell's parameters, once
        # each cell's strategy output on this model, before the manifest; its rotation's fingerprint
        context = configured_context(cfg.model)  # DCA's defaults from the model's config, as resolve read them
        self.todo = [_resolved_cell(model, spec, length, cid, resolved[spec.display, length], train_length, context)
                     for spec, length, cid in left]
        task = self.task_cls(cfg.options, tokenizer=inputs.tokenizer, train_length=train_length, documents=inputs.docs,
                             source=cfg.data.spec().describe() if self.task_cls.uses_data else None)
        self.bench = Bench(cfg=cfg, task=task, model=model, device=self.device, output=folder.path, state=self.state,
                           progress=self.progress)
        lengths = sorted({c.length for c in self.todo})
        _check_memory(task, model, lengths, None if cfg.device_map else self.device)
        # build every length's examples first: data or lengths that cannot work fail before any cell runs
        self.examples = {length: task.examples(length) for length in lengths}

    def _same_rotation(self, cell: Cell) -> dict | None:
        """A finished cell of this experiment at ``cell``'s length whose patch rotates as ``cell``'s does."""
        if cell.rotation is None:
            return None
        return next((r for r in self.done.values()
                     if r.get("length") == cell.length and r.get("rotation") == cell.rotation
                     and r.get("experiment", self.experiment) == self.experiment), None)

    def _record(self, cell: Cell) -> dict:
        """The cell's record: a finished cell's numbers when ``cell`` rotates bit for bit as it does, else
        the cell scored (``_score_cell``)."""
        same = self._same_rotation(cell)
        if same is not None:  # a cell that rotates bit for bit as one measured: its numbers, not rerun
            return _same_as(same, cell)
        return {"schema": SCHEMA_VERSION, "cell": cell.id, "experiment": self.experiment,
                **_score_cell(cell, self.examples[cell.length], self.bench),
                **({"rotation": cell.rotation} if cell.rotation else {}), "env": self.env}

    def execute(self, folder: RunFolder) -> list[dict]:
        state, done = self.state, self.done
        self.experiment = folder.experiment
        if self.todo:
            with append_safely(folder.path / RESULTS) if state.is_main_process else nullcontext() as sink:
                for cell in self.todo:
                    record = self._record(cell)
                    if sink is not None:
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()  # written as it completes: a rerun resumes from here
                    done[cell.id] = record
                    if self.progress:
                        print(f"{cell.spec.display:>24} @ {cell.length:>6}: {_headline(self.task_cls, record)} "
                              f"({record['seconds']:.1f}s)", flush=True)
        records = [done[cid] for _, _, cid in self.grid]
        if state.is_main_process:
            write_reports(_report_records(records, done.values(), folder.experiment), folder.path)
        state.wait_for_everyone()
        return records

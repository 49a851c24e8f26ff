"""What each ``ropescale`` command does, once ``cli.py`` has parsed its options.

``cli.py`` declares the commands and their options (click) and calls one function here per command;
these run the library and the harness and print the result. Every user error is a ``RopescaleError``
(one line, exit 1: ``cli.RopescaleGroup``). Imports are inside the functions, so ``ropescale --help``
loads neither torch nor transformers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ropescale.errors import InvalidInput, RopescaleError

__all__ = ["PERPLEXITY_FLAGS", "base_bound", "compare", "conformance", "engine_name", "evaluate", "finetune", "inspect",
           "layer_table", "list_strategies", "list_tasks", "lm_eval", "parity", "patch", "plot", "reference_card",
           "reference_train", "scoring_engines", "search", "serving_engines", "strategy"]

# the perplexity task's own flags (its options at a config's top level), on `eval` and its alias `sweep`
PERPLEXITY_FLAGS = {"mode": "--mode", "stride": "--stride", "max_windows": "--max-windows",
                    "batch_size": "--batch-size", "dynamic_block": "--dynamic-block"}


def strategy(spec: str):
    """``NAME[:k=v,...]`` from the command line → ``StrategySpec``; ``parse_strategy`` signals a
    bad spec (unknown name, parameter out of range) with a one-line ``ValueError``."""
    from ropescale.runs.config import parse_strategy

    try:
        return parse_strategy(spec)
    except RopescaleError:
        raise
    except ValueError as e:
        raise InvalidInput(str(e)) from None


def serving_engines() -> list[str]:
    """The registered serving engines' names (``ropescale.serving.engines``), for ``patch --engine``."""
    from ropescale.serving.engines import engine_names

    return engine_names()


def scoring_engines() -> list[str]:
    """The registered scoring engines' names (``eval.engines.scoring``), for ``eval --engine``."""
    from .engines.scoring import scoring_engine_names

    return scoring_engine_names()


def engine_name(value: str) -> str:
    """An engine's one name for ``value``: an old name (``gguf``) with a note on stderr."""
    from ropescale.serving.engines import ALIASES

    if value in ALIASES:
        click.echo(f"Warning: engine {value!r} is deprecated; use {ALIASES[value]!r}", err=True)
        return ALIASES[value]
    return value


def _no_progress_bars() -> None:
    """``-q`` on commands whose only progress output is transformers' loading bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def list_strategies() -> None:
    """``ropescale strategies``: every strategy, its parameters (with defaults) and its source."""
    from ropescale.strategies import REGISTRY, strategy_names

    for name in strategy_names():
        s = REGISTRY[name]
        click.secho(name, bold=True, nl=False)
        click.echo(f"  [{s.kind}{', dynamic' if s.dynamic else ''}]  {s.summary}")
        for p in s.params:
            default = ("required" if p.required else f"default {p.default}")
            if p.auto:
                default += f"; sweep: {p.auto_text}"
            click.echo(f"    {p.name} ({p.kind.__name__}, {p.range_text()}; {default}) {p.help}")
        click.echo(f"    source: {s.source}")


def list_tasks() -> None:
    """``ropescale tasks``: every evaluation task, its metrics and options."""
    from .tasks import get_task, task_names

    for name in task_names():
        t = get_task(name)
        click.secho(name, bold=True, nl=False)
        click.echo(f"  {t.summary()}" + ("  [reads data]" if t.uses_data else ""))
        click.echo("    metrics: " + ", ".join(f"{m.key} ({'higher' if m.higher_is_better else 'lower'} is better)"
                                           for m in t.metrics))
        for key, field in t.Options.model_fields.items():
            click.echo(f"    {name}.{key} (default {field.default!r}) {field.description or ''}".rstrip())


def _run(config, overrides, output, flags: dict, quiet: bool, *, only_task: str | None = None) -> None:
    from ropescale.runs.config import ConfigError, load_raw

    from .config import build_config
    from .report import markdown_report
    from .sweep import run_sweep

    raw, source = load_raw(config, overrides, flags)
    if only_task and raw.get("task", only_task) != only_task:
        raise ConfigError(f"{source}: task is {raw['task']!r}; `ropescale sweep` and the perplexity flags "
                          f"({', '.join(PERPLEXITY_FLAGS.values())}) run perplexity only: "
                          f"use `ropescale eval{' ' + config if config else ''}` without them")
    cfg = build_config(raw, source)
    out = output or cfg.output
    if not out:
        raise ConfigError(f"{source}: output: no results folder; give --output DIR or set output:")
    records = run_sweep(cfg, out, progress=not quiet)
    click.echo(markdown_report(records))
    click.echo(f"results in {out}/ (results.jsonl, results.csv, results.md and plots)")


def evaluate(task: str | None, config, overrides, output, model, data, strategy_specs, lengths, device, device_map,
             dtype, quiet, engine, mode, stride, max_windows, batch_size, dynamic_block, *,
             perplexity_only: bool = False) -> None:
    """`eval` (``task``: ``--task``, ``None`` when not given) and `sweep` (``perplexity_only``: the
    config's task must be perplexity): the flags over the config, then the run."""
    perplexity = {"mode": mode, "stride": stride, "max_windows": max_windows, "batch_size": batch_size,
                  "dynamic_block": dynamic_block}
    given = [PERPLEXITY_FLAGS[k] for k, v in perplexity.items() if v is not None]
    if given and task not in (None, "perplexity"):
        raise InvalidInput(f"{', '.join(given)}: the perplexity task's flags; --task {task} takes its options "
                           f"with --set {task}.KEY=VALUE")
    flags = {"task": task, "model": model, "data": data, "lengths": lengths, "device": device, "dtype": dtype,
             "device_map": device_map, "engine": engine, **perplexity, "strategies": list(strategy_specs) or None}
    perplexity_only = perplexity_only or (bool(given) and task is None)  # the config's task must take them
    _run(config, overrides, output, flags, quiet, only_task="perplexity" if perplexity_only else None)


def finetune(config, overrides, output, model, strategy_spec, data, length, steps, device, quiet) -> None:
    """``ropescale finetune``: the flags over the config, the run, then (main process) its report."""
    from ropescale.runs.config import ConfigError
    from ropescale.training import load_finetune_config

    from .finetune import run_finetune
    from .report import markdown_report

    flags = {"model": model, "strategy": strategy_spec, "data": data, "length": length, "steps": steps,
             "device": device}
    cfg = load_finetune_config(config, list(overrides), flags)
    out = output or cfg.output
    if not out:
        raise ConfigError(f"{config or 'flags'}: output: no run folder; give --output DIR or set output:")
    summary = run_finetune(cfg, out, progress=not quiet, source=config or "flags")
    if not summary["main_process"]:
        return  # launched on several processes: the main one reports
    for records in summary["evaluations"].values():
        click.echo(markdown_report(records))
    ppl = summary.get("ppl") or {}
    click.echo(f"fine-tuned {summary['label']} for {summary['steps']} steps (final loss {summary['final_loss']:.3f}"
               + (", held-out PPL " + ", ".join(f"{k}: {v:.2f}" for k, v in ppl.items()) if ppl else "")
               + f"); model in {summary['model']}")


def search(config, overrides, output, device, quiet) -> None:
    """``ropescale search``: the config (and ``--set``), the search, its best candidate."""
    from ropescale.runs.config import ConfigError, load_raw

    from .search.config import build_search_config
    from .search.run import run_search

    raw, source = load_raw(config, overrides, {"device": device})
    cfg = build_search_config(raw, source)
    out = output or cfg.output
    if not out:
        raise ConfigError(f"{config}: output: no search folder; give --output DIR or set output:")
    best = run_search(cfg, out, progress=not quiet)
    ppl = ", ".join(f"@{k} {v:.3f}" for k, v in best["ppl"].items())
    click.echo(f"best of {best['evaluations']} candidates: {best['spec']} (objective {best['objective']:.4f}, "
               f"PPL {ppl}, PPL@T {best['ppl_train']:.3f}{'' if best['feasible'] else ', infeasible'})")
    click.echo(f"results in {out}/ (best.json, trials.csv, results.md, search.png)")


def layer_table(rows: list[dict]) -> str:
    """``PatchHandle.report()`` as a text table, one line per attention layer."""
    if not rows:
        return "(the model's attention layers could not be observed: no per-layer report)"
    cols = [("layer", "layer"), ("rope", "rope"), ("rope_type", "rope type"), ("rope_theta", "θ"),
            ("rotary_dim", "dim"), ("layout", "layout"), ("original_max_position_embeddings", "T"),
            ("applied", "applied"), ("temperature", "temperature")]
    cells = [[h for _, h in cols]] + [["" if r.get(k) is None else f"{r[k]:g}" if isinstance(r.get(k), float)
                                        else str(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def _loaded(model, spec, device):
    """The model for ``patch`` with ``spec``, unpatched: a strategy keeping the model's own rotation starts
    from the folder as plain transformers serves it."""
    import ropescale
    from ropescale.strategies import REGISTRY

    m, tok = ropescale.load_model(model, device=device, served=REGISTRY.lookup(spec.name).keeps_model)
    ropescale.unpatch(m)
    return m, tok


def _profile_factors(spec, profiles: str, serve_length, freeze_dynamic_at) -> list[float]:
    """``--profiles``' factors, sorted, once the options it leaves out are checked (one line each)."""
    from ropescale.runs.profiles import check_factors
    from ropescale.strategies import get_strategy

    if serve_length is not None or freeze_dynamic_at is not None:
        raise InvalidInput("--profiles: each profile serves its own reach (s·T tokens); leave --serve-length and "
                           "--freeze-dynamic-at out")
    try:
        factors = check_factors([float(x) for x in profiles.split(",")], "--profiles")
    except ValueError as e:  # a word where a number is meant (InvalidInput is a ValueError: kept as it is)
        raise e if isinstance(e, InvalidInput) else InvalidInput(
            f"--profiles: {profiles!r} is not a comma-separated list of scale factors (e.g. 1,2,4)") from None
    strat = get_strategy(spec.name)
    scale = strat.scale_param if strat.kind == "frequency" and not strat.dynamic else None  # what profiles set
    if spec.profiles or (scale is not None and scale in spec.params):
        raise InvalidInput(f"--profiles gives the factors; leave {scale or 'factor'} (and profiles) out of "
                           "--strategy")
    return factors


def _patch_profiles(model, spec, profiles: str, output, dry_run, engine, serve_length, gguf_path, freeze_dynamic_at,
                    device, **options) -> None:
    """``patch --profiles``: every check that needs no model first, then every profile checked (its reach, what
    ``engine`` can express), then one export per factor — or, with ``dry_run``, each profile's table."""
    from ropescale.models import resolve_model
    from ropescale.runs.profiles import factor_text
    from ropescale.serving.export import check_export
    from ropescale.serving.profiles import PROFILES_FILE, export_profiles, plan_profiles

    factors = _profile_factors(spec, profiles, serve_length, freeze_dynamic_at)
    if not dry_run:
        source = Path(resolve_model(model))
        check_export(engine, 2, output, gguf=gguf_path, source=source if source.is_dir() else None)
    m, tok = _loaded(model, spec, device)
    patch_options = {**options, "logn": spec.logn, "temperature": spec.temperature}
    if dry_run:
        plans = plan_profiles(m, spec.name, factors, engine, patch_options=patch_options, **spec.params)
        for p in plans:
            click.echo(f"{spec.display} ×{factor_text(p.factor)} on {model}: {p.folder}, serves {p.reach} tokens "
                       f"for {engine} (dry run: nothing written)")
            click.echo(layer_table(p.layers))
        return
    results = export_profiles(m, spec.name, factors, engine, output, tokenizer=tok, gguf=gguf_path,
                              patch_options=patch_options, **spec.params)
    for f, result in zip(factors, results):
        click.echo(f"saved {spec.display} ×{factor_text(f)} for {engine} (serves {result.serve_length} tokens) to "
                   f"{result.path}")
    click.echo(f"the rule: {Path(output) / PROFILES_FILE} (ropescale.serving.profiles.select_profile)")


def patch(model, strategy_spec, output, dry_run, original_max_position_embeddings, layer_types, dynamic_cache,
          dynamic_block, engine, serve_length, gguf_path, freeze_dynamic_at, profiles, device, quiet) -> None:
    """``ropescale patch``: a dry run's per-layer table, request-length profiles (each profile's table with
    ``dry_run``), or one export for ``engine`` (what needs no model is refused before the model loads). The
    strategy spec's log-n and query temperature are patched with it on every path."""
    import ropescale

    if quiet:
        _no_progress_bars()
    if output is None and not dry_run:
        raise InvalidInput("patch needs --output (the folder to write), or --dry-run")
    spec = strategy(strategy_spec)
    options = {"original_max_position_embeddings": original_max_position_embeddings,
               "layer_types": layer_types.split(",") if layer_types else None, "dynamic_cache": dynamic_cache,
               "dynamic_block": dynamic_block}
    if profiles is not None:
        _patch_profiles(model, spec, profiles, output, dry_run, engine, serve_length, gguf_path, freeze_dynamic_at,
                        device, **options)
        return
    if not dry_run:
        from ropescale.models import resolve_model
        from ropescale.serving.export import check_export

        source = Path(resolve_model(model))
        # what needs no model is refused before loading it (export_for checks it all again)
        check_export(engine, serve_length, output, gguf=gguf_path, freeze_dynamic_at=freeze_dynamic_at,
                     source=source if source.is_dir() else None)
    m, tok = _loaded(model, spec, device)
    handle = ropescale.patch(m, spec.name, logn=spec.logn, temperature=spec.temperature, **options, **spec.params)
    if dry_run:
        click.echo(f"{spec.display} on {model} (dry run: nothing written)")
        click.echo(layer_table(handle.report()))
        return
    result = ropescale.export_for(m, engine, serve_length, output, tokenizer=tok, gguf=gguf_path,
                                  freeze_dynamic_at=freeze_dynamic_at)
    click.echo(f"saved {spec.display} patch of {model} for {engine} to {result.path}")
    for note in result.notes:
        click.echo(f"  {note}")
    if result.usage:
        click.echo(result.usage)


def inspect(model, head_dim, rope_theta, original_max_position_embeddings, strategy_specs, length, pairs, attention,
            data, output, device, quiet) -> None:
    """``ropescale inspect``: the rotary geometry's figures and summary; with a model, its per-layer tables."""
    from .inspect import attention_input, inspected_model, rotary_config, summary_text
    from .inspect import inspect as run_inspect

    specs = [strategy(s) for s in strategy_specs]
    cfg = rotary_config(model, head_dim, rope_theta, original_max_position_embeddings)
    if model and quiet:
        _no_progress_bars()
    extra = attention_input(model, specs, data, length, device=device) if attention else None
    load = None if not model else (lambda: extra["model"]) if extra else (lambda: inspected_model(model, device)[0])
    summary = run_inspect(cfg, specs, length, output, pairs=list(pairs) or None, attention=extra, load_model=load)
    click.echo(summary_text(summary, output), nl=False)
    for display, rows in summary.get("layers", {}).items():
        if isinstance(rows, dict):
            click.echo(f"{display} on {model}: refused: {rows['refused']}")
        else:
            click.echo(f"{display} on {model}, per layer:")
            click.echo(layer_table(rows))


def base_bound(dims: list[int], lengths: list[int]) -> None:
    """``ropescale base-bound``: the table, with the paper's power-law fit when d = 128 is asked for."""
    from .inspect import base_bound_table

    click.echo(base_bound_table(dims, lengths, paper_fit=128 in dims), nl=False)


def compare(runs: list[Path], length: int, output: Path, title: str, at: list[int], before: list[Path]) -> None:
    """``ropescale compare``: the figure is checked writable first, then the runs are read and compared."""
    from .compare import compare as compare_runs
    from .compare import read_runs
    from .writable import check_figure

    check_figure(output, f"-o {output}")  # a figure it cannot save or write: one line, before reading the runs
    # a folder that is not a run, a length it has no PPL at: InvalidInput, one line and exit 1 as everywhere
    records = read_runs(runs, length, before)
    click.echo(compare_runs(records, runs, length, output, title=title, at=at, before=before))
    click.echo(f"\nfigure: {output}")


def lm_eval(args: list[str]) -> None:
    """``ropescale lm-eval``: lm-evaluation-harness's own command line with the ``ropescale`` model."""
    try:
        from .lmeval import ModelArgsError
        from .lmeval import main as lm_eval_main
    except ImportError as e:
        if not (e.name or "").startswith("lm_eval"):
            raise  # not the optional dependency missing: a bug
        raise click.ClickException(f"lm-eval is not installed ({e}); pip install 'ropescale[lm-eval]'") from None
    try:
        lm_eval_main(args)
    except ModelArgsError as e:  # bad model_args, no arguments, a missing --include_path: one line, named
        raise ModelArgsError(f"lm-eval: {e}") from None


def plot(results, output) -> None:
    """``ropescale plot``: results.csv/md and the plots rebuilt from a results.jsonl."""
    from .results import rebuild_reports

    for kind, p in rebuild_reports(results, output).items():
        click.echo(f"{kind}: {p}")


def reference_train(**options: Any) -> None:
    """``ropescale reference train``."""
    from .reference.train import train

    train(**options)


def reference_card(model: Path, threads: int, plot: Path | None) -> None:
    """``ropescale reference card``: the figures, printed as JSON."""
    import json

    from .reference.card import write_card

    click.echo(json.dumps(write_card(model, threads=threads, plot=plot), indent=1))


def parity(model, strategy_specs, lengths, engine_list, end_to_end, data, windows, freeze_dynamic, gguf_path,
           baseline, output, device, quiet) -> None:
    """``ropescale parity``: one row per engine × strategy × length, printed and written to ``output``."""
    from .parity import run_parity, write_parity

    specs = [strategy(s) for s in strategy_specs]
    engines = [engine_name(e.strip()) for e in engine_list.split(",") if e.strip()]
    say = (lambda m: click.echo(m, err=True)) if not quiet and sys.stderr.isatty() else None
    rows, meta = run_parity(model, specs, list(lengths), engines=engines, end_to_end=end_to_end, data=data,
                            windows=windows, output=output, freeze_dynamic=freeze_dynamic, gguf=gguf_path,
                            baseline=baseline, say=say, device=device)
    paths = write_parity(rows, output, meta)
    for r in rows:
        e2e = "" if r.max_abs_dlogp is None else f"  max|Δlog p| {r.max_abs_dlogp:.2g}"
        base = "" if r.exported_by == "ropescale" else " [as written]"
        click.echo(f"{r.engine:<9} {r.strategy + base:<32} L={r.length:<6} {r.verdict[:110]}{e2e}")
    click.echo(f"written to {output}/: {', '.join(p.name for p in paths.values())}")


def conformance(configs, engine_list, length, output, quiet) -> None:
    """``ropescale conformance``: one cell per shipped config × engine, printed and written to ``output``."""
    from .conformance import run_conformance, shipped_names, write_conformance

    engines = [engine_name(e.strip()) for e in engine_list.split(",") if e.strip()]
    say = (lambda m: click.echo(m, err=True)) if not quiet and sys.stderr.isatty() else None
    cells, meta = run_conformance(list(configs) or shipped_names(), engines=engines, output=output, length=length,
                                  say=say)
    paths = write_conformance(cells, output, meta)
    for c in cells:
        click.echo(f"{c.config:<22} {c.engine:<12} {c.exported_by:<22} {c.kind:<15} {c.text[:90]}")
    click.echo(f"written to {output}/: {', '.join(p.name for p in paths.values())}")

"""ropescale command line: strategies, tasks, eval, sweep, finetune, search, compare, patch, parity,
inspect, base-bound, lm-eval, plot and reference (train and card of the bundled model).

    ropescale strategies
    ropescale tasks
    ropescale eval configs/passkey.yaml [--set key=value ...] [--output DIR]
    ropescale sweep configs/quickstart.yaml [--set key=value ...] [--output DIR]   # = eval --task perplexity
    ropescale sweep --model reference --data kjv-heldout --strategy vanilla --strategy yarn \\
        --lengths 128,256,512 --output runs/demo
    ropescale finetune configs/finetune-pi.yaml [--set key=value ...] [--output DIR]
    ropescale search configs/search-yarn.yaml [--set key=value ...] [--output DIR] [-q]
    ropescale patch --model reference --strategy yarn:factor=4 --output runs/yarn4
    ropescale patch --model reference --strategy yarn:factor=8 --engine vllm --serve-length 1024 -o runs/y8
    ropescale parity --model reference --strategy yarn --lengths 512 --end-to-end -o runs/parity
    ropescale compare runs/pi runs/yarn --length 512 -o compare.png [--before runs/base]
    ropescale inspect --model reference --strategy yarn --length 1024 -o runs/inspect
    ropescale base-bound [--dims 32,64,128] [--lengths 128,256,...]
    ropescale lm-eval --model ropescale --model_args pretrained=reference,strategy=yarn,factor=8 --tasks ...
    ropescale plot runs/demo/results.jsonl
    ropescale reference train --output stage1 --steps 1800 --answer-end ''
    ropescale reference card --model DIR

Works as ``python cli.py ...`` from a checkout and as ``ropescale ...`` once installed.

Exit codes: 0 done; 1 the input was refused (a ``RopescaleError``, or click's usage error: an unknown
option, a missing argument, a bad option value; one line, ``Error: ...``); 2 a group called without
its subcommand (click prints its help); 70 a bug in ropescale (any other exception: its traceback
and a line asking to report it).
"""

from __future__ import annotations

import errno
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ropescale.errors import RopescaleError

# what each command does: the harness's `commands` module — the folder `eval/` in a checkout (`python cli.py`,
# the tests); installed, the package `ropescale_eval` and this file `ropescale_cli.cli` (pyproject's
# package-dir), so site-packages holds no generic `eval` or `cli`
if __package__ == "ropescale_cli":
    from ropescale_eval import commands
else:
    from eval import commands


BUG_EXIT = 70  # EX_SOFTWARE (sysexits.h): an internal error, not the user's input
BUG_REPORT = ("this is a bug in ropescale, not a mistake in your input; please report it with the traceback "
              "above and the command you ran on the ropescale issue tracker")


def one_line(err: RopescaleError) -> str:
    """The message of a user error as one line (a ``KeyError`` subclass without its own
    ``__str__`` would print the repr of its message)."""
    msg = str(err.args[0]) if isinstance(err, KeyError) and len(err.args) == 1 else str(err)
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def usage_error(err: click.UsageError) -> click.ClickException:
    """Click's usage error (an unknown option, a missing argument, a value its type refuses) as
    every other refused input: one line ``Error: <click's message>``, exit 1, without click's
    ``Usage:`` and ``Try ... for help`` lines."""
    return click.ClickException(" ".join(err.format_message().split()))


class RopescaleGroup(click.Group):
    """The one place where the CLI turns exceptions into output, for every subcommand: a
    ``RopescaleError`` (the user's input cannot be used) and click's own usage errors are one line
    ``Error: ...`` and exit 1, as a ``click.ClickException``; ``--help``, a group called without a
    subcommand (its help) and Ctrl-C pass through; anything else is a bug: its traceback, then a
    line asking to report it, exit 70."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:  # the group's own options (`ropescale --bogus`), parsed before `invoke`
            return super().parse_args(ctx, args)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:
            raise usage_error(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RopescaleError as e:
            raise click.ClickException(one_line(e)) from None
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:  # a subcommand's arguments, an unknown subcommand
            raise usage_error(e) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OSError as e:
            if e.errno == errno.EPIPE:  # `ropescale ... | head`: click's main handles a closed pipe
                raise
            self._bug(ctx)
        except Exception:  # noqa: BLE001 — anything that is not a user error is a bug: shown with its traceback
            self._bug(ctx)

    @staticmethod
    def _bug(ctx: click.Context) -> None:
        traceback.print_exc(file=sys.stderr)
        click.echo(f"\n{BUG_REPORT}", err=True)
        ctx.exit(BUG_EXIT)


class VocabOption(click.Option):
    """An option with old spellings kept working: ``deprecated`` names parse as the option does
    (same value, same ``multiple``), are left out of ``--help`` and of error hints, and print a
    one-line deprecation note on stderr when used (``VocabCommand``). The one vocabulary the CLI
    uses is checked by tests/test_cli_vocabulary.py."""

    def __init__(self, param_decls, *, deprecated: tuple[str, ...] = (), **kwargs):
        self.deprecated_names = tuple(deprecated)
        super().__init__([*param_decls, *self.deprecated_names], **kwargs)

    def _current(self, method, ctx):
        saved = self.opts
        self.opts = [o for o in saved if o not in self.deprecated_names]
        try:
            return method(ctx)
        finally:
            self.opts = saved

    def get_help_record(self, ctx):
        return self._current(super().get_help_record, ctx)

    def get_error_hint(self, ctx):
        return self._current(super().get_error_hint, ctx)

    def current_name(self) -> str:
        """The spelling to use: the first long name that is not deprecated."""
        return next(o for o in self.opts if o.startswith("--") and o not in self.deprecated_names)


class VocabCommand(click.Command):
    """A command whose ``VocabOption`` old spellings are noted on stderr when used."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        old = {name: p for p in self.params if isinstance(p, VocabOption) for name in p.deprecated_names}
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if name in old:
                click.echo(f"Warning: {name} is deprecated; use {old[name].current_name()}", err=True)
        return super().parse_args(ctx, args)


RopescaleGroup.command_class = VocabCommand
RopescaleGroup.group_class = type  # `reference`'s subcommands get the same classes


class RegistryChoice(click.Choice):
    """A choice among a registry's names (bundled and plugins'), read when first needed."""

    def __init__(self, names: Callable[[], list[str]]) -> None:
        self.names = names
        super().__init__([])

    @property
    def choices(self):
        return self.names()

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the registry holds the names
        pass


class EngineChoice(RegistryChoice):
    """The registered serving engines by their one name each (``ropescale.serving.engines``:
    ``transformers``, ``vllm``, ``llama.cpp``, ``mlx``, ``sglang`` and plugins' engines); an old
    name (``gguf``, the file format ``patch --target`` named llama.cpp by) still parses, with a note."""

    def __init__(self) -> None:
        super().__init__(commands.serving_engines)

    def convert(self, value, param, ctx):
        return super().convert(commands.engine_name(value), param, ctx)


@click.group(cls=RopescaleGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Swap the rotary position embedding of a Hugging Face causal LM and measure how far
    past its training window it still models text."""


@main.command()
def strategies() -> None:
    """List strategies, their parameters (with defaults) and sources."""
    commands.list_strategies()


@main.command()
def tasks() -> None:
    """List evaluation tasks, their metrics and options."""
    commands.list_tasks()


def _lengths(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _length_list(ctx, param, values):
    """A repeatable option of comma-separated lengths (``--lengths 512,1024 --lengths 2048``) → ints."""
    out = []
    for value in values:
        out += _lengths(ctx, param, value)
    return out


def _given_lengths(ctx, param, values):
    """``--lengths`` of an experiment command: every occurrence joined (a second ``--lengths`` took the place
    of the first, silently), None when not given (the config's lengths)."""
    return _length_list(ctx, param, values) or None


def _common_options(fn):
    """Options every experiment command takes (config file, overrides, model, strategies, ...)."""
    for opt in reversed([
        click.argument("config", required=False, type=click.Path(dir_okay=False)),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="override a config key (dots for nesting: data.max_documents=3, passkey.trials=5)"),
        click.option("--output", "-o", type=click.Path(file_okay=False), help="results folder"),
        click.option("--model", help="bundled name (reference), local path or hub id"),
        click.option("--data", help="kjv-heldout, a local file/folder, or a hub dataset id"),
        click.option("--strategy", "strategy_specs", multiple=True, metavar="NAME[:k=v,...]",
                     help="repeatable; e.g. yarn:beta_fast=16"),
        click.option("--lengths", multiple=True, callback=_given_lengths,
                     help="comma-separated lengths in tokens, e.g. 128,256,512; repeatable"),
        click.option("--device", help="auto, cpu, cuda, cuda:1 ..."),
        click.option("--device-map", help="auto: spread a model larger than one GPU over this node's devices"),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                     help="auto (default): bfloat16 on a GPU that supports it, float32 on the CPU"),
        click.option("--quiet", "-q", is_flag=True, help="no progress output"),
        click.option("--engine", type=RegistryChoice(commands.scoring_engines),
                     help="what scores the cells: transformers (default), vllm (what `patch --engine vllm` "
                          "writes, in vLLM's own environment; bench/engines/install.sh vllm), mlx (perplexity "
                          "through mlx-lm) or a plugin's scoring engine"),
    ]):
        fn = opt(fn)
    return fn


def _perplexity_options(fn):
    """The perplexity task's flags (``PERPLEXITY_FLAGS``); another task refuses them."""
    for opt in reversed([
        click.option("--mode", type=click.Choice(["chunk", "sliding"]), help="perplexity: chunk (default) or sliding"),
        click.option("--stride", type=int, help="perplexity, sliding mode: stride (default length // 2)"),
        click.option("--max-windows", type=int, help="perplexity: cap on windows per length"),
        click.option("--batch-size", type=int, help="perplexity: windows per forward"),
        click.option("--dynamic-block", type=int,
                     help="perplexity: score dynamic strategies block-wise (generation semantics)"),
    ]):
        fn = opt(fn)
    return fn


@main.command("eval")
@_common_options
@_perplexity_options
@click.option("--task", help="perplexity (default), passkey, needle, niah_multikey … (`ropescale tasks` lists them)")
def eval_cmd(task, **options) -> None:
    """Run a task (perplexity, passkey, needle, …) for each strategy at each length; resumable;
    writes results.jsonl/csv/md and the task's plots."""
    commands.evaluate(task, **options)


# `sweep` is `eval --task perplexity`: the same parameters (less --task) and the same body; a config
# of another task is refused rather than run as perplexity
sweep = VocabCommand(
    "sweep", params=[p for p in eval_cmd.params if p.name != "task"],
    callback=lambda **options: commands.evaluate(None, **options, perplexity_only=True),
    short_help="Alias of `eval --task perplexity`.",
    help="Alias of `ropescale eval --task perplexity`: perplexity of each strategy at each length; resumable. "
         "A config of another task is refused.")
main.add_command(sweep)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key (dots for nesting: pose.chunks=3, eval.every=50)")
@click.option("--output", "-o", type=click.Path(file_okay=False), help="run folder (default: output: in the config)")
@click.option("--model", help="bundled name (reference), local path or hub id")
@click.option("--strategy", "strategy_spec", metavar="NAME[:k=v,...]", help="e.g. yarn:factor=4")
@click.option("--data", help="training text: kjv-train, a local file/folder, or a hub dataset id")
@click.option("--length", type=int, help="target length L in tokens")
@click.option("--steps", type=int, help="optimiser steps")
@click.option("--device", help="auto, cpu, cuda ...")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
def finetune(config, overrides, output, model, strategy_spec, data, length, steps, device, quiet) -> None:
    """Fine-tune a patched model at the target length (accelerate; resumable; PoSE), save it with
    its patch, and evaluate it. Runs under `accelerate launch` for several processes."""
    commands.finetune(config, overrides, output, model, strategy_spec, data, length, steps, device, quiet)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key (budget=40, fixed.factor=8, search.beta_fast=[4,64])")
@click.option("--output", "-o", type=click.Path(file_okay=False), help="search folder (default: output: in the config)")
@click.option("--device", help="auto, cpu, cuda ... (default: device: in the config)")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
def search(config, overrides, output, device, quiet) -> None:
    """Search a strategy's numeric parameters for a model and target length(s) on a search split
    (Optuna TPE or CMA-ES; resumable; several processes may share a folder); writes best.json,
    trials.csv, results.md and search.png."""
    commands.search(config, overrides, output, device, quiet)


@main.command("patch")
@click.option("--model", required=True, help="bundled name, local path or hub id")
@click.option("--strategy", "strategy_spec", required=True, metavar="NAME[:k=v,...]",
              help="e.g. yarn:factor=4 or ntk:factor=2,logn=true")
@click.option("--output", "-o", type=click.Path(file_okay=False), help="folder to write (not with --dry-run)")
@click.option("--dry-run", is_flag=True, help="patch in memory and print what each layer gets; write nothing")
@click.option("--original-max-position-embeddings", type=int, help="training window override")
@click.option("--layer-types", help="comma-separated layer types to patch (Gemma 3); default: non-sliding")
@click.option("--dynamic-cache", type=click.Choice(["recompute", "rerotate"]), default="recompute",
              show_default=True, help="dynamic strategies under the KV cache: exact or approximate")
@click.option("--dynamic-block", type=int, default=1, show_default=True,
              help="dynamic strategies change scale once per this many tokens")
@click.option("--engine", cls=VocabOption, deprecated=("--target",), type=EngineChoice(), default="transformers",
              show_default=True, help="the engine to serve it with")
@click.option("--serve-length", type=int, help="length to serve (tokens); required for the engines serving one static "
              "rotation (vllm, llama.cpp, mlx, sglang)")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False),
              help="llama.cpp: the unpatched model's GGUF to rewrite (llama.cpp's converter output)")
@click.option("--freeze-dynamic-at", type=int,
              help="dynamic NTK, vllm, llama.cpp, mlx, sglang: serve it static at this length (default but for "
                   "llama.cpp: the serve length)")
@click.option("--profiles", metavar="S1,S2,...", help="request-length profiles: one export per scale factor "
              "(OUT/profile-<s>x, each serving s·T tokens) and OUT/profiles.json with the rule picking one per "
              "request; the strategy without its factor")
@click.option("--device", default="cpu", show_default=True, help="where to load the model: cpu, cuda, cuda:1 ...")
@click.option("--quiet", "-q", is_flag=True, help="no progress output (transformers' loading bars)")
def patch_cmd(model, strategy_spec, output, dry_run, original_max_position_embeddings, layer_types,
              dynamic_cache, dynamic_block, engine, serve_length, gguf_path, freeze_dynamic_at, profiles, device,
              quiet) -> None:
    """Save a patched model for an engine. transformers: strategies it implements are written into
    config.json (plain from_pretrained reproduces them: checked by loading the folder back), others
    need ropescale.load_model. vllm: the folder with the config.json vLLM computes the same rotation
    from, and vllm.json (max_model_len, hf_overrides). llama.cpp: OUT/model.gguf, the --gguf file with
    its rope metadata rewritten. mlx: the folder with the rope keys mlx-lm reads (rope_theta,
    rope_scaling), and mlx.json. sglang: the folder with the config.json SGLang computes the same
    rotation from, and sglang.json (context_length). What an engine cannot express is refused with
    the reason. native keeps the model as plain transformers serves --model (a folder ropescale wrote included) and
    exports its own rope parameters. --dry-run prints, per attention layer, the rope type, θ, rotary
    dim, layout, T and the rule applied (or "no RoPE, untouched")."""
    commands.patch(model, strategy_spec, output, dry_run, original_max_position_embeddings, layer_types,
                   dynamic_cache, dynamic_block, engine, serve_length, gguf_path, freeze_dynamic_at, profiles, device,
                   quiet)


@main.command()
@click.option("--model", help="bundled name, local path or hub id (its config gives d, rope_theta and T)")
@click.option("--head-dim", type=int, help="without --model: rotary dim d")
@click.option("--rope-theta", type=float, help="without --model: RoPE base b")
@click.option("--original-max-position-embeddings", "original_max_position_embeddings", cls=VocabOption,
              deprecated=("--training-length",), type=int, help="without --model: training window T (tokens)")
@click.option("--strategy", "strategy_specs", multiple=True, required=True, metavar="NAME[:k=v,...]",
              help="repeatable; parameters a sweep fills (factor, n_max, window) follow --length")
@click.option("--length", type=int, required=True, help="target length L (tokens)")
@click.option("--pair", "pairs", type=int, multiple=True,
              help="rotary pair(s) for the angle plot (default 0, the fastest)")
@click.option("--attention", is_flag=True, help="also measure attention entropy and first-token share on text of "
                                                "L tokens (loads the model's weights; frequency strategies)")
@click.option("--data", default="kjv-heldout", show_default=True, help="text for --attention")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False))
@click.option("--device", default="cpu", show_default=True, help="where --attention loads the model: cpu, cuda ...")
@click.option("--quiet", "-q", is_flag=True, help="no progress output (transformers' loading bars)")
def inspect(model, head_dim, rope_theta, original_max_position_embeddings, strategy_specs, length, pairs, attention,
            data, output, device, quiet) -> None:
    """Draw what each strategy does to the rotary geometry: wavelengths per pair, rotation angles
    and aliasing, long-range decay, the base bound; writes PNGs and summary.json. With --model
    (its weights loaded) also prints, per strategy, the per-layer table patch --dry-run prints."""
    commands.inspect(model, head_dim, rope_theta, original_max_position_embeddings, strategy_specs, length, pairs,
                     attention, data, output, device, quiet)


def _ints(low: int, *, high: int | None = None, even: bool = False):
    """A click callback: comma-separated whole numbers, each >= ``low`` (and <= ``high``, even)."""

    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            out = [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected comma-separated whole numbers") from None
        bad = [n for n in out if n < low or (high is not None and n > high) or (even and n % 2)]
        if not out or bad:
            limit = f"from {low} to {high}" if high is not None else f">= {low}"
            raise click.BadParameter(f"{value!r}: each must be {'an even number ' if even else ''}{limit}"
                                     + (f"; got {', '.join(map(str, bad))}" if bad else ""))
        return out

    return parse


BASE_BOUND_DIMS = "32,64,128"
BASE_BOUND_LENGTHS = "128,256,512,1024,2048,4096,8192,16384,32768"


@main.command("base-bound")
@click.option("--dims", default=BASE_BOUND_DIMS, show_default=True, callback=_ints(2, high=1 << 16, even=True),
              help="rotary (head) dims d, comma-separated (even, up to 2^16)")
@click.option("--lengths", default=BASE_BOUND_LENGTHS, show_default=True, callback=_ints(2, high=1 << 24),
              help="context lengths L in tokens, comma-separated (up to 2^24)")
def base_bound(dims, lengths) -> None:
    """Print the base-bound table (Markdown): the smallest vanilla RoPE base keeping B(m) >= 0
    for every m < L, per head dim d and length L (Men et al., arXiv:2405.14591), with their
    power-law fit beside it when d = 128 is asked for; a cell no base reaches (d = 2) is "—", with a
    note. The defaults give the README's table (minutes on a CPU: each entry is a certified search
    over every m < L)."""
    commands.base_bound(dims, lengths)


def _steps(ctx, param, value: str) -> list[int]:
    try:
        steps = [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated step numbers, e.g. 0,50,100") from None
    if any(k < 0 for k in steps):
        raise click.BadParameter(f"{value!r}: step numbers are >= 0")
    return steps


@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--length", type=int, required=True, help="the held-out length L (tokens) to compare at")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path), help="figure (PNG)")
@click.option("--title", default="", help="figure title")
@click.option("--at", default="0,50,100,200,400,1000", show_default=True, callback=_steps,
              help="steps of the PPL-by-step table (comma-separated; those evaluated)")
@click.option("--before", type=click.Path(path_type=Path), multiple=True,
              help="harness results folder of the strategies on the base model (repeatable)")
def compare(runs, length, output, title, at, before) -> None:
    """Compare fine-tuning runs (folders `ropescale finetune` wrote): held-out PPL at --length vs
    steps in one figure, and Markdown tables (PPL by step; each run's last evaluation with the
    first step reaching the first run's final PPL); with --before, the harness's perplexity and
    passkey results of each run's strategy on the base model next to the fine-tuned model's."""
    commands.compare(list(runs), length, output, title, at, list(before))


@main.command("lm-eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_cmd(args) -> None:
    """lm-evaluation-harness with the `ropescale` model registered (needs the lm-eval extra):
    ropescale lm-eval --model ropescale --model_args pretrained=reference,strategy=yarn,factor=8 --tasks ..."""
    commands.lm_eval(list(args))


@main.command()
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), help="default: beside RESULTS")
def plot(results, output) -> None:
    """Rebuild results.csv/md and the plots from a results.jsonl."""
    commands.plot(results, output)


@main.group()
def reference() -> None:
    """Train the bundled reference model (kjv-llama) and write its model card; from a checkout,
    with Debian's bible-kjv installed."""


@reference.command("train")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="model folder to write")
@click.option("--steps", type=click.IntRange(min=1), default=1500, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--original-max-position-embeddings", "window", cls=VocabOption, deprecated=("--window",),
              type=click.IntRange(min=2), default=128, show_default=True, help="training window T (tokens)")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-3, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=100, show_default=True)
@click.option("--vocab-size", type=click.IntRange(min=260), default=4096, show_default=True)
@click.option("--mix", metavar="KIND=SHARE,...",
              help="shares of the document kinds (kjv, passkey, needle, repeat, random) per batch "
                   "[default: kjv=0.45,passkey=0.15,needle=0.1,repeat=0.15,random=0.15]")
@click.option("--copy-mix", metavar="KIND=SHARE,...",
              help="shares used from the first step until the copy probe shows induction "
                   "[default: kjv=0.1,passkey=0.15,needle=0.1,repeat=0.3,random=0.35]")
@click.option("--copy-phase-max", type=click.IntRange(min=0), default=600, show_default=True,
              help="steps at most on --copy-mix")
@click.option("--probe-every", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--answer-end", default=".", show_default=True,
              help="text after a passkey/needle answer ('' = the window ends at the answer, as stage 1 of the "
                   "bundled model did)")
@click.option("--init", type=click.Path(file_okay=False, path_type=Path),
              help="start from this model (and its tokenizer) instead of from scratch: a second stage; no copy phase")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
def reference_train(**options) -> None:
    """Train the reference model: a small Llama on the KJV training books that can copy and
    retrieve inside its window (about 55 min on 2 CPU cores for the bundled two stages)."""
    commands.reference_train(**options)


@reference.command("card")
@click.option("--model", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="model folder `ropescale reference train` wrote")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="also draw the training and copy-probe curves here (PNG)")
def reference_card(model, threads, plot) -> None:
    """Measure a reference model on the held-out books (perplexity at T and 8T, passkey at T,
    copy probe), store the figures in its training.json and write its model card (README.md);
    about 3 minutes on 2 CPU cores."""
    commands.reference_card(model, threads, plot)


@main.command()
@click.option("--model", default="reference", show_default=True, help="bundled name, local path or hub id")
@click.option("--strategy", "strategy_specs", multiple=True, required=True, metavar="NAME[:k=v,...]",
              help="repeatable; parameters a sweep fills (factor …) follow each of --lengths")
@click.option("--lengths", "lengths", cls=VocabOption, deprecated=("--length",), multiple=True, required=True,
              callback=_length_list, help="served lengths L in tokens, comma-separated (e.g. 512,1024); repeatable")
@click.option("--engines", "engine_list", cls=VocabOption, deprecated=("--engine",),
              default="transformers,vllm,llama.cpp", show_default=True,
              help="comma-separated: transformers (in process), vllm, llama.cpp, mlx, sglang")
@click.option("--end-to-end", is_flag=True,
              help="also score held-out text through the real engines (needs them installed: bench/engines/install.sh)")
@click.option("--data", default="kjv-heldout", show_default=True, help="text for --end-to-end")
@click.option("--windows", type=int, default=1, show_default=True,
              help="windows of L tokens per length for --end-to-end")
@click.option("--freeze-dynamic/--no-freeze-dynamic", default=True, show_default=True,
              help="export dynamic NTK frozen at each L (engines serve one static rotation) or have it refused")
@click.option("--gguf", "gguf_path",
              help="base GGUF of the model to rewrite (default: llama.cpp's converter run on it)")
@click.option("--baseline", is_flag=True,
              help="also rows for what was served before these exports: save_patched's config.json given to vLLM, "
                   "llama.cpp's converter run on it")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False))
@click.option("--device", default="cpu", show_default=True,
              help="where the in-process transformers model runs: cpu, cuda ...")
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
def parity(model, strategy_specs, lengths, engine_list, end_to_end, data, windows, freeze_dynamic, gguf_path,
           baseline, output, device, quiet) -> None:
    """Per engine (plain transformers, vLLM, llama.cpp, MLX, SGLang) × strategy × length: the
    frequencies, cos/sin magnitude and softmax scale the engine computes from ropescale's export
    against ropescale's, the largest angle difference up to L and a verdict — from the engine's own
    code where installed, from ropescale's re-implementation otherwise; with --end-to-end, held-out
    log-probabilities through the real engine. Writes parity.md, parity.csv, parity.png to OUTPUT."""
    commands.parity(model, strategy_specs, lengths, engine_list, end_to_end, data, windows, freeze_dynamic, gguf_path,
                    baseline, output, device, quiet)


@main.command()
@click.option("--config", "configs", multiple=True, metavar="NAME|FILE.json",
              help="a shipped config (default: every bundled one: gemma-3-4b, gpt-oss-20b, deepseek-v3 …) or a JSON "
                   "file of the same form; repeatable")
@click.option("--engines", "engine_list", default="transformers,vllm,llama.cpp,sglang,mlx", show_default=True,
              help="comma-separated engines to compare")
@click.option("--length", type=int, help="served length L in tokens for every config (default: each config's own, "
                                         "at most 131072)")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="no progress output")
def conformance(configs, engine_list, length, output, quiet) -> None:
    """How each serving engine rotates a model's config as shipped (no patch): per shipped config —
    Gemma 3 and 4, gpt-oss, Llama 4, Ministral 3, DeepSeek-V3, Phi-3.5, Qwen3 + YaRN, Qwen3.5 M-RoPE,
    Qwen2.5-1M, EXAONE 4, SmolLM3 — a tiny model with every rope key as shipped, each engine given
    that config.json and compared layer type by layer type with transformers: same, differs (by how
    much, where) or cannot express. Writes conformance.md, .csv and .json to OUTPUT."""
    commands.conformance(configs, engine_list, length, output, quiet)


if __name__ == "__main__":
    sys.exit(main())

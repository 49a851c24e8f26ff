"""One CLI vocabulary (issue 30): every option of every command of ``cli.main`` (groups' subcommands
included) is collected and checked against one table, concept → the one spelling allowed; a
command that loads a model takes ``--device`` and ``-q/--quiet``; input a command refuses is one
line ``Error: ...`` and exit 1 on every command. Old spellings stay as hidden, deprecated aliases
(``cli.VocabOption``): they parse, are not in ``--help``, and print a one-line note."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from cli import VocabOption, main

# concept → (the spelling allowed, the spellings that would be a second name for it)
CONCEPTS = {
    "several lengths (comma-separated)": ("--lengths", {"--length-list", "--seq-lengths", "--context-lengths"}),
    "the training window T": ("--original-max-position-embeddings",
                              {"--training-length", "--train-length", "--training-window", "--window",
                               "--max-position-embeddings", "--context-window", "--train-window"}),
    "the served length": ("--serve-length", {"--served-length", "--serving-length", "--max-model-len", "--n-ctx",
                                             "--serve-len"}),
    "one serving engine / several": ("--engine / --engines", {"--target", "--backend", "--server", "--targets"}),
}
FORBIDDEN = {name: concept for concept, (_, names) in CONCEPTS.items() for name in names}
# the one name of each engine (what `patch --engine` and `parity --engines` accept); not the file format
ENGINES = {"transformers", "vllm", "llama.cpp", "mlx", "sglang"}
# commands that load a model but take no --device / -q, and why
NO_DEVICE = {
    "reference card": "the bundled CPU model's card: figures measured on CPU threads (--threads)",
}


def _commands(group: click.Group = main, prefix: str = ""):
    """``(path, command)`` for every command under ``group``, subcommands of groups included."""
    for name, cmd in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{path} ")
        else:
            yield path, cmd


COMMANDS = dict(_commands())


def _options(cmd: click.Command):
    return [p for p in cmd.params if isinstance(p, click.Option)]


def _visible(opt: click.Option) -> list[str]:
    """The spellings ``--help`` shows (not a deprecated alias)."""
    old = getattr(opt, "deprecated_names", ())
    return [] if opt.hidden else [o for o in opt.opts + opt.secondary_opts if o not in old]


def test_the_walk_finds_every_command_and_the_groups_subcommands():
    assert {"eval", "sweep", "patch", "parity", "inspect", "compare", "reference train",
            "reference card"} <= set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_no_option_is_a_second_name_for_a_concept(path):
    bad = [f"{o}: {FORBIDDEN[o]} is spelled {CONCEPTS[FORBIDDEN[o]][0]}"
           for opt in _options(COMMANDS[path]) for o in _visible(opt) if o in FORBIDDEN]
    assert not bad, f"ropescale {path}: " + "; ".join(bad)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_several_lengths_are_lengths_and_one_length_is_length(path):
    """``--length`` is one length; a repeatable or list-valued option of lengths is ``--lengths``."""
    for opt in _options(COMMANDS[path]):
        names = _visible(opt)
        if "--length" in names:
            assert not opt.multiple and opt.type == click.INT, f"ropescale {path} --length takes several lengths"
        if "--lengths" in names:  # a list: a comma-separated value (callback) or repeated
            assert opt.multiple or opt.callback is not None, f"ropescale {path} --lengths takes one length"


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_engines_have_one_name_each(path):
    for opt in _options(COMMANDS[path]):
        names = _visible(opt)
        if "--engine" in names:  # one engine
            # the engines a command offers (eval/sweep: transformers, vllm), by the one name each has
            assert not opt.multiple and set(opt.type.choices) <= ENGINES, f"ropescale {path} --engine"
        if "--engines" in names:  # a comma-separated list; its default names engines by the same names
            assert set(opt.default.split(",")) <= ENGINES, f"ropescale {path} --engines default {opt.default}"


def _loads_a_model(cmd: click.Command) -> bool:
    names = {o for opt in _options(cmd) for o in opt.opts}
    args = {p.name for p in cmd.params if isinstance(p, click.Argument)}
    return "--model" in names or "config" in args


@pytest.mark.parametrize("path", sorted(p for p, c in COMMANDS.items() if _loads_a_model(c)))
def test_a_command_that_loads_a_model_takes_device_and_quiet(path):
    if path in NO_DEVICE:
        pytest.skip(NO_DEVICE[path])
    names = {o for opt in _options(COMMANDS[path]) for o in _visible(opt)}
    missing = {"--device", "-q", "--quiet"} - names
    assert not missing, f"ropescale {path} lacks {', '.join(sorted(missing))}"


def test_the_commands_that_load_a_model_are_the_expected_ones():
    """The rule above reads ``--model`` / CONFIG: a command that loads a model some other way
    would slip past it (lm-eval passes its arguments to lm-eval's own parser, with its --device)."""
    assert {p for p, c in COMMANDS.items() if _loads_a_model(c)} == {
        "eval", "sweep", "finetune", "search", "patch", "parity", "inspect", "reference card"}


# --- old spellings: hidden, still parsed, noted -------------------------------------------------

T = CONCEPTS["the training window T"][0]
# (command, old spelling) → the spelling it is now
DEPRECATED = {("patch", "--target"): "--engine", ("parity", "--length"): "--lengths",
              ("parity", "--engine"): "--engines", ("inspect", "--training-length"): T,
              ("reference train", "--window"): T}


def test_every_old_spelling_is_listed_here():
    found = {(path, old): opt.opts[0] for path, cmd in COMMANDS.items() for opt in _options(cmd)
             if isinstance(opt, VocabOption) for old in opt.deprecated_names}
    assert found == DEPRECATED


@pytest.mark.parametrize(("path", "old"), sorted(DEPRECATED))
def test_an_old_spelling_is_not_in_help(path, old):
    res = CliRunner().invoke(main, [*path.split(), "--help"])
    assert res.exit_code == 0 and DEPRECATED[(path, old)] in res.output
    assert old not in res.output.replace(DEPRECATED[(path, old)], "").split(), res.output


def test_an_old_spelling_parses_as_the_new_one_with_a_note():
    # parity refuses a length < 2 before loading anything: the same refusal by either spelling
    args = ["parity", "--model", "reference", "--strategy", "yarn", "-o", "unused"]
    new = CliRunner().invoke(main, [*args, "--lengths", "1"])
    old = CliRunner().invoke(main, [*args, "--length", "1"])
    assert new.exit_code == old.exit_code == 1
    assert new.output == "Error: --lengths 1: lengths must be whole numbers of tokens >= 2\n"
    assert old.output == "Warning: --length is deprecated; use --lengths\n" + new.output


def test_parity_lengths_are_comma_separated_or_repeated():
    from cli import parity

    ctx = parity.make_context("parity", ["--strategy", "yarn", "-o", "x", "--lengths", "64,128", "--length", "256"])
    assert ctx.params["lengths"] == [64, 128, 256]


def test_patch_takes_llama_cpp_by_its_engine_name_and_gguf_still():
    from cli import patch_cmd

    for value in ("llama.cpp", "gguf"):
        ctx = patch_cmd.make_context("patch", ["--model", "m", "--strategy", "yarn", "--engine", value])
        assert ctx.params["engine"] == "llama.cpp"


# --- exit 1 for input a command refuses, on every command ---------------------------------------

# path → arguments it refuses ({tmp}: a fresh folder); strategies and tasks take no input
BAD_INPUT = {
    "eval": ["{tmp}/missing.yaml"],
    "sweep": ["{tmp}/missing.yaml"],
    "finetune": ["{tmp}/missing.yaml"],
    "search": ["{tmp}/missing.yaml"],
    "patch": ["--model", "reference", "--strategy", "yarn:factor=4"],  # no --output
    "parity": ["--model", "reference", "--strategy", "yarn", "--lengths", "1", "-o", "{tmp}/o"],
    "conformance": ["--config", "gemma-9", "-o", "{tmp}/o"],
    "inspect": ["--strategy", "yarn", "--length", "256", "-o", "{tmp}/o"],  # no model, no bare config
    "compare": ["{tmp}/missing", "--length", "512", "-o", "{tmp}/f.png"],
    "base-bound": ["--dims", "65536", "--lengths", "16777216"],
    "plot": ["{tmp}/missing.jsonl"],
    "lm-eval": [],
    "reference train": ["--init", "{tmp}/missing", "-o", "{tmp}/m", "--steps", "1"],
    "reference card": ["--model", "{tmp}/missing"],
}
NO_INPUT = {"strategies", "tasks"}


def test_every_command_has_a_bad_input_case():
    assert set(BAD_INPUT) | NO_INPUT == set(COMMANDS)


@pytest.mark.parametrize("path", sorted(BAD_INPUT))
def test_refused_input_is_one_line_and_exit_1(path, tmp_path):
    if path == "lm-eval":
        pytest.importorskip("lm_eval")
    args = [a.format(tmp=tmp_path) for a in BAD_INPUT[path]]
    res = CliRunner().invoke(main, [*path.split(), *args])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before anything is written


# identifiers: the glossary's one spelling (docs/glossary.md). A banned spelling as a whole identifier or as a run
# of its underscore-separated words (``model_training_length`` holds ``training_length``) fails, but for the
# deprecated aliases kept for callers of the old names.
BANNED_IDENTIFIERS = {
    "train_len": "train_length (T)",
    "training_length": "target_length (L being trained for) or original_max_position_embeddings (T)",
    "L_train": "T / train_length",
    "truncation_rule": "relative-position rule",
    "relative_rule": "relative-position rule",
}
DEPRECATED_ALIASES = {"model_training_length"}  # ropescale.models: model_training_window's old name


def _identifiers(tree):
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.lineno


def _banned(identifier: str) -> str | None:
    words = identifier.split("_")
    for bad in BANNED_IDENTIFIERS:
        n = len(bad.split("_"))
        if any("_".join(words[i:i + n]) == bad for i in range(len(words) - n + 1)):
            return bad
    return None


def test_the_code_uses_the_glossarys_identifiers():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in [root / "cli.py", *sorted((root / "ropescale").rglob("*.py")), *sorted((root / "eval").rglob("*.py"))]:
        for name, line in _identifiers(ast.parse(path.read_text(encoding="utf-8"))):
            bad = _banned(name)
            if bad and name not in DEPRECATED_ALIASES:
                found.append(f"{path.relative_to(root)}:{line} {name} (say {BANNED_IDENTIFIERS[bad]})")
    assert sorted(set(found)) == []


def test_the_identifier_check_can_fail():
    assert _banned("train_len") == "train_len" and _banned("model_training_length") == "training_length"
    assert _banned("set_training_length") == "training_length" and _banned("L_train") == "L_train"
    assert _banned("train_length") is None and _banned("target_length") is None and _banned("length") is None

"""One call to write a patched model for an engine: ``export_for(model, engine, serve_length, output)``.

The engines are the registered ``ropescale.serving.engines.Engine`` entries (``transformers``: a
``save_patched`` folder with ``max_position_embeddings`` raised to the served length; ``vllm``: that
folder with vLLM's config.json and ``vllm.json``; ``llama.cpp``: ``OUT/model.gguf``, an existing GGUF with
its rope metadata rewritten; plugins through the ``ropescale.engines`` entry points); this module names
none of them. Refusals happen before anything is written (``check_export``: the checks that need no
model, for a command line to run before loading one), and each engine writes into a staging folder
moved into place once complete (``ropescale.serving.output``): a full disk leaves no half export.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ropescale.errors import InvalidInput
from ropescale.serving.engines import ENGINES, get_engine
from ropescale.serving.output import check_output
from ropescale.serving.plan import check_freeze
from ropescale.serving.rope import check_length, patch_handle

__all__ = ["ExportResult", "check_export", "export_for"]


@dataclass
class ExportResult:
    """What ``export_for`` wrote: ``engine`` (the engine's one name: ``transformers``, ``vllm``,
    ``llama.cpp``, …), ``path`` (the model folder, or the ``.gguf`` file), the served length [tokens]
    (None for a transformers export without one), notes, the command that serves it (None where
    the engine has none), and ``usage``: one line telling the user how to serve it
    (``Engine.usage``). ``target`` is the old name of ``engine`` (a ``FutureWarning``)."""

    engine: str
    path: Path
    serve_length: int | None
    notes: list[str] = field(default_factory=list)
    command: str | None = None
    usage: str | None = None

    @property
    def target(self) -> str:
        """The old name of ``engine`` (a ``FutureWarning``)."""
        warnings.warn("ExportResult.target is deprecated; use ExportResult.engine", FutureWarning, stacklevel=2)
        return self.engine


def _engine_argument(engine: str | None, target: str | None, output) -> str:
    """The engine a call names: ``engine``, or the old keyword ``target`` (a ``FutureWarning`` naming
    the caller of ``export_for``/``check_export``). ``InvalidInput`` for both given; ``TypeError``
    (as Python's for a missing argument) for neither, or no ``output``."""
    if target is not None:
        if engine is not None:
            raise InvalidInput(f"engine={engine!r} and target={target!r}: target is the old name of engine; give one")
        warnings.warn("the argument target= is deprecated; use engine=", FutureWarning, stacklevel=3)
        engine = target
    if engine is None:
        raise TypeError("missing required argument: 'engine'")
    if output is None:
        raise TypeError("missing required argument: 'output'")
    return engine


def check_export(engine: str | None = None, serve_length: int | None = None, output: str | Path | None = None, *,
                 gguf: str | Path | None = None, freeze_dynamic_at: int | None = None,
                 source: str | Path | None = None, target: str | None = None) -> tuple[int | None, Path]:
    """The checks of ``export_for`` that need no model. Creates nothing.

    Args:
        engine: the engine's name (``engine_names()``).
        serve_length: the length to serve [tokens] (None: only for an engine that is not ``static``).
        output: the output folder.
        gguf: the GGUF to rewrite (engines that read one; None: none).
        freeze_dynamic_at: the length dynamic NTK is frozen at [tokens] (None: the served length).
        source: the model's folder, which the output may not be (None: a hub id).
        target: the old name of ``engine`` (a ``FutureWarning``).

    Returns:
        ``(L, output)``: the served length (``check_length``: [2, 2^24] tokens; None for an engine
        that is not ``static`` given none) and the output folder.

    Raises:
        UnknownEngineError: an unknown engine.
        ropescale.errors.InvalidInput: a served length missing (a static engine) or out of range, a
            ``freeze_dynamic_at`` out of range, a GGUF given to an engine that does not read it, the
            engine's own checks (llama.cpp: the GGUF missing, not a file, or the output's
            ``model.gguf``); one line each.
        ropescale.errors.OutputError: an output that is a file, not writable, or ``source``
            (``ropescale.serving.output.check_output``).
    """
    engine = get_engine(_engine_argument(engine, target, output), stacklevel=3)
    if gguf is not None and not engine.reads_gguf:
        readers = [name for name, cls in sorted(ENGINES.items()) if cls.reads_gguf]
        does = "writes a model folder from the weights" if engine.folder else "reads none"
        raise InvalidInput(f"a GGUF to rewrite (--gguf {gguf}) is read by the {', '.join(readers)} engine only; the "
                           f"{engine.name} engine {does}: leave --gguf out, or use --engine {readers[0]}")
    if serve_length is None and engine.static:
        raise InvalidInput(f"the {engine.name} engine serves one static rotation: give the length to serve "
                           "(serve_length, --serve-length; tokens)")
    length = None if serve_length is None else check_length(serve_length)
    if freeze_dynamic_at is not None:
        check_length(freeze_dynamic_at, "freeze_dynamic_at")
    output = check_output(output, source=source)
    engine.check(output, gguf=None if gguf is None else Path(gguf))
    return length, output


def _source_folder(model) -> Path | None:
    """The local folder ``model`` was loaded from (transformers' ``name_or_path``), or None (a hub
    id, a model built in memory)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return Path(name) if name and Path(str(name)).is_dir() else None


def export_for(model: Any, engine: str | None = None, serve_length: int | None = None,
               output: str | Path | None = None, *, tokenizer: Any = None, gguf: str | Path | None = None,
               freeze_dynamic_at: int | None = None, target: str | None = None) -> ExportResult:
    """Write the patched model for a serving engine, to serve ``serve_length`` tokens.

    Everything is checked before anything is written: ``check_export``, then the engine's translation of
    the patch (``Engine.translate``); the engine writes into a staging folder moved into ``output`` once
    complete (an existing folder keeps its other files). The old engine name ``"gguf"`` is llama.cpp and the
    old keyword ``target=`` is ``engine=``, each with a ``FutureWarning``.

    Args:
        model: the patched model (``ropescale.patch``).
        engine: ``"transformers"``, ``"vllm"``, ``"llama.cpp"``, ``"mlx"``, ``"sglang"`` or a plugin's
            (``ropescale.serving.engines``).
        serve_length: L [tokens] the engine will serve (required by the engines serving one static rotation).
        output: the folder to write.
        tokenizer: saved beside the weights (the engines writing a model folder; required there).
        gguf: the GGUF of the *unpatched* model to rewrite (llama.cpp; required), e.g. llama.cpp's
            ``convert_hf_to_gguf.py`` output.
        freeze_dynamic_at: the length F [tokens] dynamic NTK is frozen at (vLLM: default L; llama.cpp:
            required for dynamic NTK); refused for the transformers engine, whose ``dynamic`` rope type
            recomputes the base from the length as ropescale does.
        target: the old name of ``engine``.

    Returns:
        An ``ExportResult``: the path served, the engine's settings and notes, and the command that serves it.

    Raises:
        ExportRefused: the engine cannot express the patch (one line naming the engine and the reason).
        UnknownEngineError: no engine of that name.
        InvalidInput: a missing tokenizer, GGUF or served length, a length past 2^24, a GGUF for another engine,
            ``freeze_dynamic_at`` with a strategy other than dynamic NTK or with the transformers engine, or an
            unpatched model.
        OutputError: an output that is a file, not writable, the model's own folder, or that could not be written
            (a full disk: the output is left as it was).
        GgufUnavailable: the ``gguf`` package is missing (llama.cpp).
    """
    # once (an old name warns once, naming the caller's line)
    engine = get_engine(_engine_argument(engine, target, output), stacklevel=3)
    length, output = check_export(engine.name, serve_length, output, gguf=gguf, freeze_dynamic_at=freeze_dynamic_at,
                                  source=_source_folder(model))
    handle = patch_handle(model)
    freeze = check_freeze(handle, freeze_dynamic_at)
    translation = engine.translate(handle, length, freeze_dynamic_at=freeze)
    if engine.folder and tokenizer is None:
        raise InvalidInput(f"the {engine.name} engine writes a model folder: give the tokenizer too")
    path, notes = engine.write(model, tokenizer, translation, output, gguf=gguf)
    command = engine.serve_command(translation, path, length)
    return ExportResult(engine.name, path, length, [*translation.notes, *notes], command,
                        engine.usage(translation, path, command))

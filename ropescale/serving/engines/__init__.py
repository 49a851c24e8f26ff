"""Serving engines behind the registry: one module per engine, each an ``Engine`` subclass.

An engine is one registered entry (``ENGINES``, the project's ``ropescale.registry.Registry``):
every module of this package is imported on first lookup (``transformers``, ``vllm``,
``llama_cpp``, ``mlx``, ``sglang``), and an installed package adds engines through the ``ropescale.engines``
entry-point group. Subclassing ``Engine`` with a ``name`` registers it. Its steps, in the order
``ropescale.serving.export_for`` runs them:

1. **check** (``check``): what needs no model — the files it reads (``--gguf``), where it writes;
2. **translate** (``translate``): the patch at a served length → the engine's settings (an object
   with ``notes``: what the export had to decide), or ``ExportRefused`` (one line naming the
   engine and the reason) for what the engine cannot express. Most engines start from
   ``ropescale.serving.plan.served_rope_parameters`` (the transformers ``rope_parameters``);
3. **write** (``write``): the files the engine loads, into a staging folder (whole or nothing);
4. **rope** (``rope``): what the engine computes from those settings, an ``EngineRope`` — a
   documented re-implementation of the engine's own formulas, compared with ropescale's by
   ``ropescale parity`` where the engine is not installed;
5. **serve** (``serve_command``): the command line that serves what was written.

The harness side (``ropescale parity``: the real engine run as a subprocess, end-to-end
log-probabilities) is the engine's driver in ``eval/engines/`` (``eval.engines.base``); an
engine without one is compared through ``rope`` alone.

One name per engine: ``transformers``, ``vllm``, ``llama.cpp``, ``mlx``, ``sglang``. ``gguf``, the file format
llama.cpp's export was once named by, still resolves to ``llama.cpp`` with a ``FutureWarning``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, ClassVar

from ropescale.errors import UnknownNameError
from ropescale.models import save_patched
from ropescale.patching import PatchHandle
from ropescale.registry import Registry
from ropescale.serving.output import staged
from ropescale.serving.rope import EngineRope

__all__ = ["ALIASES", "ENGINES", "Engine", "UnknownEngineError", "engine_names", "get_engine", "write_generation",
           "write_model_folder"]

# old names → the engine's one name (each resolved with a FutureWarning)
ALIASES = {"gguf": "llama.cpp"}


class UnknownEngineError(UnknownNameError, ValueError):
    """No serving engine of that name (the message lists the known ones)."""


class Engine:
    """One serving engine: subclass with ``name`` set (registering it) and implement ``translate``,
    ``write`` and ``rope``; the class attributes say what ``export_for`` checks for it.

    name: the engine's one name (``--engine NAME``, ``export_for(model, NAME, ...)``).
    label: how messages name it (``"vLLM"``).
    static: it serves one static rotation, so dynamic NTK is frozen at a length (``freeze_dynamic_at``)
        and a served length is required; False for an engine that recomputes it per length as
        ropescale does (transformers), where ``freeze_dynamic_at`` is refused.
    folder: it writes a model folder from the weights (a tokenizer is required).
    reads_gguf: it rewrites an existing GGUF (``export_for(..., gguf=BASE)``, ``--gguf``).
    rope_source: what ``rope`` re-implements, named in parity rows (``ropescale.serving.vllm_rope``).
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    static: ClassVar[bool] = True
    folder: ClassVar[bool] = True
    reads_gguf: ClassVar[bool] = False
    rope_source: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name"):
            cls.label = cls.__dict__.get("label") or cls.name
        ENGINES.add_class(cls)

    def check(self, output: Path, *, gguf: Path | None) -> None:
        """Checks of this engine's own that need no model, before anything is loaded or written.

        Args:
            output: the checked output folder.
            gguf: the GGUF to rewrite (``--gguf``; None: none given).

        Raises:
            ropescale.errors.InvalidInput: what the engine refuses (one line).
        """

    def translate(self, handle: PatchHandle, serve_length: int | None, *,
                  freeze_dynamic_at: int | None = None) -> Any:
        """The engine's settings for a patch at a served length.

        Args:
            handle: the patch (``ropescale.patch``'s handle).
            serve_length: the length served [tokens] (None: an engine that is not ``static``).
            freeze_dynamic_at: the length dynamic NTK is frozen at [tokens] (None: the served length).

        Returns:
            The engine's translation: an object with ``notes`` (list of str: what the export decided).

        Raises:
            ropescale.serving.rope.ExportRefused: what the engine cannot express ("<label>: why", one line).
        """
        raise NotImplementedError

    def write(self, model: Any, tokenizer: Any, translation: Any, output: Path, *,
              gguf: Path | None = None) -> tuple[Path, list[str]]:
        """Write a translation for a model into a folder, staged (whole or nothing).

        Args:
            model: the patched model.
            tokenizer: its tokenizer (a folder engine writes it beside the weights).
            translation: what ``translate`` returned.
            output: the output folder.
            gguf: the GGUF to rewrite (engines that read one; None: none).

        Returns:
            The path served (the folder, or the file) and the notes added while writing.
        """
        raise NotImplementedError

    def rope(self, translation: Any, length: int, context: dict[str, Any]) -> EngineRope:
        """What the engine computes from a translation: the re-implementation of its own formulas.

        Args:
            translation: what ``translate`` returned.
            length: the sequence length [tokens].
            context: the patched layers' ``dim``, ``rope_theta``, ``original_max_position_embeddings``.

        Returns:
            The engine's ``inv_freq`` (``[d/2]``), cos/sin factor and temperature as an ``EngineRope``.
        """
        raise NotImplementedError(f"{self.name}: no re-implementation of its rope")

    def serve_command(self, translation: Any, path: Path, serve_length: int | None) -> str | None:
        """The command line that serves what was written.

        Args:
            translation: what ``translate`` returned.
            path: what ``write`` returned (the folder, or the file).
            serve_length: the served length [tokens] (None: the engine's default).

        Returns:
            The command, or None for an engine served from Python (transformers).
        """
        return None

    def usage(self, translation: Any, path: Path, command: str | None) -> str | None:
        """One line telling the user how to serve what was written.

        Args:
            translation: what ``translate`` returned.
            path: what ``write`` returned.
            command: what ``serve_command`` returned.

        Returns:
            The line (default: ``serve it with: COMMAND``), or None.
        """
        return None if command is None else f"serve it with: {command}"

    def describe(self, translation: Any) -> str:
        """What the export set, in one line.

        Args:
            translation: what ``translate`` returned.

        Returns:
            The line (a parity table's ``export`` column).
        """
        return ""


def write_model_folder(model, tokenizer, output: Path, config: dict[str, Any], record_file: str,
                       record: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    """What a folder engine (vLLM, MLX, SGLang) writes: ``save_patched``'s folder with ``config`` as its
    config.json and ``record`` (the engine's settings and notes) as ``record_file`` beside it, and
    ``generation``'s keys set in its generation_config.json, staged (whole or nothing). Returns ``output``."""
    with staged(output) as stage:
        save_patched(model, tokenizer, stage)
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n",
                                           encoding="utf-8")
        (stage / record_file).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
        write_generation(stage, stage, generation)
    return output


def write_generation(src: Path, dst: Path, generation: dict[str, Any] | None) -> None:
    """``dst``'s generation_config.json: ``src``'s (none: empty) with ``generation``'s keys set; nothing is
    written without keys. What an engine reads from the generation config (vLLM: Llama 4's
    ``attn_temperature_tuning``)."""
    if not generation:
        return
    path = Path(src) / "generation_config.json"
    written = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    (Path(dst) / "generation_config.json").write_text(json.dumps(written | generation, indent=2, sort_keys=True)
                                                      + "\n", encoding="utf-8")


ENGINES: Registry[type[Engine]] = Registry("engine", "engines", UnknownEngineError, package=__name__,
                                           plugins="ropescale.engines")


def engine_names() -> list[str]:
    """The registered engines' names.

    Returns:
        The names, bundled and plugins', sorted.
    """
    return ENGINES.names()


def get_engine(name: str, *, stacklevel: int = 2) -> Engine:
    """An engine by name.

    Args:
        name: the engine's name (an old name of ``ALIASES`` with a ``FutureWarning``).
        stacklevel: whose line the warning names, as ``warnings.warn``'s (2: the caller's).

    Returns:
        An instance of the engine.

    Raises:
        UnknownEngineError: no engine of that name (one line: a close match and the known names).
    """
    if isinstance(name, str) and name in ALIASES:
        warnings.warn(f"engine {name!r} is deprecated; use {ALIASES[name]!r}", FutureWarning,
                      stacklevel=stacklevel)
        name = ALIASES[name]
    return ENGINES.lookup(name)()

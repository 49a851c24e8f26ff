"""The steps of one run's lifecycle, shared by every kind of run — a sweep (``eval.sweep``), a
fine-tuning run (``ropescale.training.run``), a search by Optuna or by LongRoPE's evolution
(``eval.search``) — and ordered by the one run protocol, ``ropescale.runs.protocol``:

    folder → lock → tokenizer and data once → identity → manifest → model → T

- ``claimed_folder``: the output folder created and checked writable (``prepare_output``), then
  held under its lock (``folder_lock``) by the process that writes (the main one of a launched run);
  ``wait`` > 0 for the short holds of searches whose processes share one folder.
- ``load_inputs``: the model's tokenizer loaded once and the run's data read and tokenized once
  (``RunInputs``); every later step (the identity's data fingerprint, the model, the task's
  examples, a search's windows) takes them from there.
- ``run_identity``: what makes two runs the same experiment — the run's own fields, plus the
  weights' fingerprint, the data tokens' fingerprint and the library versions — checked and
  written by ``ropescale.runs.manifest.check_manifest``.
- ``load_run_model``: the weights, with the tokenizer already loaded (not loaded again), and any
  patch saved with the model removed (it would stack under the run's strategy).
- ``configured_window`` / ``loaded_window``: the training window T [tokens], from the run's
  override or else the model's config, read by the one reader ``ropescale.rope_config``
  (``model_training_window`` before the weights load, ``rope_context`` of a loaded model).
- ``check_strategy``: a strategy's output on the loaded model, computed and checked once (a patch
  made and undone), so a strategy that returns NaN frequencies, a wrong shape or a list is refused
  before the manifest, not at the run's first cell.

The order is the protocol's contract: everything that can refuse the input (a bad config, a model
that does not load, data too short) does so before the folder's manifest is written, so a corrected
rerun into the same folder is not refused as another experiment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from ropescale.runs.manifest import LOCK, data_fingerprint, environment, folder_lock, prepare_output
from ropescale.runs.processes import on_main

__all__ = ["RunInputs", "check_strategy", "claimed_folder", "configured_context", "configured_window", "load_inputs",
           "load_run_model", "loaded_window", "rotation_fingerprint", "run_identity", "versions"]


@dataclass
class RunInputs:
    """A run's tokenizer and data, each read once. ``texts``: the documents as read (None: the
    run reads no data); ``docs``: their token ids, one ``[n_tokens]`` int64 tensor per document."""

    tokenizer: Any
    texts: list[str] | None = None
    docs: list[torch.Tensor] | None = None

    @property
    def fingerprint(self) -> str | None:
        """sha256 of the documents' token ids (``data_fingerprint``), None without data."""
        return data_fingerprint(self.docs)


def load_inputs(model: str, data: DataSpec | None = None, *,
                check: Callable[[list[str]], None] | None = None) -> RunInputs:
    """The tokenizer of a model, loaded once, and a run's documents, read and tokenized once.

    Args:
        model: a Hugging Face model id, a local folder or ``reference``.
        data: the documents to read (None: no data, only the tokenizer).
        check: ``check(texts)``, called on the documents before they are tokenized (a search
            refusing held-out documents); None: no check.

    Returns:
        ``RunInputs``: the tokenizer, the texts and their token ids (one ``[n_tokens]`` int64
        tensor per document).

    Raises:
        ropescale.models.ModelLoadError: the tokenizer cannot be loaded (one line).
        ropescale.runs.data.DataError: the data cannot be read (one line).
    """
    from ropescale.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    if data is None:
        return RunInputs(tokenizer)
    texts = load_documents(data)
    if check is not None:
        check(texts)
    return RunInputs(tokenizer, texts, tokenize_documents(tokenizer, texts))


def load_run_model(model: str, inputs: RunInputs, *, dtype: str = "float32", device: str = "auto",
                   device_map: str | dict | None = None, unpatched: bool = True, local_attention: bool = False,
                   quantization: str | None = None) -> Any:
    """The weights of a run's model (``ropescale.models.load_model``), in eval mode.

    Args:
        model: a Hugging Face model id, a local folder or ``reference``.
        inputs: the run's inputs: their tokenizer is used, not loaded again.
        dtype: the weights' dtype (``float32``, ``bfloat16``, ``float16``).
        device: where the weights go (``auto``: a GPU if there is one).
        device_map: accelerate's placement over several devices (None: one device).
        unpatched: remove a patch saved with the model (the run applies its own).
        local_attention: sliding-window layers without n × n masks on the CPU
            (``ropescale.attention.local.enable_local_attention``: only where a check forward shows it
            exact), for runs that only evaluate.
        quantization: ``load_model``'s (``"nf4"``: QLoRA's 4-bit base; None: none).

    Returns:
        The loaded ``PreTrainedModel``.

    Raises:
        ropescale.models.ModelLoadError: the weights cannot be loaded (one line).
    """
    from ropescale.attention.local import enable_local_attention
    from ropescale.models import load_model
    from ropescale.patching import unpatch

    net, _ = load_model(model, dtype=dtype, device=device, device_map=device_map, tokenizer=inputs.tokenizer,
                        quantization=quantization)
    if unpatched:
        unpatch(net)
    if local_attention and device_map is None:
        enable_local_attention(net)
    return net


def versions(env: dict[str, Any] | None = None) -> dict[str, str]:
    """The library versions an identity records.

    Args:
        env: an ``environment()`` mapping (None: read now).

    Returns:
        ``{"ropescale": ..., "torch": ..., "transformers": ...}``.
    """
    env = environment() if env is None else env
    return {k: env[k] for k in ("ropescale", "torch", "transformers")}


def run_identity(fields: dict[str, Any], *, model: str, docs: list[torch.Tensor] | None,
                 env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The identity of a run: what makes two runs the same experiment (``check_manifest``).

    Args:
        fields: the run's own fields (task and options, a search's settings, a fine-tuning config).
        model: the model id or folder (its weights are fingerprinted: ``model_fingerprint``).
        docs: the tokens naming the run's data (each ``[n]`` int64; None: no data).
        env: an ``environment()`` mapping (None: read now).

    Returns:
        ``fields`` with ``weights``, ``data_tokens`` (``data_fingerprint`` of ``docs``) and ``versions``.
    """
    from ropescale.models import model_fingerprint

    return {**fields, "weights": model_fingerprint(model), "data_tokens": data_fingerprint(docs),
            "versions": versions(env)}


@contextmanager
def claimed_folder(output: str | Path, state: Any = None, *, wait: float = 0.0,
                   tidy: bool = False) -> Iterator[Path]:
    """A run folder created, checked writable and locked for the block. Under a launch every
    process raises the main process's refusal (``ropescale.runs.processes.on_main``).

    Args:
        output: the folder (created with its parents).
        state: accelerate's ``PartialState`` / ``Accelerator`` of a launched run, whose main process
            locks (None: this process).
        wait: seconds to wait for another run's lock (the short holds of searches sharing a folder).
        tidy: when the block raises, remove the folders this claim created if they hold nothing but
            the lock — a run refused before its manifest was written leaves nothing behind.

    Yields:
        The folder's ``Path``.

    Raises:
        ropescale.runs.manifest.OutputError: the folder cannot be written (one line).
        ropescale.runs.manifest.FolderBusyError: another run holds the lock past ``wait`` seconds.
    """
    path = Path(output)
    created = _missing(path) if tidy else []
    main = state is None or state.is_main_process
    with ExitStack() as held:
        def claim() -> Path:
            folder = prepare_output(path)
            held.enter_context(folder_lock(folder, wait=wait))
            return folder

        try:
            yield on_main(state, claim)
        except BaseException:
            if created and main:
                held.close()  # the lock released, then its file
                _remove_empty(created)
            raise


def _missing(path: Path) -> list[Path]:
    """The folders creating ``path`` would make, outermost first."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out[::-1]


def _remove_empty(folders: list[Path]) -> None:
    """``folders`` (outermost first) removed, innermost first, while each holds nothing but the lock."""
    for folder in reversed(folders):
        try:
            if {p.name for p in folder.iterdir()} <= {LOCK}:
                (folder / LOCK).unlink(missing_ok=True)
            folder.rmdir()
        except OSError:  # something was written there: kept
            return


def configured_window(model: str, override: int | None, *, missing_ok: bool = False) -> int | None:
    """T as a run will use it, read before any weights load.

    Args:
        model: a Hugging Face model id, a local folder or ``reference``.
        override: the run's ``original_max_position_embeddings`` (None: the model config's,
            ``model_training_window``).
        missing_ok: return None for a config that cannot be read or has no window (loading the
            model reports it later) instead of raising.

    Returns:
        T [tokens], or None (``missing_ok``).

    Raises:
        ropescale.models.ModelLoadError: the config cannot be read (one line).
        ropescale.errors.InvalidInput: the config has no window (one line).
    """
    if override:
        return override
    from ropescale.models import model_training_window

    try:
        return model_training_window(model)
    except (RopescaleError, ValueError, OSError):
        if missing_ok:
            return None
        raise


def configured_context(model: str) -> dict:
    """The strategies' context a patch of a model will have, read from its config before any
    weights load (``ropescale.models.model_rope_config``).

    Args:
        model: a Hugging Face model id, a local folder or ``reference``.

    Returns:
        d, b, T and, where the config has one, DCA's ``dual_chunk_attention_config``; {} for a
        config that cannot be read or has no RoPE (loading the model reports it).
    """
    from ropescale.models import model_rope_config

    try:
        return model_rope_config(model).context()
    except (RopescaleError, ValueError, OSError):
        return {}


def loaded_window(net: Any, name: str, override: int | None, *, purpose: str = "run") -> int:
    """T of a loaded model.

    Args:
        net: the loaded model.
        name: how messages name the model (its id, ``model: ID``).
        override: the run's ``original_max_position_embeddings`` (None: the rotary module's config,
            ``ropescale.rotary.rope_context``).
        purpose: what the run does to the model, for the message (``sweep``, ``search``).

    Returns:
        T [tokens].

    Raises:
        ropescale.rotary.NoRotaryEmbeddingError: the model has no rotary embedding (one line).
        ropescale.errors.InvalidInput: its config has no window (one line).
    """
    from ropescale.patching import NoRotaryEmbeddingError, find_rotary_modules, rope_context

    rotary = find_rotary_modules(net)
    if not rotary:
        raise NoRotaryEmbeddingError(f"{name}: no rotary embedding (no `inv_freq` buffer) to {purpose}")
    if override:
        return override
    window = rope_context(net, rotary[0][1])["original_max_position_embeddings"]
    if not window:
        raise InvalidInput(f"{name}: config has no max_position_embeddings; set original_max_position_embeddings")
    return window


def check_strategy(net: Any, strategy: str, *, length: int, **options: Any) -> str | None:
    """A strategy's output for a run at L = ``length`` tokens, computed and checked once before the run's
    manifest is written: ``net`` patched (``ropescale.patch``, ``options`` its keywords — T, the query
    temperature, the strategy's parameters) and the patch undone at once; a dynamic frequency strategy's
    output also computed at L on every patched frequency set, as a forward of L tokens will. What
    ``ropescale.strategies.registry.check_frequencies`` refuses (NaN or negative frequencies, a wrong
    shape, a list, a NaN attention factor) is refused here, before the run claims its folder, instead of
    at its first cell.

    Args:
        net: the loaded model (not patched; left as it was).
        strategy: the strategy's registry name.
        length: the longest length L the run scores with it [tokens].
        options: ``ropescale.patch``'s keywords for the run.

    Returns:
        For a static frequency strategy without log-n, the fingerprint of the rotation it leaves on the model
        (``rotation_fingerprint``): two cells whose fingerprints are equal compute the same numbers. None for
        a dynamic strategy (its frequencies follow each forward's length), an attention-side rule, or log-n.

    Raises:
        ropescale.errors.InvalidInput: what the patch refuses, the strategy's output included (one line).
    """
    from ropescale.patching import patch
    from ropescale.strategies import get_strategy

    strat = get_strategy(strategy)
    with patch(net, strategy, **options) as handle:
        if strat.kind == "frequency" and strat.dynamic:
            for context in handle.sites.values():
                strat.compute({**context, "seq_len": length}, handle.params)
        static = strat.kind == "frequency" and not strat.dynamic and not options.get("logn")
        return rotation_fingerprint(net, handle.report()) if static else None


def rotation_fingerprint(net: Any, report: list[dict[str, Any]]) -> str:
    """A hash of what a frequency patch leaves on ``net``: every ``*inv_freq`` buffer's bytes, every
    ``*attention_scaling`` factor, and the patch's per-layer report (``PatchHandle.report``: rope type, θ,
    channels, the query temperature kept or removed) without the strategy's name. Bit-identical rotations
    (``linear`` at factor 1 and ``vanilla``) hash alike; rotations that differ by one bit do not.

    Args:
        net: the patched model.
        report: the active patch's ``PatchHandle.report()``.

    Returns:
        16 hex digits of a SHA-256.
    """
    import hashlib
    import json

    h = hashlib.sha256()
    for name, buf in sorted(net.named_buffers(), key=lambda x: x[0]):
        if name.endswith("inv_freq"):
            h.update(name.encode())
            h.update(buf.detach().to("cpu", torch.float64).numpy().tobytes())
    for name, module in net.named_modules():
        for attr in sorted(a for a in vars(module) if a.endswith("attention_scaling")):
            h.update(f"{name}.{attr}={float(getattr(module, attr))!r}".encode())
    rows = [{k: v for k, v in row.items() if k != "applied"} for row in report]
    h.update(json.dumps(rows, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]

"""One run's lifecycle, shared by every kind of run — a sweep (``eval.sweep``), a fine-tuning run
(``ropescale.training.loop``), a search by Optuna or by LongRoPE's evolution (``eval.search``):

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

The order is the contract: everything that can refuse the input (a bad config, a model that does not
load, data too short) does so before the folder's manifest is written, so a corrected rerun into
the same folder is not refused as another experiment.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.runs.data import DataSpec, load_documents, tokenize_documents
from ropescale.runs.manifest import data_fingerprint, environment, folder_lock, prepare_output
from ropescale.runs.processes import on_main

__all__ = ["RunInputs", "claimed_folder", "configured_context", "configured_window", "load_inputs", "load_run_model",
           "loaded_window", "run_identity", "versions"]


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


def load_inputs(model: str, data: DataSpec | None = None, *, check=None) -> RunInputs:
    """The tokenizer of ``model`` (once) and the documents of ``data`` tokenized (once; None: no
    data). ``check(texts)``: called on the documents before they are tokenized (a search refusing
    held-out documents). Raises ``ropescale.models.ModelLoadError`` and
    ``ropescale.runs.data.DataError`` in one line."""
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
                   quantization: str | None = None):
    """The weights of ``model`` (``ropescale.models.load_model``) with the run's tokenizer, in eval
    mode; ``unpatched``: a patch saved with the model removed (the run applies its own).
    ``local_attention``: sliding-window layers without n × n masks on the CPU
    (``ropescale.attention.local.enable_local_attention``: only where a check forward shows it exact),
    for runs that only evaluate. ``quantization``: ``load_model``'s (``"nf4"``: QLoRA's 4-bit base)."""
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
    """The library versions an identity records (of ``environment()``: ropescale, torch, transformers)."""
    env = environment() if env is None else env
    return {k: env[k] for k in ("ropescale", "torch", "transformers")}


def run_identity(fields: dict[str, Any], *, model: str, docs: list[torch.Tensor] | None,
                 env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The identity of a run (``check_manifest``): its own ``fields`` (task and options, a search's
    settings, a fine-tuning config), ``weights`` (``model_fingerprint``), ``data_tokens``
    (``data_fingerprint`` of ``docs``; None without data) and ``versions``."""
    from ropescale.models import model_fingerprint

    return {**fields, "weights": model_fingerprint(model), "data_tokens": data_fingerprint(docs),
            "versions": versions(env)}


@contextmanager
def claimed_folder(output: str | Path, state=None, *, wait: float = 0.0):
    """``output`` created and checked writable (``OutputError``), then locked for the block by the
    main process of ``state`` (accelerate's ``PartialState``/``Accelerator``; None: this process):
    ``FolderBusyError`` when another run holds the lock past ``wait`` seconds. Under a launch every
    process raises the main process's refusal (``ropescale.runs.processes.on_main``). Yields the path."""
    with ExitStack() as held:
        def claim() -> Path:
            folder = prepare_output(Path(output))
            held.enter_context(folder_lock(folder, wait=wait))
            return folder

        yield on_main(state, claim)


def configured_window(model: str, override: int | None, *, missing_ok: bool = False) -> int | None:
    """T as a run will use it, read before any weights load: ``override`` (the run's
    ``original_max_position_embeddings``), else the model config's (``model_training_window``).
    Raises ``ModelLoadError`` / ``InvalidInput`` in one line for a config that cannot be read or
    has no window; ``missing_ok``: None then instead (loading the model reports it later)."""
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
    """The strategies' context a patch of ``model`` will have, read from its config before any
    weights load (``ropescale.models.model_rope_config``: d, b, T and, where the config has one,
    DCA's ``dual_chunk_attention_config``); {} for a config that cannot be read or has no RoPE
    (loading the model reports it)."""
    from ropescale.models import model_rope_config

    try:
        return model_rope_config(model).context()
    except (RopescaleError, ValueError, OSError):
        return {}


def loaded_window(net, name: str, override: int | None, *, purpose: str = "run") -> int:
    """T of a loaded model: ``override``, else its rotary module's config
    (``ropescale.rotary.rope_context``). Raises ``NoRotaryEmbeddingError`` for a model without a
    rotary embedding (nothing to ``purpose``) and ``InvalidInput`` for a config without a window;
    both one line naming ``name``."""
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

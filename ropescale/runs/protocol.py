"""The one run protocol: every kind of run — a sweep (``eval.sweep``), a fine-tuning run
(``ropescale.training.run``), a search by Optuna or by LongRoPE's evolution (``eval.search``) — is a
``RunKind``, and ``execute_run`` orders its steps (torchtune's recipe interface, with the folder's
lifecycle in one place)::

    check → folder → lock → tokenizer and data once → identity → manifest checked
          → preparation (model → T → what else can refuse) → manifest written → execution

A kind supplies only what is its own: ``check`` (what can be refused with nothing loaded), ``data``
and ``check_documents`` (what it reads), ``identity`` (its own fields and the tokens that name its
data: ``ropescale.runs.lifecycle.run_identity`` adds the weights' fingerprint and the versions),
``prepare`` (the model, T and everything else that can refuse the input; it sees the folder's state:
finished cells, a trained model), ``claim``, ``execute`` and ``finish``. No caller orders these
steps itself. The run's ``threads`` hold from ``check`` to ``finish``, and the process's own thread
count is back when the run ends, however it ends (``ropescale.runs.processes.run_threads``).

The order is the contract: a folder holding another experiment is refused before the model loads
(the manifest checked), and everything that can refuse the input does so before the manifest is
written, so a corrected rerun into the same folder is not refused as another experiment. A folder
the run created is removed again when the run is refused before its manifest is written
(``claimed_folder``'s ``tidy``): a refused run leaves nothing behind.

One kind shares its folder (``shares_folder``): the processes of one Optuna search run the same
study in one folder. It prepares everything before the folder is touched (a model load would hold
the others past ``lock_wait``), and holds the lock only to check and write the manifest and to
``claim`` (create the study) and to ``finish`` (write the outputs); it executes unlocked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch

from ropescale.runs.data import DataSpec
from ropescale.runs.lifecycle import RunInputs, claimed_folder, load_inputs, run_identity
from ropescale.runs.manifest import check_manifest, environment
from ropescale.runs.processes import run_threads

__all__ = ["RunFolder", "RunKind", "execute_run"]


@dataclass(frozen=True)
class RunFolder:
    """A claimed run folder: its ``path``, the ``experiment`` (the identity's hash, as
    ``check_manifest`` returns it: part of every cell id, a study's name) and the ``identity``."""

    path: Path
    experiment: str
    identity: dict[str, Any]


class RunKind:
    """One kind of run, run by ``execute_run``. Subclasses set ``cfg`` (a
    ``ropescale.runs.config.RunConfig``) and ``state`` (accelerate's ``PartialState`` /
    ``Accelerator`` of a launched run; None: this process alone), and define ``identity`` and
    ``execute``; the other steps default to nothing."""

    cfg: Any
    state: Any = None
    shares_folder: ClassVar[bool] = False  # processes share the folder: the lock held only to claim it
    lock_wait: ClassVar[float] = 0.0  # seconds to wait for another process's hold of the lock

    @cached_property
    def env(self) -> dict[str, Any]:
        """The environment the run records (``ropescale.runs.manifest.environment``), read once."""
        return environment()

    def config(self) -> dict[str, Any]:
        """The config the manifest records.

        Returns:
            The run's config as JSON values.
        """
        return self.cfg.model_dump(mode="json")

    def check(self) -> None:
        """Refuse, in one line, what needs nothing loaded; runs before anything is read or written."""

    def data(self) -> DataSpec | None:
        """The documents the run reads.

        Returns:
            Their ``DataSpec``; None: none (only the tokenizer is loaded).
        """
        return self.cfg.data.spec()

    def check_documents(self, texts: list[str]) -> None:
        """Refuse the documents as read, before they are tokenized (a search's held-out check).

        Args:
            texts: the documents.
        """

    def identity(self, inputs: RunInputs) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
        """What makes two runs of this kind the same.

        Args:
            inputs: the tokenizer and data, read once.

        Returns:
            ``(fields, docs)``: the run's own identity fields, and the token tensors that name its data
            (each ``[n]`` int64; None: no data).
        """
        raise NotImplementedError

    def prepare(self, inputs: RunInputs, folder: RunFolder | None) -> None:
        """Everything that can refuse the input: the model, T, examples, the wrapped model.

        Args:
            inputs: the tokenizer and data, read once.
            folder: the claimed folder, its manifest checked but not written (None: a shared folder,
                not touched yet).
        """

    def claim(self, folder: RunFolder) -> None:
        """What is created under the lock once the manifest is written (a shared study).

        Args:
            folder: the claimed folder.
        """

    def execute(self, folder: RunFolder) -> Any:
        """The run itself.

        Args:
            folder: the claimed folder, its manifest written.

        Returns:
            What ``finish`` takes.
        """
        raise NotImplementedError

    def finish(self, folder: RunFolder, result: Any) -> Any:
        """What is written once the run ends (a shared folder's: under the lock again, one process at
        a time).

        Args:
            folder: the claimed folder.
            result: what ``execute`` returned.

        Returns:
            ``execute_run``'s result (default: ``result``).
        """
        return result


def _inputs_and_identity(kind: RunKind) -> tuple[RunInputs, dict[str, Any]]:
    """The tokenizer and data, once, and the full identity (``run_identity``)."""
    inputs = load_inputs(kind.cfg.model, kind.data(), check=kind.check_documents)
    fields, docs = kind.identity(inputs)
    return inputs, run_identity(fields, model=kind.cfg.model, docs=docs, env=kind.env)


def execute_run(kind: RunKind, output: str | Path) -> Any:
    """Run a kind of run into its folder, in the protocol's order (see the module).

    Args:
        kind: the run (a ``RunKind``: a sweep, a fine-tuning run, a search).
        output: the run's folder (one run per folder; created with its parents).

    Returns:
        What ``kind.finish`` returns (by default, ``kind.execute``'s result).

    Raises:
        ropescale.runs.manifest.OutputError: the folder cannot be written (one line).
        ropescale.runs.manifest.FolderBusyError: another run holds the folder.
        ropescale.runs.manifest.ExperimentMismatchError: the folder holds another experiment (under a
            launch, this and the above on every process).
        ropescale.errors.RopescaleError: the kind's own refusals, each in one line.
    """
    with run_threads(getattr(kind.cfg, "threads", None)):  # the process's own count back when the run ends
        return _execute(kind, output)


def _execute(kind: RunKind, output: str | Path) -> Any:
    """``execute_run``'s steps, in the protocol's order."""
    kind.check()
    if kind.shares_folder:
        inputs, ident = _inputs_and_identity(kind)
        kind.prepare(inputs, None)
        with claimed_folder(output, kind.state, wait=kind.lock_wait) as path:
            folder = RunFolder(path, check_manifest(path, ident, kind.config(), kind.state), ident)
            kind.claim(folder)
        result = kind.execute(folder)
        with claimed_folder(output, kind.state, wait=kind.lock_wait):
            return kind.finish(folder, result)
    with claimed_folder(output, kind.state, wait=kind.lock_wait, tidy=True) as path:
        inputs, ident = _inputs_and_identity(kind)
        # checked now (every process, no write), written once everything that can refuse has run
        folder = RunFolder(path, check_manifest(path, ident, kind.config(), kind.state, write=False), ident)
        kind.prepare(inputs, folder)
        check_manifest(path, ident, kind.config(), kind.state)
        return kind.finish(folder, kind.execute(folder))

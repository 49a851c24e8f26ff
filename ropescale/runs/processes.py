"""The processes of a launched run (``accelerate launch``, torchrun): one process group for the
life of the process, and the steps only the main process takes whose outcome every process must act on.

**One group per process.** torch cannot set a gloo group up a second time in a launched process:
the new group takes the closed one's name while the launcher's store still holds the old peers'
addresses, so its connect hangs or times out ("Gloo connectFullMesh failed"). A fine-tuning run's
after-training evaluations did exactly that when each evaluation closed the group and the next
set it up again. So no run closes the group: every run in a launched process works on the group
accelerate set up for the first one (``process_state``), and it is closed once, when the
interpreter exits (left open there, gloo can abort: "terminate called without an active
exception"). A run that fails leaves it to that exit, which also ends the other processes' wait
in their next collective.

**Decisions shared.** A refusal only the main process can see — the folder's lock held by another
run, a manifest naming another experiment, a tracker that cannot write its folder — raised there
alone leaves the other processes in their next collective until the main one exits, where they
end in gloo's "Connection closed by peer" tracebacks. ``on_main`` runs such a step on the main
process and gives its result, or raises its error, on every process: each prints the same line.

**Threads for the run.** A run's ``threads`` sets torch's intra-op thread count for that run only
(``run_threads``): the count the process had is back when the run ends, refused or failed too, so a
notebook or a test that runs a sweep does not keep its setting.
"""

from __future__ import annotations

import atexit
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ropescale.errors import RopescaleError

__all__ = ["keep_group", "on_main", "process_state", "run_threads"]

T = TypeVar("T")


def process_state(cpu: bool):
    """accelerate's ``PartialState`` of this process: under a launch, the process group it sets
    up (once per process: gloo on CPUs, NCCL on GPUs) or the one an earlier run set up, kept open
    until the interpreter exits (``keep_group``). ``cpu``: processes started by torchrun on a
    machine without GPUs form one gloo group (without it each would run alone)."""
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    keep_group(state)
    return state


@contextmanager
def run_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` while the block runs (None: left as it is), and
    the count before put back when it ends, however it ends (``torch.set_num_threads`` is process-wide).

    Args:
        threads: the run's ``threads`` (``ropescale.runs.config.RunConfig``), or None.
    """
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def keep_group(state) -> None:
    """Close the process group of ``state`` (a launched ``PartialState`` / ``Accelerator``) when the
    interpreter exits, once however many runs ask; nothing for a single process."""
    if state.num_processes > 1 and dist.is_initialized():
        atexit.unregister(_close_group)
        atexit.register(_close_group)


def _close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _portable(err: Exception) -> Exception:
    """``err`` as it can travel to the other processes (pickled): itself, or — for an exception
    that does not survive pickling — one of its kind's base: a ``RopescaleError`` (the CLI's one
    line) or a ``RuntimeError`` with its message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 — any failure to round-trip means: send a plain copy
        kind = RopescaleError if isinstance(err, RopescaleError) else RuntimeError
        return kind(str(err))


def on_main(state, step: Callable[[], T]) -> T:
    """``step()`` on the main process of ``state`` (accelerate's ``PartialState`` /
    ``Accelerator``; None or one process: here), its result (picklable) returned on every process.
    When it raises an ``Exception``, every process raises it: the main process its own, the others a
    copy (same type and message), so a launched run refuses in the same one line on every rank
    instead of leaving the others in a collective. A collective: every process must call it."""
    if state is None or state.num_processes == 1:
        return step()
    from accelerate.utils import broadcast_object_list

    outcome: list[Any] = [None, None]  # [result, error]
    own = None
    if state.is_main_process:
        try:
            outcome[0] = step()
        except Exception as e:  # noqa: BLE001 — raised below on every process
            own, outcome[1] = e, _portable(e)
    broadcast_object_list(outcome)
    if own is not None:
        raise own
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]

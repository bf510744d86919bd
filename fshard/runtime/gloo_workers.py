"""Gloo groups with one worker thread: fshard's shim for a race inside torch's gloo backend.

After running a collective, each of a ``ProcessGroupGloo``'s worker threads writes the
group's status (``pgStatus_->lastCompletedWorkName``, a ``std::string``) without a lock.
With two workers (torch's default) the next collective on the group, started as soon as
the first completes, can reach the same write on the other worker: for a name too long for
the string's inline buffer (``ALLGATHER_COALESCED``, the functional all-gather) that is a
double free or a write into freed memory, and the rank dies of SIGSEGV or a malloc abort
(docs/reliability.md, "Seen again"). With one worker the writes are sequential.

torch builds every gloo group in ``distributed_c10d._new_process_group_helper`` with
``ProcessGroupGloo(store, rank, size, timeout=...)`` and ignores gloo options given to
``new_group``, so :func:`one_worker` swaps that module's ``ProcessGroupGloo`` for a
subclass whose timeout-only constructor asks for one worker, for the duration of fshard's
own group-creation calls. fshard keeps at most one collective in flight per group
(``fshard.comm.one_at_a_time``), so a second worker never had work to run in parallel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["one_worker", "worker_threads"]


@functools.cache
def _one_worker_class(base: Any) -> Any:
    class OneWorkerGloo(base):
        _fshard_one_worker = True

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = timedelta(seconds=1800)) -> None:
            if isinstance(timeout, base._Options):  # options given: the caller chose
                super().__init__(store, rank, size, timeout)
                return
            opts = base._Options()
            opts._threads = 1
            opts._timeout = timeout
            opts._devices = [base.create_default_device()]
            super().__init__(store, rank, size, opts)

    OneWorkerGloo.__qualname__ = OneWorkerGloo.__name__ = "ProcessGroupGloo"
    return OneWorkerGloo


@contextlib.contextmanager
def one_worker() -> Iterator[None]:
    """Within the block, every gloo group torch creates has one worker thread.

    Nests; without gloo in this torch build it does nothing. Not thread-safe: it swaps a
    module global, so only the thread creating groups (the main one) may use it.
    """
    base: Any = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or getattr(base, "_fshard_one_worker", False):
        yield
        return
    setattr(c10d, "ProcessGroupGloo", _one_worker_class(base))  # noqa: B010 (mypy: a class)
    try:
        yield
    finally:
        setattr(c10d, "ProcessGroupGloo", base)  # noqa: B010


def worker_threads(group: Any = None) -> int | None:
    """The worker threads of ``group``'s gloo backend (default: the world), or None if not gloo."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend (an NCCL-only group)
        return None
    threads = getattr(getattr(backend, "options", None), "_threads", None)
    return int(threads) if isinstance(threads, int) and dist.get_backend(group) == "gloo" else None

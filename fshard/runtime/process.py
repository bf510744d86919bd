"""Process start: ``fs.init()`` from torchrun's environment, or a one-process world.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. With all of them, :func:`init` starts the default process group
(nccl when CUDA is available, gloo otherwise). With none of them this is one process
and :func:`init` does nothing; :func:`ensure_initialized` later starts a one-rank group
in memory because torch's ``DeviceMesh`` needs a group even for one rank: nccl when
CUDA is available (so one process computes on the GPU, as ``torchrun
--nproc-per-node 1`` does), else gloo.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fshard.runtime import failure, gloo_workers, teardown

__all__ = [
    "init",
    "started",
    "is_rank0",
    "ensure_initialized",
    "enable_fault_stacks",
    "group_timeout",
    "DEFAULT_TIMEOUT",
]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FALLBACK_TIMEOUT_S = 300.0


def _env_timeout() -> timedelta:
    """``FSHARD_TIMEOUT_S`` as read now (not at import: a script may set it after importing
    fshard), else 300 s.

    Raises:
      ValueError: the variable is not a positive number; the message names it and its value.
    """
    raw = os.environ.get("FSHARD_TIMEOUT_S")
    if raw is None:
        return timedelta(seconds=_FALLBACK_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")  # refused below, with the text as it was given
    if not seconds > 0:
        raise ValueError(
            f"FSHARD_TIMEOUT_S must be a positive number of seconds, got {raw!r} in the "
            f"environment. Set it to e.g. 300, or unset it for the default (300 s)."
        )
    return timedelta(seconds=seconds)


def _checked_timeout(seconds: float, *, what: str) -> timedelta:
    if not seconds > 0:  # also refuses NaN
        raise ValueError(f"{what} must be a positive number of seconds, got {seconds!r}.")
    return timedelta(seconds=seconds)


def _import_time_timeout() -> timedelta:
    # A bad FSHARD_TIMEOUT_S must not break `import fshard`: fs.init reports it when used.
    try:
        return _env_timeout()
    except ValueError:
        return timedelta(seconds=_FALLBACK_TIMEOUT_S)


# The timeout at import, kept for callers that read it; fshard itself asks group_timeout().
DEFAULT_TIMEOUT = _import_time_timeout()


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(*, backend: str | None = None, timeout: timedelta | float | None = None) -> None:
    """Starts the default process group from torchrun's environment.

    A no-op when the group already exists or when no torchrun variable is set (one
    process). On CUDA with nccl, binds this process to GPU ``LOCAL_RANK``. Enables
    :func:`enable_fault_stacks`, so that a rank killed by a fatal signal prints every
    thread's Python stack on stderr instead of vanishing without a word. Registers
    :func:`fshard.shutdown` to run at exit (after a clean end of the program; see
    :mod:`fshard.runtime.teardown`): it completes fshard's collectives still in flight,
    destroys the process groups and joins gloo's threads before the interpreter
    finalizes, where a late gloo worker would abort the process.

    Args:
      backend: ``"nccl"`` or ``"gloo"``; default nccl when CUDA is available, else gloo.
      timeout: how long a collective may wait before failing (seconds or timedelta);
        default ``FSHARD_TIMEOUT_S`` from the environment, else 300 s. Every group
        fshard makes later (mesh axes, multi-axis groups, pipeline and checkpoint groups)
        gets the same timeout (:func:`group_timeout`).

    Raises:
      RuntimeError: some but not all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are
        set, or they are not consistent; the message names the missing ones.
      ValueError: ``timeout`` or ``FSHARD_TIMEOUT_S`` is not a positive number.
    """
    if dist.is_initialized():
        return
    present = [v for v in TORCHRUN_VARS if v in os.environ]
    if not present:
        return
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"fs.init(): partial torchrun environment: {present} are set but {missing} are "
            f"not. Launch with `torchrun --nproc-per-node N script.py`, or unset "
            f"{present} to run as one process."
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as e:
        raise RuntimeError(f"fs.init(): RANK/WORLD_SIZE must be integers: {e}") from None
    if not 0 <= rank < world:
        raise RuntimeError(f"fs.init(): RANK={rank} is not in [0, WORLD_SIZE={world}).")
    enable_fault_stacks()
    backend = backend or _default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with gloo_workers.one_worker():  # torch's two gloo workers race (fshard.runtime.gloo_workers)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=_timeout(timeout))
    teardown.install_at_exit(owned=True)  # gloo's threads must be gone before finalization
    if world > 1:  # an uncaught error says whether this rank is the cause or a casualty
        failure.install(
            dist.distributed_c10d._get_default_store(),
            rank,
            world,
            heartbeat_s=failure.heartbeat_period(group_timeout()),
        )


def enable_fault_stacks(file=None) -> bool:
    """Makes a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) print every thread's
    Python stack, as ``PYTHONFAULTHANDLER=1`` would.

    A rank that dies of heap corruption or a segfault otherwise exits without a word,
    and the other ranks only report a lost connection. Keeps a handler that is already
    enabled (``PYTHONFAULTHANDLER``, ``python -X faulthandler``, or the caller's own).

    Args:
      file: where to write (default: the process's stderr).

    Returns:
      Whether faulthandler is enabled now (False when there is no stream to write to,
      e.g. a GUI with no stderr).
    """
    if faulthandler.is_enabled():
        return True
    stream = file if file is not None else (sys.stderr or sys.__stderr__)
    try:
        faulthandler.enable(file=stream, all_threads=True)  # type: ignore[arg-type]
    except (AttributeError, ValueError, OSError, RuntimeError):  # no real file descriptor (a notebook's
        try:  # stream): fall back to fd 2
            faulthandler.enable(file=sys.__stderr__, all_threads=True)  # type: ignore[arg-type]
        except (AttributeError, ValueError, OSError, RuntimeError):
            return False
    return True


def _timeout(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return _env_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return _checked_timeout(seconds, what="fs.init(timeout=...)")


def group_timeout() -> timedelta:
    """The timeout every process group fshard creates must get: the world group's.

    The one source of truth. The world group carries the configured timeout
    (``fs.init(timeout=)``, else ``FSHARD_TIMEOUT_S``, else 300 s; in a
    ``fs.run_local`` rank, its ``timeout_s``), so a sub-group that copies it fails as soon
    as the world would. torch gives a group made without an explicit timeout its own
    default (30 minutes for gloo) instead, whatever the world's is: every
    ``new_group``/``new_subgroups_by_enumeration``/``init_device_mesh`` call in fshard passes
    this value. Without a world group (or one whose timeout cannot be read), the
    configured default.
    """
    if dist.is_initialized():
        found = read_group_timeout(dist.group.WORLD)
        if found is not None:
            return found
    return _env_timeout()


def read_group_timeout(group) -> timedelta | None:
    """The timeout ``group``'s backend was made with, or ``None`` when torch does not say.

    Reads ``ProcessGroup._get_backend(device).options._timeout``: torch 2.13 has no public
    getter, and this is where both gloo and nccl keep the value they enforce.
    """
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue  # no backend for this device, or a backend without options
    return None


def ensure_initialized(n_ranks_wanted: int) -> None:
    """Makes sure a default group exists: torchrun's, or a one-rank in-memory group.

    The one-rank group uses the backend :func:`init` would pick (nccl on a CUDA machine,
    on the current device), so the mesh of a plain ``python script.py`` computes where
    the same script under ``torchrun --nproc-per-node 1`` would, not on the CPU.

    Raises:
      ValueError: no process group, no torchrun environment, and more than one rank
        wanted; the message says how to get more ranks.
    """
    if dist.is_initialized():
        return
    init()
    if dist.is_initialized():
        return
    if n_ranks_wanted != 1:
        raise ValueError(
            f"a mesh of {n_ranks_wanted} ranks needs {n_ranks_wanted} processes, but this is a "
            f"single process with no torchrun environment. Run under `torchrun "
            f"--nproc-per-node {n_ranks_wanted}`, or call your function through "
            f"fs.run_local(fn, world_size={n_ranks_wanted})."
        )
    with gloo_workers.one_worker():
        dist.init_process_group(
            _default_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=_env_timeout()
        )
    teardown.install_at_exit(owned=True)  # one rank's gloo group has worker threads too


def is_rank0() -> bool:
    """Whether this process speaks for the job (prints, writes logs): rank 0 of the default
    group, a process with no group, or the process of an ``fs.simulate`` (which is every rank).

    Use it where a script says ``dist.get_rank() == 0``: under ``fs.simulate`` that branch is
    per-rank Python and raises.
    """
    from fshard.runtime import simulation

    if simulation.active() is not None or not dist.is_initialized():
        return True
    return dist.get_rank() == 0


def started(simulate: int | None = None) -> contextlib.AbstractContextManager:
    """The process group a script runs in: ``fs.simulate(simulate)`` when given (n ranks in
    this process), else :func:`init`'s (torchrun's, or none for one process) and a no-op context.

    Usage: ``with fs.runtime.started(args.simulate): ...`` at the top of a script's ``main``.
    """
    if simulate:
        from fshard.runtime.simulation import simulate as simulated

        return simulated(simulate)
    init()
    return contextlib.nullcontext()

"""Teardown before the interpreter finalizes: ``fs.shutdown()`` and the hook ``fs.init()`` registers.

Why: gloo runs a process group's collectives on worker threads. When a worker has run a
collective it drops its own reference to it; if that is the last reference to a tensor
whose Python object torch has kept alive (the caller dropped the tensor while the
collective still held it), dropping it takes the GIL. Once the interpreter is
finalizing, CPython ends any other thread that asks for the GIL (``pthread_exit``); the
unwinding meets the collective's C++ destructor, which may not throw, and the C++
runtime calls ``std::terminate``: ``terminate called without an active exception``, the
rank dies of SIGABRT after its work was done. Seen in a core dump (docs/reliability.md,
"The abort at exit"): the gloo worker in ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` ->
``take_gil`` -> ``PyThread_exit_thread`` -> ``std::terminate``, the main thread in
``Py_FinalizeEx``. A worker that is merely late to drop a collective the main thread
already waited for (a busy machine) is enough. torch does not tear its groups down at
exit (pytorch/pytorch#179291 tried, and was abandoned), and ``destroy_process_group()``
alone does not stop a group's threads while anything still references the group (a
mesh's sub-groups, fshard's caches).

So the teardown, while the interpreter is still whole: completes the collectives fshard
still has in flight, destroys every process group, drops fshard's own references to
groups (the mesh cache and each mesh's sub-groups, the checkpoint group, the in-flight
records, the handles of finished collectives) and collects them, which destroys the groups'
C++ objects; their destructors join the gloo workers (without the GIL, so a worker that needs it can finish). After
it, no gloo worker is left to run into the finalizing interpreter, unless user code
still holds a group of its own (``dist.new_group()``).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import sys
from typing import Any, Callable, Iterable

import attrs
import torch.distributed as dist

__all__ = [
    "shutdown",
    "install_at_exit",
    "at_exit_enabled",
    "register_before_shutdown",
    "release_groups",
    "GroupOwner",
    "register_group_owner",
    "group_owners",
]

# owned: fshard started the default group (fs.init or the one-rank group), so the hook
# may destroy it; failed: an uncaught exception reached sys.excepthook.
_STATE: dict[str, bool] = {"owned": False, "installed": False, "failed": False}
TIMEOUT_S = float(os.environ.get("FSHARD_TEARDOWN_TIMEOUT_S", "60"))
# Work that must end before the groups go, registered by the packages that own it (the
# checkpoint's background saves); mesh/ does not import them, they import mesh/.
_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def _nothing() -> None:
    return None


def _no_groups() -> Iterable[Any]:
    return ()


@attrs.frozen
class GroupOwner:
    """A module that keeps process groups (or work on them), as teardown sees it.

    Attributes:
      name: the owner, for messages (``"fshard.comm"``).
      groups: the groups it made, destroyed by :func:`release_groups`.
      forget: drops every reference it keeps to a group (after they are destroyed).
      drain: completes its work still in flight on the groups, before any is destroyed;
        raises if that work failed.
      after_fork: in a forked child (``fs.run_local``'s ranks): returns what the parent's
        objects were (kept alive forever: their destructors would join threads that did not
        survive the fork) and leaves the owner empty.
    """

    name: str
    groups: Callable[[], Iterable[Any]] = _no_groups
    forget: Callable[[], None] = _nothing
    drain: Callable[[], Any] = _nothing
    after_fork: Callable[[], Any] = _nothing


# Registered by the owners when they are imported (mesh, comm, checkpoint); teardown imports
# none of them, so a module that was never imported made no group and is not asked.
_OWNERS: dict[str, GroupOwner] = {}


def register_group_owner(owner: GroupOwner) -> None:
    """Makes :func:`shutdown`, :func:`release_groups` and ``fs.run_local``'s ranks ask
    ``owner`` for its groups (once per name; a module imported again replaces its entry)."""
    _OWNERS[owner.name] = owner


def group_owners() -> tuple[GroupOwner, ...]:
    """The registered owners, in registration order."""
    return tuple(_OWNERS.values())


def register_before_shutdown(fn: Callable[[], None]) -> None:
    """Makes :func:`shutdown` call ``fn()`` first, before any group is destroyed (once per ``fn``).

    ``fn`` must bound its own wait and raise to report a failure: :func:`shutdown` then
    destroys the groups anyway and raises that error.
    """
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def owns_default_group() -> bool:
    """Whether fshard started the default group (``fs.init`` or the one-rank group)."""
    return _STATE["owned"]


def at_exit_enabled() -> bool:
    """Whether the hook is wanted (``FSHARD_TEARDOWN_AT_EXIT=0`` turns it off)."""
    return os.environ.get("FSHARD_TEARDOWN_AT_EXIT", "1") != "0"


def shutdown() -> None:
    """Completes fshard's collectives in flight, destroys every process group, joins gloo's threads.

    Call it where a script's distributed work ends (``fs.init()`` also runs it at exit
    when it started the default group). Collective: every rank calls it, after the same
    collectives. Idempotent; a no-op without torch.distributed. Meshes made before it
    cannot be used after it.

    Waits first for what registered itself with :func:`register_before_shutdown`: the
    checkpoint's background saves (bounded by the groups' timeout, with a message).

    Raises:
      RuntimeError: a collective in flight failed (e.g. a peer is gone); the groups are
        destroyed and fshard's references dropped anyway.
      fshard.checkpoint.CheckpointError: a background save failed or did not finish in
        time; the groups are destroyed anyway.
    """
    if not dist.is_available():
        return
    try:
        _drain()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_groups()
        # The groups' last references are gone: their destructors run here and join the
        # gloo workers, while the interpreter can still give them the GIL.
        gc.collect()


def _drain() -> None:
    """Completes the work still in flight on fshard's groups: first what registered with
    :func:`register_before_shutdown` (the checkpoint's background saves, bounded), then each
    owner's ``drain`` (fshard.comm: at most one collective per gloo group). Raises the first
    failure."""
    for fn in list(_BEFORE_SHUTDOWN):
        fn()
    for owner in group_owners():
        owner.drain()


def release_groups() -> None:
    """Destroys the process groups fshard made (meshes' sub-groups, the checkpoint groups),
    keeping the default group, and forgets every mesh.

    Why: each gloo group runs a transport thread that wakes every 10 ms for as long as the
    group lives, idle or not. A long-lived process that has made many meshes (a test
    suite's worker ranks, a notebook) pays for all of them, a share of a core busy doing
    nothing (``bench/README.md``, "Host costs behind the code"). The next ``make_mesh`` builds
    its groups again (milliseconds).

    Collective: every rank calls it, with no collective of those groups in flight on any
    rank (it completes fshard's own first). Meshes made before it cannot be used after it.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    try:
        _drain()
        groups = {id(g): g for owner in group_owners() for g in owner.groups() if g is not None}
        world = dist.GroupMember.WORLD
        for g in groups.values():
            if g is world:
                continue
            try:
                dist.destroy_process_group(g)
            except ValueError:  # the program destroyed it already: "Invalid process group specified"
                pass
    finally:
        _forget_groups()
        gc.collect()  # the groups' last references: their destructors join the gloo threads


def _forget_groups() -> None:
    """Drops every reference fshard keeps to a process group."""
    for owner in group_owners():
        owner.forget()


def install_at_exit(*, owned: bool) -> None:
    """Registers the teardown at exit (once); ``owned``: fshard started the default group.

    The hook runs only when fshard started the default group (a group the caller made
    with ``dist.init_process_group`` is the caller's to destroy: ``fs.shutdown()``), when
    no uncaught exception ended the program (other ranks may then be gone or stuck, and
    this rank must exit without waiting for them), and unless ``FSHARD_TEARDOWN_AT_EXIT=0``.
    If it blocks longer than ``FSHARD_TEARDOWN_TIMEOUT_S`` (60 s; a peer stopped
    mid-collective without dying), faulthandler prints every thread's stack and the
    process exits with status 1.
    """
    _STATE["owned"] = _STATE["owned"] or owned
    if _STATE["installed"]:
        return
    _STATE["installed"] = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _STATE["failed"] = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    atexit.register(_at_exit)


def _at_exit() -> None:
    if not (_STATE["owned"] and at_exit_enabled()) or _STATE["failed"]:
        return
    stream = sys.stderr or sys.__stderr__
    try:
        faulthandler.dump_traceback_later(TIMEOUT_S, exit=True, file=stream)  # type: ignore[arg-type]
        armed = True
    except (AttributeError, ValueError, OSError, RuntimeError):  # no file descriptor to write to
        armed = False
    try:
        shutdown()
    except Exception as e:  # exiting anyway: say why the teardown stopped, not a traceback
        print(f"fshard: teardown at exit: {e}", file=stream, flush=True)
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()

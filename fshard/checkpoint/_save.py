"""``save``: a pytree into a DCP checkpoint directory, synchronously or in the background."""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import copy
import os
import shutil
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fshard.checkpoint import _dirs, _lock, _simulated, _space
from fshard.checkpoint._checksums import ChecksumWriter, write_checksums, write_manifest
from fshard.checkpoint._common import (
    CheckpointError,
    CheckpointException,
    agree,
    agree_on_path,
    broadcast_from_0,
    describe_failure,
    flatten,
    group,
    rank_of,
    single_process_quiet,
    timeout,
)
from fshard.checkpoint._verify import check_written
from fshard.runtime import teardown

__all__ = ["PendingSave", "drain", "save", "wait"]


class PendingSave:
    """A save that may still be running; returned by :func:`save`.

    Attributes:
      path: the checkpoint directory it writes.
    """

    def __init__(self, path: str, future: cf.Future) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the checkpoint is committed at :attr:`path` on every rank.

        Args:
          timeout: seconds to wait at most (default: no limit).

        Raises:
          CheckpointError: the save failed; the previous checkpoint at :attr:`path`, if
            any, is unchanged.
          TimeoutError: still running after ``timeout`` seconds.
        """
        try:
            self._future.result(timeout=timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to '{self.path}' is still running after {timeout} s.") from None
        finally:
            if self._future.done():
                _forget(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"PendingSave('{self.path}', {state})"


# At most one save runs at a time per process: the checkpoint group's collectives must
# come in the same order on every rank, and a later save may replace the same path.
_LOCK = threading.Lock()
_PENDING: list[PendingSave] = []
_EXECUTOR: cf.ThreadPoolExecutor | None = None


def _forget(handle: PendingSave) -> None:
    with _LOCK:
        if handle in _PENDING:
            _PENDING.remove(handle)


def wait() -> None:
    """Waits for every save of this process still running (see ``save(..., blocking=False)``).

    :func:`save` and :func:`fshard.checkpoint.load` call it first, so checkpoints are
    written and read in program order.

    Raises:
      CheckpointError: a background save failed (raised once, here or by its handle).
    """
    while True:
        with _LOCK:
            if not _PENDING:
                return
            handle = _PENDING[0]
        handle.wait()


def drain(timeout_s: float | None = None, *, why: str = "fs.shutdown()") -> None:
    """Waits for every background save of this process, at most ``timeout_s`` in all.

    ``fs.shutdown()`` runs it before it destroys the process groups a background save
    runs on (registered with :func:`fshard.runtime.teardown.register_before_shutdown`):
    destroying them under the save would lose the checkpoint without a word. It says on
    stderr what it waits for.

    Args:
      timeout_s: default the groups' timeout (``fs.init(timeout=)``, ``FSHARD_TIMEOUT_S``).
      why: the caller, for the messages.

    Raises:
      CheckpointError: a save failed, or still runs after ``timeout_s`` (it is abandoned;
        its path keeps the previous checkpoint); the message names the path. The first
        such error; the others are added as notes.
    """
    with _LOCK:
        pending = list(_PENDING)
    if not pending:
        return
    limit = timeout().total_seconds() if timeout_s is None else timeout_s
    running = [h.path for h in pending if not h.done()]
    if running:
        print(
            f"fshard: {why} waits up to {limit:.0f} s for {len(running)} checkpoint save(s) still "
            f"running: {', '.join(running)}",
            file=sys.stderr,
            flush=True,
        )
    deadline = time.monotonic() + limit
    errors = [e for h in pending if (e := _outcome(h, deadline, limit, why)) is not None]
    if errors:
        for e in errors[1:]:
            errors[0].add_note(f"also: {e}")
        raise errors[0]


def _outcome(handle: PendingSave, deadline: float, limit: float, why: str) -> CheckpointError | None:
    """The error of one pending save once it ends (or the deadline passes); None if it committed."""
    try:
        handle.wait(timeout=max(0.0, deadline - time.monotonic()))
        return None
    except TimeoutError:
        return CheckpointError(
            f"{why}: the checkpoint save to '{handle.path}' is still running after {limit:.0f} s "
            f"(the process groups' timeout); it is abandoned, and '{handle.path}' keeps its previous "
            f"checkpoint, if any."
        )
    except CheckpointError as e:
        return e
    except Exception as e:  # a collective of the save failed outside DCP (a peer is gone)
        return CheckpointError(
            f"{why}: the checkpoint save to '{handle.path}' failed: "
            f"{type(e).__name__}: {e}. No checkpoint was committed there."
        )


def _report_at_exit() -> None:
    """At interpreter exit: a background save nobody waited for that failed ends the process with 1.

    By then the interpreter has joined the save's thread (it is no daemon), so every save
    has ended; without this, a failed one would exit 0 with no checkpoint and no word.
    Registered at the first background save, after ``fs.init()``'s teardown hook, so it
    runs before that hook (atexit runs the last registered first).
    """
    try:
        drain(timeout().total_seconds(), why="the exit")
    except CheckpointError as e:
        stream = sys.stderr or sys.__stderr__
        print(f"fshard: error at exit: {e}", file=stream, flush=True)
        for s in (sys.stdout, stream):
            try:
                if s is not None:
                    s.flush()
            except Exception:
                pass
        os._exit(1)  # atexit cannot change the exit status otherwise


_AT_EXIT_REGISTERED = [False]


def _register_at_exit() -> None:
    with _LOCK:
        if not _AT_EXIT_REGISTERED[0]:
            _AT_EXIT_REGISTERED[0] = True
            atexit.register(_report_at_exit)


teardown.register_before_shutdown(drain)


def _after_fork_in_child() -> None:
    # A forked child (fs.run_local's ranks, the test pools) has none of the parent's threads:
    # the parent's executor would queue the child's background save forever (its one worker
    # is not there, and it never starts another), and the parent's lock may be held.
    global _EXECUTOR, _LOCK
    _EXECUTOR, _LOCK = None, threading.Lock()
    _PENDING.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _executor() -> cf.ThreadPoolExecutor:
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            # Not a daemon: a pending save completes before the interpreter exits.
            _EXECUTOR = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fshard-checkpoint")
        return _EXECUTOR


def _stage(x: Any) -> Any:
    """A private copy of a leaf on CPU, so the caller may go on changing its tensors."""
    with torch.no_grad():
        if isinstance(x, DTensor):
            local = x.to_local().detach().to("cpu", copy=True)
            # The spec (global shape, placements) is unchanged; DCP reads only the local
            # tensor and the spec, so the copy may live on CPU even for a CUDA mesh.
            return DTensor(local, x._spec, requires_grad=False)
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
    return copy.deepcopy(x)


def save(path: str | os.PathLike, tree: Any, *, blocking: bool = True) -> PendingSave:
    """Writes ``tree`` as a checkpoint directory at ``path``, replacing any checkpoint there.

    Every leaf is stored under its pytree path (``params.layers.3.wq``). DTensors are
    stored shard by shard: each rank writes only the shards it holds (replicated
    shards once), and :func:`~fshard.checkpoint.load` can read them onto any mesh.
    Plain tensors and other values (Python numbers, strings, dicts of them such as a
    data-loader position) are taken as global values, the same on every rank, and are
    written once; values that differ per rank must be DTensors to keep each rank's.

    The checkpoint is written to a temporary directory next to ``path``; when every rank
    has finished and rank 0 has checked that every file the metadata lists is there and
    whole, rank 0 renames it to ``path`` (swapping it with the previous checkpoint
    atomically where the file system allows). A save that crashes or is killed leaves
    the previous checkpoint at ``path`` intact; the next save clears its leftovers.

    One save at a time per path, across jobs: rank 0 holds the lock file
    ``.<name>.lock`` next to ``path`` from the start of the save to its commit. A save
    to a path whose lock a live process holds is refused; a lock whose holder died
    (same host: no process with its pid and start time) is taken over, and only then
    are the dead save's temporary files deleted.

    Collective: every rank of the job calls it, with the same ``path`` (checked: a
    mismatch raises on every rank) and a tree of the same structure (pipeline ranks may
    hold different keys). ``path`` must be on a file system that every rank sees.

    Args:
      path: the checkpoint directory.
      tree: a pytree of DTensors, tensors and picklable Python values.
      blocking: ``False`` returns once the tensors are copied to CPU memory, and writes
        and commits on a background thread while the caller goes on training; wait for
        it with the handle's ``wait()`` or :func:`wait`. A later ``save`` or ``load``
        waits for it first.

    Returns:
      A :class:`PendingSave`; already done when ``blocking``.

    Raises:
      CheckpointLockedError: another save to ``path`` is in progress; the message names
        the lock file and its holder (host, pid, since when). Nothing was written.
      CheckpointError: the save failed on some rank (every rank raises it; a full disk
        says "no space left", with the path and the bytes needed); the ranks passed
        different paths; or ``path`` exists and is not a checkpoint directory.
      ValueError: two leaves have the same key, or a DTensor is ``Partial``.
    """
    path = os.path.abspath(os.fspath(path))
    wait()
    keys, leaves, _ = flatten(tree, what="fs.checkpoint.save", path=path)
    g = group()
    rank = rank_of(g)
    agree_on_path(path, g, "fs.checkpoint.save")
    needed = _space.estimate_bytes(leaves)
    lock, tmp, error = _begin(path, needed) if rank == 0 else (None, None, None)
    error, tmp = broadcast_from_0((error, tmp), g)
    if error is not None:
        raise error
    state_dict = dict(zip(keys, leaves))
    if blocking:
        _write_and_commit(state_dict, tmp, path, g, rank, lock, needed)
        done: cf.Future = cf.Future()
        done.set_result(None)
        return PendingSave(path, done)
    try:
        staged: Any = (
            _simulated.per_rank_state_dicts(state_dict, copy=True)
            if _simulated.active()
            else {k: _stage(v) for k, v in state_dict.items()}
        )
        _register_at_exit()
        future = _executor().submit(_write_and_commit, staged, tmp, path, g, rank, lock, needed)
    except BaseException:
        if lock is not None:  # the worker never got it: a kept lock would refuse every later save
            lock.release()
        raise
    handle = PendingSave(path, future)
    with _LOCK:
        _PENDING.append(handle)
    return handle


def _begin(path: str, needed: int) -> tuple[Any, str | None, CheckpointError | None]:
    """Rank 0: takes the path's save lock, prepares the target, checks the free space.

    Returns:
      ``(lock, temporary directory, None)``, or ``(None, None, error)`` with nothing held.
    """
    lock = None
    try:
        lock = _lock.acquire(path)
        _dirs.prepare_target(path, lock.token)
        free = _space.free_bytes(os.path.dirname(path))
        if free is not None and free < needed:  # it would fail midway; say so now
            raise CheckpointError(_space.no_space_message("saving the checkpoint", path, needed))
        return lock, _dirs.temp_dir_for(path, lock.token), None
    except (OSError, CheckpointError) as e:
        if lock is not None:
            lock.release()
        if isinstance(e, CheckpointError):
            return None, None, e
        return None, None, CheckpointError(f"cannot save to '{path}': {e}")


def _write_and_commit(state_dict: Any, tmp: str, path: str, g: Any, rank: int, lock: Any, needed: int) -> None:
    """Every rank writes its part into ``tmp``; rank 0 checks it and commits it; the lock goes last.

    ``state_dict``: this rank's, or under ``fs.simulate`` a list with every rank's
    (``_simulated.per_rank_state_dicts``, made on the caller's thread for a background save).
    """
    try:
        if isinstance(state_dict, dict) and _simulated.active():
            state_dict = _simulated.per_rank_state_dicts(state_dict)
        writers = _write(state_dict, tmp, path, g, rank, needed)
        checksums = (
            [w.checksums for w in writers] if isinstance(state_dict, list) else _all_ranks(writers[0].checksums, g)
        )
        error = _commit(tmp, path, checksums, lock, needed) if rank == 0 else None
        agree(error, g)  # every rank returns only once the rename is done
    finally:
        if lock is not None:
            lock.release()


def _write(state_dict: Any, tmp: str, path: str, g: Any, rank: int, needed: int) -> list[ChecksumWriter]:
    """DCP's write of every rank's part; raises on every rank when any rank's write failed.

    Returns:
      This rank's writer; under ``fs.simulate`` (``state_dict`` a list) every rank's.
    """
    try:
        if isinstance(state_dict, list):  # fs.simulate: DCP once per simulated rank
            writers = [ChecksumWriter(tmp) for _ in state_dict]
            _simulated.save_per_rank(state_dict, writers)
            return writers
        # DCP gathers every rank's write errors and raises on all of them, and returns
        # only after rank 0 has written the metadata, that is, after every rank's data.
        writer = ChecksumWriter(tmp)
        with single_process_quiet(g):
            dcp.save(state_dict, storage_writer=writer, process_group=g, no_dist=g is None)
        return [writer]
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _space.is_no_space(e, os.path.dirname(path), needed):
            msg = _space.no_space_message("saving the checkpoint", path, needed)
            raise CheckpointError(f"{msg} ({describe_failure(e)})") from e
        raise CheckpointError(
            f"saving the checkpoint '{path}' failed: {describe_failure(e)}. The previous checkpoint "
            f"at '{path}', if any, is unchanged."
        ) from e


def _commit(tmp: str, path: str, checksums: list[Any], lock: Any, needed: int) -> CheckpointError | None:
    """Rank 0: checks that ``tmp`` is whole and still ours, then renames it to ``path``.

    Returns:
      None, or the error (``tmp`` removed; ``path`` unchanged).
    """
    try:
        merged = write_checksums(tmp, checksums)
        check_written(tmp, merged, path)
        if lock is not None and not lock.held():
            raise CheckpointError(
                f"the save to '{path}' is not committed: its lock '{lock.path}' was removed or taken "
                f"by another process while it wrote, so another job may be saving there. The previous "
                f"checkpoint at '{path}', if any, is unchanged."
            )
        write_manifest(tmp)
        _dirs.commit(tmp, path)
        return None
    except CheckpointError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return e
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _space.is_no_space(e, os.path.dirname(path), needed):
            return CheckpointError(_space.no_space_message("saving the checkpoint", path, needed))
        return CheckpointError(
            f"the checkpoint '{path}' was written to '{tmp}' but could not be moved into "
            f"place: {e}. The previous checkpoint at '{path}', if any, is unchanged."
        )


def _all_ranks(value: Any, g: Any) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` without a group)."""
    if g is None or dist.get_world_size(g) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(g)
    dist.all_gather_object(out, value, group=g)
    return out

"""``save``: a pytree into a DCP checkpoint directory, synchronously or in the background."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fshard.checkpoint import _dirs
from fshard.checkpoint._checksums import ChecksumWriter, write_checksums
from fshard.checkpoint._common import (
    CheckpointError,
    CheckpointException,
    agree,
    describe_failure,
    broadcast_from_0,
    flatten,
    group,
    rank_of,
    single_process_quiet,
)

__all__ = ["save", "wait", "PendingSave"]


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
    has finished, rank 0 renames it to ``path`` (swapping it with the previous
    checkpoint atomically where the file system allows). A save that crashes or is
    killed leaves the previous checkpoint at ``path`` intact; the next save clears its
    leftovers.

    Collective: every rank of the job calls it, with the same ``path`` and a tree of
    the same structure (pipeline ranks may hold different keys). ``path`` must be on a
    file system that every rank sees.

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
      CheckpointError: the save failed on some rank (every rank raises it); or ``path``
        exists and is not a checkpoint directory.
      ValueError: two leaves have the same key, or a DTensor is ``Partial``.
    """
    path = os.path.abspath(os.fspath(path))
    wait()
    keys, leaves, _ = flatten(tree, what="fs.checkpoint.save", path=path)
    g = group()
    rank = rank_of(g)
    tmp, error = None, None
    if rank == 0:
        try:
            _dirs.prepare_target(path)
            tmp = _dirs.temp_dir_for(path)
        except (OSError, CheckpointError) as e:
            error = e if isinstance(e, CheckpointError) else CheckpointError(f"cannot save to '{path}': {e}")
    error, tmp = broadcast_from_0((error, tmp), g)
    if error is not None:
        raise error
    state_dict = dict(zip(keys, leaves))
    if blocking:
        _write_and_commit(state_dict, tmp, path, g, rank)
        done: cf.Future = cf.Future()
        done.set_result(None)
        return PendingSave(path, done)
    staged = {k: _stage(v) for k, v in state_dict.items()}
    handle = PendingSave(path, _executor().submit(_write_and_commit, staged, tmp, path, g, rank))
    with _LOCK:
        _PENDING.append(handle)
    return handle


def _write_and_commit(state_dict: dict[str, Any], tmp: str, path: str, g: Any, rank: int) -> None:
    try:
        # DCP gathers every rank's write errors and raises on all of them, and returns
        # only after rank 0 has written the metadata, that is, after every rank's data.
        writer = ChecksumWriter(tmp)
        with single_process_quiet(g):
            dcp.save(state_dict, storage_writer=writer, process_group=g, no_dist=g is None)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving the checkpoint '{path}' failed: {describe_failure(e)}. The previous checkpoint "
            f"at '{path}', if any, is unchanged."
        ) from e
    checksums = _all_ranks(writer.checksums, g)
    error = None
    if rank == 0:
        try:
            write_checksums(tmp, checksums)
            _dirs.commit(tmp, path)
        except OSError as e:
            error = CheckpointError(
                f"the checkpoint '{path}' was written to '{tmp}' but could not be moved into "
                f"place: {e}. The previous checkpoint at '{path}', if any, is unchanged."
            )
    agree(error, g)  # every rank returns only once the rename is done


def _all_ranks(value: Any, g: Any) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` without a group)."""
    if g is None or dist.get_world_size(g) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(g)
    dist.all_gather_object(out, value, group=g)
    return out

"""Disk space: what a save needs, and saying "no space left" when that is why it failed.

A full disk surfaces from deep inside DCP and torch's writers under many names: an
``OSError`` with ``ENOSPC`` or ``EDQUOT``, a safetensors ``IoError(... StorageFull ...)``,
or torch's ``enforce fail ... unexpected pos 704 vs 598`` after a short write. So a
failed write counts as "no space left" when any error in it says so, or when the file
system now has less free space than the save needs. The need is estimated from the tree
itself, the same on every rank without communication: every tensor's global size (a
replicated or sharded DTensor is stored once), which is what DCP writes, plus a small
allowance for metadata and Python values.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from typing import Any, Iterable

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["estimate_bytes", "free_bytes", "is_no_space", "no_space_message"]

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_WORDS = ("no space left", "storagefull", "disk quota exceeded")
_OVERHEAD = 64 * 1024  # .metadata, checksums, manifest, pickled Python values


def estimate_bytes(leaves: Iterable[Any]) -> int:
    """Bytes a checkpoint of ``leaves`` takes on disk, about (global tensor sizes + overhead)."""
    total = _OVERHEAD
    for x in leaves:
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "element_size"):
            total += math.prod(shape) * x.element_size()
    return total


def free_bytes(directory: str) -> int | None:
    """Free bytes for this user on the file system of ``directory`` (None when unknown)."""
    probe = directory
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe or ".").free
    except OSError:
        return None


def _chain(e: BaseException) -> Iterable[BaseException]:
    """``e``, its causes and contexts, and each rank's error inside DCP's CheckpointException."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            for pair in x.failures.values():
                todo.append(pair[0] if isinstance(pair, tuple) else pair)


def is_no_space(e: BaseException, directory: str, needed: int) -> bool:
    """Whether the failure ``e`` of a write into ``directory`` came from a full disk."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _NO_SPACE_ERRNOS:
            return True
        if any(w in str(x).lower() for w in _NO_SPACE_WORDS):
            return True
    free = free_bytes(directory)
    return free is not None and free < needed


def no_space_message(what: str, path: str, needed: int) -> str:
    """``<what> '<path>' failed: no space left on the device ...``, with the bytes needed and free."""
    parent = os.path.dirname(path)
    free = free_bytes(parent)
    have = f"; {free:,} bytes are free there now" if free is not None else ""
    return (
        f"{what} '{path}' failed: no space left on the device of '{parent}': the checkpoint needs "
        f"about {needed:,} bytes ({needed / 2**20:.1f} MiB) beside the previous one{have}. Free "
        f"space there or save to another path. The previous checkpoint at '{path}', if any, is "
        f"unchanged."
    )

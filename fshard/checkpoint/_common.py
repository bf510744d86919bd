"""What save, load and interop share: errors, pytree keys, the checkpoint process group.

Keys are pytree paths joined with dots (``params.layers.3.wq``): a dict key or a
namedtuple field gives its name (``opt.0.mu.w``, so reordering a state's fields does
not mix up entries), a list or tuple index its number. Two leaves whose paths render
alike (a dict key containing ``"."``) would overwrite each other in the checkpoint, so
that is an error.
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta
from typing import Any, Iterator, Sequence

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Partial

from fshard.runtime import gloo_workers, simulation, teardown
from fshard.runtime.process import group_timeout

__all__ = [
    "CheckpointError",
    "CheckpointException",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "agree",
    "agree_on_path",
    "broadcast_from_0",
    "describe_failure",
    "flatten",
    "group",
    "is_tensor",
    "rank_of",
    "short_list",
    "single_process_quiet",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read: incomplete, corrupt, or lacking keys.

    The message names the checkpoint path and, where keys are at stake, the keys.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint directory at the given path."""


class CheckpointLockedError(CheckpointError):
    """Another save to the same path is in progress (another job, or a process of this one).

    The message names the path, the lock file and its holder (host, pid, since when).
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The template does not match the checkpoint: shapes, dtypes, or tensor against value.

    A ``ValueError`` too, as before it had its own class; a ``CheckpointError`` so that a
    program that reports checkpoint errors in one line (``examples/train_lm.py --resume``)
    reports this one alike instead of a traceback per rank.
    """


def short_list(items: Sequence[Any], limit: int = 12) -> str:
    """``[a, b, ...] (and N more)`` for messages that could list thousands of keys."""
    items = list(items)
    head = ", ".join(repr(x) if isinstance(x, str) else str(x) for x in items[:limit])
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"[{head}{more}]"


def flatten(tree: Any, *, what: str, path: str) -> tuple[list[str], list[Any], Any]:
    """Flattens ``tree`` into checkpoint keys, leaves and a treedef.

    Args:
      tree: the pytree to save, or the template to load into.
      what: the caller (``"fs.checkpoint.save"``), for messages.
      path: the checkpoint path, for messages.

    Returns:
      ``(keys, leaves, treedef)`` in optree's flattening order.

    Raises:
      ValueError: two leaves share a key, or a DTensor holds a pending reduction
        (``Partial``), which has no value to store until it is reduced.
    """
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    keys = [".".join(_entry_name(e) for e in acc) or "<root>" for acc in accessors]
    seen: dict[str, int] = {}
    dupes = []
    for i, k in enumerate(keys):
        if k in seen:
            dupes.append(k)
        seen[k] = i
    if dupes:
        raise ValueError(
            f"{what}('{path}'): several leaves have the same key {short_list(sorted(set(dupes)))}; "
            f"a dict key that contains '.' renders like a nested path. Rename the keys."
        )
    partial = [
        k for k, x in zip(keys, leaves) if isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements)
    ]
    if partial:
        raise ValueError(
            f"{what}('{path}'): leaves {short_list(partial)} are DTensors with a Partial placement "
            f"(a sum not yet reduced). Reduce them first, e.g. x.redistribute(placements=[Replicate()...])."
        )
    return list(keys), leaves, treedef


def _entry_name(entry: Any) -> str:
    # optree's plain key paths give a namedtuple's index; its accessor also knows the field.
    field = getattr(entry, "field", None)
    return field if isinstance(field, str) else str(entry.entry)


# One gloo group per world, used for every checkpoint collective. A separate group
# keeps an async save's collectives (run on a background thread) from interleaving
# with the training step's collectives on the default group, which gloo and nccl
# would match up wrongly across ranks; and DCP's planning objects need a CPU backend
# even when the training runs on nccl.
_GROUPS: dict[int, Any] = {}


def group() -> Any | None:
    """The checkpoint process group, created on first use; ``None`` without torch.distributed.

    Creating it is collective, which is fine because save and load are collective.
    Under ``fs.simulate`` also ``None``: the one process plays rank 0's part, and DCP runs
    once per simulated rank (``fshard.checkpoint._simulated``).
    """
    if not (dist.is_available() and dist.is_initialized()) or simulation.active() is not None:
        return None
    key = id(dist.group.WORLD)
    g = _GROUPS.get(key)
    if g is None:
        # The configured timeout, not torch's 30-minute default for a new group: a rank
        # stopped during a save must fail the others as soon as the world group would.
        with gloo_workers.one_worker():
            g = dist.new_group(backend="gloo", timeout=timeout())
        _GROUPS[key] = g
    return g


def timeout() -> timedelta:
    """The timeout of fshard's groups (``fshard.runtime.process.group_timeout``: the world's)."""
    return group_timeout()


def forget_groups() -> None:
    """Drops the checkpoint groups (``fs.shutdown()``: they are destroyed with the world)."""
    _GROUPS.clear()


def rank_of(g: Any | None) -> int:
    """This process's rank in ``g`` (0 without a group)."""
    return 0 if g is None else dist.get_rank(g)


def agree(error: BaseException | None, g: Any | None) -> None:
    """Raises on every rank when any rank has an error, so that no rank is left waiting.

    Each rank passes what it found (``None``: nothing wrong). A rank with its own error
    raises that; the others raise the lowest failing rank's, with a note saying where
    it came from.

    Raises:
      BaseException: the rank's own error, or the lowest failing rank's.
    """
    if g is None or dist.get_world_size(g) == 1:
        if error is not None:
            raise error
        return
    gathered: list[Any] = [None] * dist.get_world_size(g)
    dist.all_gather_object(gathered, error, group=g)
    if error is not None:
        raise error
    for r, e in enumerate(gathered):
        if e is not None:
            if hasattr(e, "add_note"):
                e.add_note(f"(raised on rank {r}; every rank stops with it)")
            raise e


def agree_on_path(path: str, g: Any | None, what: str) -> None:
    """Raises on every rank unless every rank passed the same (absolute) ``path``.

    Why: a save writes rank 0's path only, and a load on ranks given different paths
    would mix two checkpoints into one tensor. One ``all_gather_object`` of a string.

    Raises:
      CheckpointError: the ranks disagree; the message lists which ranks gave which path.
    """
    if g is None or dist.get_world_size(g) == 1:
        return
    paths: list[Any] = [None] * dist.get_world_size(g)
    dist.all_gather_object(paths, path, group=g)
    if len(set(paths)) == 1:
        return
    by_path: dict[str, list[int]] = {}
    for r, p in enumerate(paths):
        by_path.setdefault(p, []).append(r)
    groups = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: '{p}'" for p, rs in by_path.items()
    )
    raise CheckpointError(
        f"{what}: the ranks passed different paths ({groups}). Every rank must pass the same path, "
        f"on a file system every rank sees (a relative path resolves against each rank's working "
        f"directory). Nothing was read or written."
    )


def broadcast_from_0(value: Any, g: Any | None) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself without a group)."""
    if g is None or dist.get_world_size(g) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0), group=g)
    return box[0]


def describe_failure(e: BaseException) -> str:
    """One line per failing rank for DCP's ``CheckpointException`` (its str holds tracebacks)."""
    if isinstance(e, CheckpointException):
        parts = []
        for r, pair in sorted(e.failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {r}: {type(exc).__name__}: {exc}")
        return "; ".join(parts) or "CheckpointException"
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def single_process_quiet(g: Any | None) -> Iterator[None]:
    """Silences DCP's warning that it assumes one process, where that is the intent (no group)."""
    if g is not None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent", category=UserWarning)
        yield


def is_tensor(x: Any) -> bool:
    """Tensors and DTensors (DTensor is a tensor subclass)."""
    return isinstance(x, torch.Tensor)


def _detach_after_fork() -> dict[int, Any]:
    kept = dict(_GROUPS)
    _GROUPS.clear()
    return kept


teardown.register_group_owner(
    teardown.GroupOwner(
        "fshard.checkpoint", groups=lambda: list(_GROUPS.values()), forget=forget_groups, after_fork=_detach_after_fork
    )
)

"""The kinds of collective fshard names, and the bytes each puts on the wire.

One vocabulary for the three places that count collectives: ``fs.comm_log`` (what a rank
really issued), ``fs.jit``'s passes (the c10d nodes of a captured graph) and ``fs.plan``'s
cost model (what a layout will issue).

- :class:`CollectiveKind`: ``comm_log``'s names (``"all_gather"``, ``"psum_scatter"``,
  ``"psum"``, ...); a member equals and hashes as its name, so logs keep plain strings.
- :func:`c10d_kind`: the kind of a functional c10d op (``torch.ops._c10d_functional``).
- :func:`ring_hops`: the algorithm both counts assume for a kind on ``n`` ranks, as
  ``(hops, share)``: ``hops`` sequential steps, each carrying ``payload / share`` bytes
  (ring all-gather, reduce-scatter and all-reduce, direct all-to-all, one point-to-point
  hop, a binomial-tree broadcast).
- :func:`wire_bytes`: the bytes one rank sends, ``hops * payload // share``.

Two quantities stay apart: the payload (a rank's input, what ``comm_log``'s ``bytes`` and
the planner's ``Collective.nbytes`` count) and the wire bytes (``comm_log``'s ``wire``, and
the bandwidth term of the planner's time, which adds a latency per hop). A broadcast's wire
bytes depend on the rank's place in the tree, so :func:`wire_bytes` refuses it; its hops
are the tree's depth, the critical path the planner times.
"""

from __future__ import annotations

import enum
import math
from typing import Any

__all__ = ["REDUCE_KINDS", "CollectiveKind", "c10d_kind", "ring_hops", "wire_bytes"]


class CollectiveKind(str, enum.Enum):
    """A collective's kind, as ``comm_log`` names it (equal to, and hashed as, that name)."""

    ALL_GATHER = "all_gather"
    PSUM_SCATTER = "psum_scatter"
    PSUM = "psum"
    PMEAN = "pmean"
    PMAX = "pmax"
    PMIN = "pmin"
    ALL_REDUCE = "all_reduce"  # a reduce op without a named kind
    ALL_TO_ALL = "all_to_all"
    PPERMUTE = "ppermute"
    SEND = "send"
    RECV = "recv"
    BROADCAST = "broadcast"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


_ALL_REDUCES = frozenset({CollectiveKind.PSUM, CollectiveKind.PMEAN, CollectiveKind.PMAX, CollectiveKind.PMIN})
_ALL_REDUCES |= {CollectiveKind.ALL_REDUCE}

# c10d's reduce-op names -> kinds
REDUCE_KINDS: dict[str, CollectiveKind] = {
    "sum": CollectiveKind.PSUM,
    "avg": CollectiveKind.PMEAN,
    "max": CollectiveKind.PMAX,
    "min": CollectiveKind.PMIN,
}


def c10d_kind(target: Any, args: tuple = ()) -> CollectiveKind | None:
    """The kind of a call of functional c10d op ``target`` with ``args`` (an all-reduce's
    kind is its reduce op's, ``args[1]``), or None for another op (a wait, a view, ...)."""
    import torch

    F = torch.ops._c10d_functional
    if target is F.all_gather_into_tensor.default:
        return CollectiveKind.ALL_GATHER
    if target is F.reduce_scatter_tensor.default:
        return CollectiveKind.PSUM_SCATTER
    if target is F.all_to_all_single.default:
        return CollectiveKind.ALL_TO_ALL
    if target is F.all_reduce.default or target is F.all_reduce_.default:
        op = args[1] if len(args) > 1 else None
        return REDUCE_KINDS.get(op, CollectiveKind.ALL_REDUCE) if isinstance(op, str) else CollectiveKind.ALL_REDUCE
    return None


def ring_hops(kind: str, n: int) -> tuple[int, int]:
    """``(hops, share)`` of a ``kind`` collective over ``n`` ranks: ``hops`` sequential
    steps (each one latency), each carrying ``payload / share`` bytes (payload: the rank's
    input, as ``comm_log`` counts it).

    Args:
      kind: a :class:`CollectiveKind` or its name.
      n: the group's size, >= 1.

    Raises:
      ValueError: an unknown kind (the known ones are listed).
    """
    k = _kind(kind)
    if k is CollectiveKind.ALL_GATHER:
        return n - 1, 1
    if k in (CollectiveKind.PSUM_SCATTER, CollectiveKind.ALL_TO_ALL):
        return n - 1, n
    if k in _ALL_REDUCES:
        return 2 * (n - 1), n
    if k is CollectiveKind.BROADCAST:
        return math.ceil(math.log2(n)) if n > 1 else 0, 1
    return 1, 1  # one point-to-point hop: send, recv, ppermute


def wire_bytes(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for a ``kind`` collective with ``nbytes`` of input over ``n``
    ranks: ``hops * nbytes // share`` of :func:`ring_hops` (a receive sends nothing).

    Args:
      kind: a :class:`CollectiveKind` or its name.
      nbytes: the rank's input payload, in bytes.
      n: the group's size, >= 1.

    Raises:
      ValueError: an unknown kind, or a broadcast (its bytes depend on the rank's place
        in the tree: count them where the root is known).
    """
    k = _kind(kind)
    if k is CollectiveKind.RECV:
        return 0
    if k is CollectiveKind.BROADCAST:
        raise ValueError("wire_bytes: a broadcast's bytes depend on the rank's place in the tree; count them per rank")
    hops, share = ring_hops(k, n)
    return hops * nbytes // share


def _kind(kind: str) -> CollectiveKind:
    try:
        return CollectiveKind(kind)
    except ValueError:
        raise ValueError(
            f"unknown collective kind {kind!r}; the kinds are {[k.value for k in CollectiveKind]}"
        ) from None

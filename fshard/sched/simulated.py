"""``pipeline_step`` under ``fs.simulate``: one SPMD program per pipeline coordinate.

A pipeline is MPMD: pipeline rank ``p`` walks its own action list, holds its own stages
and exchanges activations with its neighbours. A simulation runs one Python program for
every rank, so the step cannot run as one program. Instead, for each pipeline coordinate
``p``, the simulated ranks at ``pp = p`` (the other axes, fsdp, dp, tp, stay SPMD among
them) run ``p``'s part of the step as one program, on torch's ``LocalTensorMode`` over
those ranks only, each in a thread of torch's ``LocalRunnerMode`` (one runs at a time;
each has its own mode stack). Everything a rank computes is the code a real rank runs.

What crosses between the programs is the transfers: ``pipeline_p2p`` (a shim, listed in
``docs/simulate.md``) hands the block a rank sends to the rank that receives it, matched
in the order the receives were posted, as gloo matches them. torch's own
``_local_send``/``_local_recv_`` match a receive by the order of waits, not of posts, and
name peers by world rank only, which a pipeline on a sub-axis of the mesh is not.

The loss' broadcast from the last stage's ranks runs afterwards, on every simulated rank
at once (torch's simulated ``broadcast``), as do the step's other cross-pipeline facts.
"""

from __future__ import annotations

import contextvars
import copy
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh

__all__ = ["Transport", "pp_groups", "run_per_coordinate", "restrict", "join_blocks"]


def _local_tensor() -> Any:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor


def _mode() -> Any:
    """The innermost enabled simulation mode (a coordinate's own, inside its program)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        raise RuntimeError("fshard.sched.simulated runs under fs.simulate only")
    return mode


def _values(x: Any, world: int) -> dict[int, int]:
    """A per-rank int (a SymInt over LocalIntNode) or an int, as rank -> value."""
    node = getattr(x, "node", None)
    local = getattr(node, "_local_ints", None)
    return dict(local) if local is not None else {r: int(x) for r in range(world)}


def pp_groups(mesh: Mesh, axis: str, world: int) -> tuple[list[frozenset[int]], dict[tuple[int, int], int]]:
    """The simulated ranks of each pipeline coordinate, and ``(rank, p) -> the rank at
    pipeline coordinate p with rank's other coordinates`` (a transfer's other end)."""
    coord = {a: _values(c, world) for a, c in mesh.coordinate().items()}
    at = {tuple(coord[a][r] for a in mesh.axis_names): r for r in range(world)}
    k = mesh.axis_names.index(axis)
    groups = [frozenset(r for r in range(world) if coord[axis][r] == p) for p in range(mesh.shape[axis])]
    peer = {}
    for where, r in at.items():
        for p in range(mesh.shape[axis]):
            peer[(r, p)] = at[where[:k] + (p,) + where[k + 1 :]]
    return groups, peer


def _restrict_int(x: Any, ranks: frozenset[int]) -> Any:
    local = getattr(getattr(x, "node", None), "_local_ints", None)
    if local is None:
        return x
    from torch.distributed._local_tensor import LocalIntNode

    mine = {r: local[r] for r in ranks}
    values = set(mine.values())
    return next(iter(values)) if len(values) == 1 else torch.SymInt(LocalIntNode(mine))


def restricted_mesh(mesh: Mesh, ranks: frozenset[int]) -> Mesh:
    """``mesh`` as the ranks ``ranks`` see it: their coordinates only (one int per axis
    where they agree, as the pipeline coordinate does), the same groups."""
    view = copy.copy(mesh)
    view._coord = {a: _restrict_int(c, ranks) for a, c in mesh._coord.items()}
    view._lax_axes = {}  # fs.lax's cached facts hold this rank's index: rebuilt from _coord
    view._tokens = []
    return view


def restrict(tree: Any, ranks: frozenset[int]) -> Any:
    """``tree`` with every per-rank value cut to ``ranks``' blocks (plain tensors, the same on
    every rank, stay as they are); runs under the sub-mode over ``ranks``."""
    LocalTensor = _local_tensor()
    mode = _mode()

    def cut(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, LocalTensor):
            return t
        with mode.disable():
            return LocalTensor({r: t._local_tensors[r] for r in sorted(ranks)})

    def leaf(x: Any) -> Any:
        if isinstance(x, DTensor):
            # The same spec, wrapped directly: DTensor.from_local would ask the mesh for this
            # rank's coordinate, outside the ranks the sub-mode runs.
            return DTensor(cut(x._local_tensor), x._spec, requires_grad=False)
        if isinstance(x, torch.Tensor):
            return cut(x)
        return _restrict_int(x, ranks)

    return tree_util.tree_map(leaf, tree)


def join_blocks(parts: Sequence[tuple[frozenset[int], torch.Tensor]]) -> torch.Tensor:
    """One tensor over the union of the ranks, from each group's tensor over its ranks."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    LocalTensor = _local_tensor()
    blocks: dict[int, torch.Tensor] = {}
    with maybe_disable_local_tensor_mode():
        for ranks, t in parts:
            for r in sorted(ranks):
                blocks[r] = t._local_tensors[r] if isinstance(t, LocalTensor) else t
        return LocalTensor(dict(sorted(blocks.items())))


class _Stop(RuntimeError):
    """Raised in a program waiting on a transfer when another program failed or all wait."""


class Transport:
    """``pipeline_p2p``: the transfers between the per-coordinate programs of one step.

    A send stores each rank's block on its channel ``(rank, peer)``; a receive takes the
    slot of its channel in the order receives were posted (gloo's matching), and its
    wait copies the block into the receiving rank's buffer once the sender has posted it.
    A program waiting hands the turn to another (``LocalRunnerMode``'s condition).
    """

    def __init__(self, peer: dict[tuple[int, int], int]) -> None:
        self.peer = peer
        self.sent: dict[tuple[int, int], list[torch.Tensor | None]] = defaultdict(list)
        self.claimed: dict[tuple[int, int], int] = defaultdict(int)
        self.waiting: dict[int, Callable[[], bool]] = {}
        self.alive = 0
        self.failed: BaseException | None = None

    def _cond(self) -> Any:
        from torch.distributed._local_tensor import LocalRunnerMode

        return LocalRunnerMode.current()._run_cond

    def post(self, ops: list[dist.P2POp]) -> list["_Work"]:
        """Posts ``ops`` of one program (its tensors over its ranks); one work per op."""
        LocalTensor = _local_tensor()
        ranks = sorted(_mode().ranks)
        works = []
        for op in ops:
            t, q = op.tensor, op.group_peer
            blocks = t._local_tensors if isinstance(t, LocalTensor) else dict.fromkeys(ranks, t)
            if op.op is dist.isend:
                for r in ranks:
                    self.sent[(r, self.peer[(r, q)])].append(blocks[r])
                works.append(_Work(self, [], t))
            else:
                slots = []
                for r in ranks:
                    channel = (self.peer[(r, q)], r)
                    slots.append((channel, self.claimed[channel], blocks[r]))
                    self.claimed[channel] += 1
                works.append(_Work(self, slots, t))
        self._cond().notify_all()
        return works

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Blocks this program until ``ready()``, letting the others run."""
        me = id(ready)
        cond = self._cond()
        while not ready():
            if self.failed is not None:
                raise _Stop(f"fs.simulate: pipeline program stopped waiting for {what}: another one failed")
            if len(self.waiting) + 1 >= self.alive and not any(f() for f in self.waiting.values()):
                self.failed = _Stop(
                    f"fs.simulate: every pipeline program waits on a transfer (this one on {what}); "
                    f"the schedule deadlocks on simulated ranks"
                )
                cond.notify_all()
                raise self.failed
            self.waiting[me] = ready
            try:
                cond.wait()
            finally:
                self.waiting.pop(me, None)

    def done(self, error: BaseException | None) -> None:
        """A program ended (with ``error``, or None): the others re-check their waits."""
        self.alive -= 1
        if error is not None and self.failed is None:
            self.failed = error
        self._cond().notify_all()


class _Work:
    """One posted op: a send is complete at once; a receive when every slot is filled."""

    __slots__ = ("transport", "slots", "tensor")

    def __init__(self, transport: Transport, slots: list[tuple[tuple[int, int], int, torch.Tensor]], t: Any) -> None:
        self.transport, self.slots, self.tensor = transport, slots, t

    def _ready(self) -> bool:
        sent = self.transport.sent
        return all(len(sent[channel]) > k for channel, k, _ in self.slots)

    def wait(self) -> None:
        if not self.slots:
            return
        self.transport.wait_until(self._ready, f"a receive from channels {[c for c, _, _ in self.slots]}")
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode(), torch.no_grad():
            for channel, k, buf in self.slots:
                block = self.transport.sent[channel][k]
                self.transport.sent[channel][k] = None  # taken: let the sender's block go
                assert block is not None  # each slot is claimed by one receive
                buf.copy_(block)
        self.slots = []

    def finished(self) -> bool:
        return not self.slots


def run_per_coordinate(
    groups: Sequence[frozenset[int]], transport: Transport, program: Callable[[int], Any]
) -> list[Any]:
    """``program(p)`` for every pipeline coordinate ``p``, each under torch's
    ``LocalTensorMode`` over ``groups[p]`` in a thread of ``LocalRunnerMode``; returns the
    results in coordinate order, or raises the first failure."""
    from torch.distributed._local_tensor import LocalRunnerMode

    outer = _mode()
    mode_class = type(outer)
    world = frozenset(outer.ranks)
    results: list[Any] = [None] * len(groups)
    errors: list[tuple[int, BaseException]] = []
    contexts = [contextvars.copy_context() for _ in groups]
    transport.alive = len(groups)

    def run(p: int) -> None:
        error = None
        try:
            with mode_class(groups[p]) as mode:
                # Each rank goes on drawing from its own generator state (dropout in a stage).
                mode._per_rank_rng_states = outer._per_rank_rng_states
                results[p] = program(p)
        except BaseException as e:  # re-raised by the caller, after every program ended
            error = e
            errors.append((p, e))
        finally:
            transport.done(error)

    with LocalRunnerMode(world, len(groups), lambda p: contexts[p].run(run, p)):
        pass
    if errors:
        first = next((e for _, e in errors if not isinstance(e, _Stop)), errors[0][1])
        raise first
    return results

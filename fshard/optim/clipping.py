"""Global norm of a sharded pytree, and clipping by it.

The norm is the one of the gathered tensors, computed without gathering: each rank
sums the squares of its local shards and one small all-reduce adds the partial sums
over the mesh axes the leaves are sharded on.

Under :func:`fshard.jit` those all-reduces are functional collectives
(``torch.ops._c10d_functional``), so that they are part of the captured graph; eagerly
they call ``torch.distributed`` directly. ``comm_log`` counts neither (``fshard.plan``
models them as unlogged), so a jitted step logs what the eager one does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fshard import comm
from fshard import tree as tree_util
from fshard.optim.base import (
    EmptyState,
    GradientTransformation,
    Params,
    Updates,
    check_hparam,
    map_updates,
    to_locals,
)
from fshard.runtime import simulation

__all__ = ["global_norm", "clip_by_global_norm"]


def global_norm(updates: Updates, *, sum_over: str | Sequence[str] = ()) -> torch.Tensor:
    """The 2-norm of all leaves together, as if every DTensor were gathered first.

    For DTensor leaves each rank squares and sums its local shards, and one scalar
    all-reduce sums over the mesh axes that any leaf is sharded on (one per axis when
    those axes do not span every rank); none when every leaf is replicated. A leaf
    counts only on the ranks at index 0 of the reduced axes it is replicated over, so
    replicas are never counted twice. Plain tensors are taken as they are: outside
    ``shard_map`` they are whole values; inside, local shards (the norm is then local).

    ``sum_over`` names mesh axes whose ranks hold *different* leaves, as pipeline
    ranks hold different stages (``pipeline_step``'s grads: a list with None for the
    stages held elsewhere): the squared norms are summed over them with one more
    all-reduce, which every rank of the mesh must join.

    Args:
      updates: a pytree of tensors / DTensors (e.g. gradients), global shape ``S`` each.
      sum_over: mesh axes (of the current mesh, or of the DTensors' mesh) over which
        ranks hold disjoint leaves (optional, default none).

    Returns:
      A 0-dim tensor, the same on every rank: float64 if any leaf is float64, else
      float32.

    Raises:
      ValueError: a leaf with a ``Partial`` placement (reduce it first), naming the path.

    Example:
      >>> norm = fs.optim.global_norm(grads)  # doctest: +SKIP
    """
    paths, leaves, _ = tree_util.zip_with_path(updates)
    sum_over = (sum_over,) if isinstance(sum_over, str) else tuple(sum_over)
    squares = _squares(paths, leaves)
    return (_sum_over(squares, sum_over, leaves) if sum_over else squares).sqrt()


def _squares(paths: list[str], leaves: list[Any]) -> torch.Tensor:
    """The sum of squares of all leaves, as if every DTensor were gathered."""
    if not leaves:
        return torch.zeros(())
    acc = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
    by_mesh: dict[Any, list[tuple[str, DTensor]]] = {}
    plain = []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            by_mesh.setdefault(id(x.device_mesh), []).append((path, x))
        else:
            plain.append(x)
    with torch.no_grad():
        device = to_locals(leaves[:1])[0].device
        total = torch.zeros((), dtype=acc, device=device)
        if plain:
            total = total + _sum_squares(plain, acc).to(device)
        for group in by_mesh.values():
            total = total + _mesh_sum_squares(group, acc).to(device)
    return total


def _sum_over(squares: torch.Tensor, axes: tuple[str, ...], leaves: list[Any]) -> torch.Tensor:
    """Sums ``squares`` over the mesh axes ``axes`` (ranks holding disjoint leaves)."""
    from fshard.mesh.mesh import current_mesh
    from fshard.mesh.sharding import _mesh_of

    mesh = current_mesh()
    if mesh is None:  # the mesh of the DTensor leaves
        first = next((x for x in leaves if isinstance(x, DTensor)), None)
        mesh = _mesh_of(first) if first is not None else None
    if mesh is None:
        raise ValueError(
            f"global_norm(sum_over={axes}) needs a mesh: call it inside `with mesh:` "
            f"(a rank that holds no DTensor leaf cannot find one)."
        )
    mesh.check_axes(axes, what="global_norm: sum_over")
    if mesh.axis_size(axes) == 1:
        return squares
    # Every rank computes in the same dtype, whatever leaves it holds (or none).
    out = _all_reduce_sum(squares.to(dtype=torch.float64, device=mesh.device), mesh.group(axes))
    return out.to(torch.float64 if squares.dtype == torch.float64 else torch.float32)


def _all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``, unlogged (see the module docstring)."""
    comm.one_at_a_time(group)  # one collective at a time per gloo group (fshard.comm)
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(x) is not None:
        # fs.jit traces: an in-place torch.distributed call would run once, at trace time,
        # on fake tensors; a functional one becomes a node of the graph.
        with _unlogged():
            f = torch.ops._c10d_functional
            return f.wait_tensor(f.all_reduce(x.contiguous(), "sum", group.group_name))
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


@contextlib.contextmanager
def _unlogged() -> Iterator[None]:
    token = comm._LOGS.set(())  # comm_log's dispatch mode records nothing while no log is open
    try:
        yield
    finally:
        comm._LOGS.reset(token)


def _sum_squares(locals_: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    norms = torch._foreach_norm(locals_, 2, dtype=acc)
    return torch.stack(norms).square().sum()


def _mesh_sum_squares(group: list[tuple[str, DTensor]], acc: torch.dtype) -> torch.Tensor:
    mesh = group[0][1].device_mesh
    # mesh.shape, not mesh.mesh.shape: the latter builds a tensor, which fs.jit's fake
    # tracing refuses.
    sizes, coord = mesh.shape, mesh.get_coordinate()
    sharded_on = []
    for path, x in group:
        dims = set()
        for i, p in enumerate(x.placements):
            if isinstance(p, Partial):
                raise ValueError(
                    f"global_norm: {path} has a Partial placement on mesh dim {i} (a pending sum); "
                    "its local values are not its shards. Reduce it first, e.g. "
                    "x.redistribute(placements=[Replicate() if p.is_partial() else p for p in x.placements])."
                )
            if isinstance(p, (Shard, _StridedShard)) and sizes[i] > 1:  # no subclass of Shard
                dims.add(i)
        sharded_on.append(dims)
    reduce_dims = sorted(set().union(*sharded_on))
    locals_ = to_locals([x for _, x in group])
    # Which leaves count depends on this rank's coordinates: one run per rank under fs.simulate.
    total = simulation.per_rank(_counted_sum_squares)(
        locals_, sharded_on, reduce_dims, list(coord), acc, locals_[0].device
    )
    for pg in _groups_over(mesh, reduce_dims):
        total = _all_reduce_sum(total, pg)
    return total


def _counted_sum_squares(
    locals_: list[torch.Tensor], sharded_on: list[set[int]], reduce_dims: list[int], coord: list[int], acc, device
) -> torch.Tensor:
    """This rank's sum of squares over the leaves it counts: a leaf counts where it is at
    index 0 of every reduced mesh dim it is replicated over (once per replica group)."""
    counted = [t for t, dims in zip(locals_, sharded_on) if all(coord[d] == 0 for d in reduce_dims if d not in dims)]
    return _sum_squares(counted, acc).to(device) if counted else torch.zeros((), dtype=acc, device=device)


def _groups_over(mesh: Any, dims: list[int]) -> list[Any]:
    """Process groups whose successive all-reduces sum over the mesh dims ``dims``."""
    if not dims:
        return []
    if math.prod(mesh.shape[d] for d in dims) == dist.get_world_size():
        return [dist.group.WORLD]  # these dims span every rank: one collective does it
    return [mesh.get_group(d) for d in dims]


def clip_by_global_norm(max_norm: float, *, sum_over: str | Sequence[str] = ()) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` = :func:`global_norm`.

    Same rule as ``torch.nn.utils.clip_grad_norm_``; the norm is the global one on
    any mesh (see :func:`global_norm`), so clipping sharded grads equals clipping
    the gathered grads. Never synchronizes the device with the host. Inside a
    ``shard_map`` body the leaves are plain local shards and the norm is the local one:
    clip outside the body, on the DTensors it returns.

    Args:
      max_norm: the largest norm let through, > 0.
      sum_over: mesh axes whose ranks hold different leaves (the pipeline axis, for
        ``pipeline_step``'s per-stage grads): see :func:`global_norm`.

    Returns:
      A stateless :class:`GradientTransformation`.

    Raises:
      ValueError: ``max_norm <= 0``; (from ``update``) a leaf with a ``Partial``
        placement.

    Example:
      >>> opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=3e-4))  # doctest: +SKIP
    """
    check_hparam("clip_by_global_norm", "max_norm", max_norm, 0.0, lo_open=True)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        coef = torch.clamp(max_norm / (global_norm(updates, sum_over=sum_over) + 1e-6), max=1.0)

        factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

        def factor(x: torch.Tensor) -> torch.Tensor:
            key = (x.device, x.dtype)
            if key not in factors:
                factors[key] = coef.to(device=x.device, dtype=x.dtype)
            return factors[key]

        def out_of_place(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            if len({(x.device, x.dtype) for x in xs}) == 1:
                return torch._foreach_mul(xs, factor(xs[0]))
            return [x * factor(x) for x in xs]

        new = map_updates(updates, out_of_place, lambda xs: [x.mul_(factor(x)) for x in xs])
        return new, state

    return GradientTransformation(init_fn, update_fn)

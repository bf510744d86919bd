"""Specs against meshes and shapes: validation, local blocks, DTensor placements.

Detecting and composing are kept apart (JAX's habit): ``spec_problems`` returns what
is wrong with one leaf, ``raise_spec_errors`` turns the problems of many leaves into
one message with a line per leaf.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fshard.mesh.mesh import Mesh
from fshard.mesh.spec import P, PartitionSpec
from fshard.runtime import simulation

__all__ = [
    "spec_problems",
    "raise_spec_errors",
    "local_block",
    "spec_to_placements",
    "placements_to_spec",
    "shard_shape",
    "take_block",
    "block_shape",
]


def spec_problems(spec: object, shape: Sequence[int], mesh: Mesh, *, allow_uneven: bool = False) -> list[str]:
    """Everything wrong with using ``spec`` for a tensor of ``shape`` on ``mesh``.

    Returns:
      Human-readable problems (empty when the spec fits). Each names the dim, the axis
      and the sizes.
    """
    if not isinstance(spec, PartitionSpec):
        return [f"spec must be a P(...), got {spec!r} of type {type(spec).__name__}"]
    out: list[str] = []
    ndim = len(shape)
    if len(spec) > ndim:
        out.append(f"spec {spec} has {len(spec)} entries but the tensor has rank {ndim} (shape {tuple(shape)})")
    seen: dict[str, int] = {}
    for d in range(len(spec)):
        for a in spec.dim_axes(d):
            if a not in mesh.shape:
                out.append(f"axis {a!r} in dim {d} is not a mesh axis (mesh axes: {list(mesh.axis_names)})")
            elif a in seen:
                out.append(f"axis {a!r} is used twice (dims {seen[a]} and {d}); an axis may split one dim only")
            else:
                seen[a] = d
    if out or allow_uneven:
        return out
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        n = mesh.axis_size(axes) if axes else 1
        if shape[d] % n:
            out.append(
                f"dim {d} of size {shape[d]} is split over {_axes_text(axes, mesh)} = {n} "
                f"ranks, and {shape[d]} is not divisible by {n}"
            )
    return out


def uneven_problems(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> list[str]:
    """Why an uneven (``torch.chunk``) layout of ``spec`` cannot be a DTensor, if it cannot."""
    out = []
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        n = mesh.axis_size(axes) if axes else 1
        if shape[d] % n and mesh.sub_axes_in_mesh_order(axes) != axes:
            out.append(
                f"dim {d} of size {shape[d]} is split unevenly over {axes}, which are not in "
                f"mesh order {mesh.axis_names}; uneven layouts must follow the mesh order"
            )
    return out


def _axes_text(axes: Sequence[str], mesh: Mesh) -> str:
    return " x ".join(f"{a}({mesh.shape[a]})" for a in axes)


def raise_spec_errors(
    what: str, mesh: Mesh, bad: Sequence[tuple[str, object, Sequence[int], list[str]]], remedy: str
) -> None:
    """Raises one ValueError (TypeError when every problem is a wrong kind) listing every bad leaf.

    Args:
      what: the headline, naming the user's call (``"fs.shard"``).
      mesh: the mesh involved.
      bad: ``(path, spec, shape, problems)`` per failing leaf.
      remedy: one sentence on how to fix it.
    """
    if not bad:
        return
    lines = [f"{what}: specs do not fit the values on {mesh!r}:"]
    for path, spec, shape, problems in bad:
        for prob in problems:
            lines.append(f"  * {path}: spec {spec!r}, shape {tuple(shape)}: {prob}")
    lines.append(remedy)
    kind_only = all(p.startswith("spec must be a P") for *_, probs in bad for p in probs)
    raise (TypeError if kind_only else ValueError)("\n".join(lines))


def local_block(
    spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, coord: dict[str, int] | None = None, *, uneven: bool = False
) -> tuple[slice, ...]:
    """The slices of the global tensor held at ``coord`` (default: this rank).

    A dim split over axes ``(a, b)`` is cut into ``|a|*|b|`` equal blocks and the
    block index is ``i_a * |b| + i_b`` (major to minor), as in JAX. With ``uneven``
    (FSDP parameters) a dim is cut like ``torch.chunk``, axis after axis in mesh order,
    as DTensor does: blocks of ``ceil(size / n)``, the last ones smaller or empty.
    """
    coord = mesh.coordinate() if coord is None else coord
    out = []
    for d, size in enumerate(shape):
        axes = spec.dim_axes(d)
        if uneven:
            start, length = 0, size
            for a in axes:
                c = -(-length // mesh.shape[a])
                lo = min(coord[a] * c, length)
                start, length = start + lo, min(lo + c, length) - lo
            out.append(slice(start, start + length))
            continue
        n, i = 1, 0
        for a in axes:
            n *= mesh.shape[a]
            i = i * mesh.shape[a] + coord[a]
        chunk = size // n
        out.append(slice(i * chunk, (i + 1) * chunk))
    return tuple(out)


def take_block(
    x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, *, uneven: bool = False, device=None, copy: bool = False
) -> torch.Tensor:
    """This rank's block of the global tensor ``x`` (each rank's own, under ``fs.simulate``),
    on ``device`` (default: ``x``'s), a contiguous copy when ``copy``."""
    return simulation.per_rank(_take)(x, spec, mesh, mesh.coordinate(), uneven, device, copy)


def _take(x, spec, mesh, coord, uneven, device, copy):
    block = x[local_block(spec, x.shape, mesh, coord, uneven=uneven)]
    if device is not None or copy:
        block = block.to(device or block.device, copy=copy)
    return block.contiguous() if copy else block


def block_shape(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, *, uneven: bool = False) -> tuple[int, ...]:
    """The shape of this rank's block (a per-rank int where it differs, under ``fs.simulate``)."""
    return tuple(simulation.per_rank(_block_shape)(spec, tuple(shape), mesh, mesh.coordinate(), uneven))


def _block_shape(spec, shape, mesh, coord, uneven):
    return [b.stop - b.start for b in local_block(spec, shape, mesh, coord, uneven=uneven)]


def shard_shape(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
    """The per-rank shape of a tensor of global ``shape`` laid out by ``spec``."""
    return tuple(s // (mesh.axis_size(spec.dim_axes(d)) if spec.dim_axes(d) else 1) for d, s in enumerate(shape))


def spec_to_placements(spec: PartitionSpec, mesh: Mesh) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh axis) for ``spec``.

    A dim split over axes in mesh order maps to plain ``Shard``s. Any other major to
    minor order needs ``_StridedShard`` on the axes that shard "before" an axis that
    comes earlier in the mesh (torch's right-to-left sharding, as FSDP x TP uses).
    """
    # Every shard_map call asks this for each of its DTensor arguments: cached per mesh.
    cache = getattr(mesh, "__dict__", {}).setdefault("_spec_placements", {})
    hit = cache.get(spec)
    if hit is not None:
        return hit
    placements: list[Placement] = [Replicate() for _ in mesh.axis_names]
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        for j, a in enumerate(axes):
            mi = mesh.axis_names.index(a)
            sf = math.prod(mesh.shape[b] for b in axes[:j] if mesh.axis_names.index(b) > mi)
            placements[mi] = Shard(d) if sf == 1 else _StridedShard(d, split_factor=sf)
    cache[spec] = out = tuple(placements)
    return out


def _same(a: Placement, b: Placement) -> bool:
    # Compare kinds too, so a plain Shard never stands for a strided one.
    return type(a) is type(b) and a == b


def placements_to_spec(placements: Sequence[Placement], mesh: Mesh, *, path: str = "<value>") -> PartitionSpec:
    """The ``P`` that :func:`spec_to_placements` maps to ``placements``.

    Raises:
      ValueError: a ``Partial`` placement (a pending reduction has no spec), or strided
        placements that no major-to-minor order produces.
    """
    per_dim: dict[int, list[str]] = {}
    for a, pl in zip(mesh.axis_names, placements):
        if isinstance(pl, Partial):
            raise ValueError(
                f"{path}: placement {pl} on mesh axis {a!r} is a pending reduction and has no "
                f"PartitionSpec; reduce it first (e.g. x.redistribute(..., [Replicate()]))."
            )
        if isinstance(pl, (Shard, _StridedShard)):
            per_dim.setdefault(pl.dim, []).append(a)
    if not per_dim:
        return P()
    ndim = max(per_dim) + 1
    entries: list[object] = [None] * ndim
    want = tuple(placements)
    for d, axes in per_dim.items():
        for order in itertools.permutations(axes):
            trial = list(entries)
            trial[d] = order
            got = spec_to_placements(P(*trial), mesh)
            if all(_same(got[mesh.axis_names.index(a)], want[mesh.axis_names.index(a)]) for a in axes):
                entries[d] = order
                break
        else:
            raise ValueError(f"{path}: placements {tuple(placements)} on {mesh!r} match no PartitionSpec.")
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)

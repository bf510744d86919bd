"""``shard`` / ``gather`` / ``reshard`` / ``spec_of`` over pytrees of DTensors.

A sharded value is a torch ``DTensor``: fshard adds the spec language and pytree
handling on top, and leaves the storage, redistribution and checkpoint formats to
torch. Plain tensors passed to :func:`shard` are global values (the same on every
rank); each rank keeps only its block, so the values are unchanged.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh, get_mesh
from fshard.mesh.placement import (
    placements_to_spec,
    raise_spec_errors,
    spec_problems,
    spec_to_placements,
    take_block,
    uneven_problems,
)
from fshard.mesh.spec import PartitionSpec, is_spec
from fshard.runtime import teardown

__all__ = ["NamedSharding", "shard", "gather", "reshard", "spec_of", "make_dtensor"]


@attrs.frozen
class NamedSharding:
    """A spec bound to a mesh: how one tensor is laid out.

    Attributes:
      mesh: the :class:`Mesh`.
      spec: the :class:`P`.
    """

    mesh: Mesh
    spec: PartitionSpec = attrs.field(validator=attrs.validators.instance_of(PartitionSpec))

    @property
    def placements(self):
        """The equivalent DTensor placements, one per mesh axis."""
        return spec_to_placements(self.spec, self.mesh)

    def shard_shape(self, global_shape) -> tuple[int, ...]:
        """Per-rank shape for ``global_shape``."""
        from fshard.mesh.placement import shard_shape

        return shard_shape(self.spec, global_shape, self.mesh)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def make_dtensor(local: torch.Tensor, spec: PartitionSpec, mesh: Mesh, global_shape) -> DTensor:
    """Wraps this rank's block ``local`` as a DTensor of ``global_shape`` laid out by ``spec``."""
    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local,
        mesh.device_mesh,
        spec_to_placements(spec, mesh),
        run_check=False,
        shape=shape,
        stride=stride,
    )


def _check_leaves(what: str, paths, values, specs, mesh: Mesh, remedy: str, uneven: bool = False) -> None:
    bad = []
    for path, x, spec in zip(paths, values, specs):
        if _is_tensor(x):
            probs = spec_problems(spec, tuple(x.shape), mesh, allow_uneven=uneven)
            if not probs and uneven:
                probs = uneven_problems(spec, tuple(x.shape), mesh)
            if probs:
                bad.append((path, spec, tuple(x.shape), probs))
    raise_spec_errors(what, mesh, bad, remedy)


def _flat(tree: Any, specs: Any, what: str):
    paths, values, treedef = tree_util.zip_with_path(tree)
    flat_specs = tree_util.broadcast_prefix(specs, tree, is_prefix_leaf=is_spec, name="specs", full_name="values")
    return paths, values, flat_specs, treedef


def shard(tree: Any, specs: Any, mesh: Mesh | None = None, *, uneven: bool = False) -> Any:
    """Lays out a pytree of global tensors over ``mesh``: each leaf becomes a DTensor.

    Args:
      tree: pytree whose tensor leaves are global values, identical on every rank
        (non-tensor leaves pass through). DTensor leaves are redistributed to the spec.
      specs: a pytree prefix of ``tree`` with :class:`P` leaves.
      mesh: the mesh (default: the current mesh).
      uneven: allow dims that the axes do not divide, cut like ``torch.chunk`` (FSDP
        parameters; DTensor's own uneven layout). Only for axes in mesh order.

    Returns:
      The same structure with DTensor leaves; ``gather`` of it gives back ``tree``.

    Raises:
      ValueError: ``specs`` is not a prefix of ``tree``, or a spec does not fit its
        leaf (too long, unknown or repeated axis, dim not divisible); the message lists
        every bad leaf with its path, spec, shape, axis and sizes.
    """
    mesh = get_mesh(mesh, what="fs.shard")
    paths, values, flat_specs, treedef = _flat(tree, specs, "fs.shard")
    _check_leaves(
        "fs.shard",
        paths,
        values,
        flat_specs,
        mesh,
        "Fix the spec."
        if uneven
        else "Fix the spec, pad the dim to a multiple of the axis size, or pass uneven=True to cut it "
        'like torch.chunk (FSDP parameters: docs/concepts.md, "Uneven shards").',
        uneven,
    )
    out = []
    for x, spec in zip(values, flat_specs):
        if isinstance(x, DTensor):
            out.append(_redistribute(x, spec, mesh))
        elif _is_tensor(x):
            local = take_block(x.detach(), spec, mesh, uneven=uneven, device=mesh.device, copy=True)
            local.requires_grad_(x.requires_grad)
            out.append(make_dtensor(local, spec, mesh, x.shape))
        else:
            out.append(x)
    return tree_util.tree_unflatten(treedef, out)


def _redistribute(x: DTensor, spec: PartitionSpec, mesh: Mesh) -> DTensor:
    if x.device_mesh is not mesh.device_mesh and x.device_mesh != mesh.device_mesh:
        raise ValueError(
            f"cannot move a DTensor from mesh {x.device_mesh} to {mesh!r} with reshard; "
            f"gather it first (fs.gather) and shard the full value."
        )
    return x.redistribute(mesh.device_mesh, spec_to_placements(spec, mesh))


def gather(tree: Any) -> Any:
    """Full (replicated) plain tensors for every DTensor leaf; other leaves unchanged.

    Collective: every rank of the leaves' meshes must call it with the same tree. A
    device tensor on a mesh that uses gloo for that device (ranks sharing one GPU) is
    gathered through host memory (:func:`fshard.comm.via_host`).
    """
    return tree_util.tree_map(_full, tree)


def _full(x: Any) -> Any:
    if not isinstance(x, DTensor):
        return x
    if x.device.type != "cpu" and _staged_mesh(x.device_mesh, x.device):
        return _full_via_host(x).to(x.device)
    return x.full_tensor()


def _staged_mesh(dm, device: torch.device) -> bool:
    from fshard.comm import via_host

    return any(via_host(dm.get_group(i), device) for i in range(dm.ndim))


# id(device mesh) -> (device mesh, the same groups as a CPU mesh); the mesh is kept so its id stays its own.
_HOST_MESHES: dict[int, tuple[Any, Any]] = {}


def _full_via_host(x: DTensor) -> torch.Tensor:
    """``x.full_tensor()`` computed on the host: the local block is copied to the CPU and
    gathered over the same process groups viewed as a CPU device mesh (a plain CPU tensor)."""
    from torch.distributed.device_mesh import DeviceMesh

    dm = x.device_mesh
    cached = _HOST_MESHES.get(id(dm))
    if cached is None or cached[0] is not dm:
        groups = [dm.get_group(i) for i in range(dm.ndim)]
        host = DeviceMesh.from_group(
            groups if dm.ndim > 1 else groups[0], "cpu", mesh=dm.mesh, mesh_dim_names=dm.mesh_dim_names
        )
        cached = _HOST_MESHES[id(dm)] = (dm, host)
    local = x.to_local().cpu()
    return DTensor.from_local(
        local, cached[1], x.placements, run_check=False, shape=x.shape, stride=x.stride()
    ).full_tensor()


def reshard(tree: Any, specs: Any, mesh: Mesh | None = None) -> Any:
    """Changes the layout of every leaf to ``specs`` (plain tensors are sharded).

    Raises:
      ValueError: as :func:`shard`.
    """
    return shard(tree, specs, mesh)


def spec_of(x: Any, mesh: Mesh | None = None) -> PartitionSpec | Any:
    """The :class:`P` of a DTensor, or a pytree of them for a pytree of DTensors.

    Plain tensors give ``P()`` (a plain tensor is a replicated value).
    """

    def one(path: str, leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            m = mesh or _mesh_of(leaf)
            return placements_to_spec(leaf.placements, m, path=path)
        return PartitionSpec()

    if isinstance(x, torch.Tensor):
        return one("<value>", x)
    return tree_util.tree_map_with_path(one, x)


def _mesh_of(x: DTensor) -> Mesh:
    names = x.device_mesh.mesh_dim_names
    if names is None:
        raise ValueError("this DTensor's DeviceMesh has no dim names; pass mesh=... to spec_of.")
    from fshard.mesh.mesh import _MESH_CACHE

    for m in _MESH_CACHE.values():
        if m.device_mesh is x.device_mesh or m.device_mesh == x.device_mesh:
            return m
    return Mesh(x.device_mesh, names)


teardown.register_group_owner(teardown.GroupOwner("fshard.mesh.host_meshes", forget=_HOST_MESHES.clear))

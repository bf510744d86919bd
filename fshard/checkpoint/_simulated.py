"""DCP under ``fs.simulate``: one process writes and reads what every simulated rank would.

Shim ``dcp_per_rank`` (listed in ``docs/simulate.md``). Under a simulation one process
stands for ``n`` ranks and there is no gloo group for DCP's collectives (the ``fake``
backend cannot make one). DCP itself runs as is, once per simulated rank: this module
drives the same steps ``dcp.save`` / ``dcp.load`` take on real ranks, in the order their
collectives impose, with one planner and one storage writer (reader) per rank and
rank 0 as the coordinator:

- save: each rank's local plan, rank 0's global plan (deduplication, file prefixes
  ``__<rank>_``), each rank's write, rank 0's ``.metadata``;
- load: each rank's local plan (the shards it needs), rank 0's global plan, each rank's
  read.

Each rank's state dict holds plain tensors: a DTensor leaf becomes rank ``r``'s block as a
DTensor on :class:`_RankMesh`, the mesh as rank ``r`` sees it (its coordinate), so DCP
computes rank ``r``'s offsets with its own code. The files, the metadata and which rank
writes a replicated value are the ones ``n`` real ranks produce, so a checkpoint saved
under a simulation loads on real ranks, any mesh, and the other way round.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from fshard.runtime import simulation

__all__ = ["active", "combine", "empty_per_rank", "load_per_rank", "per_rank_state_dicts", "save_per_rank"]


def active() -> bool:
    """Whether a simulation stands for the ranks (the checkpoint then goes through this module)."""
    return simulation.active() is not None


class _RankMesh(DeviceMesh):
    """A DeviceMesh as one simulated rank sees it: its coordinate is that rank's.

    Defines the methods torch's ``LocalTensorMode`` patches on ``DeviceMesh`` (they answer
    for every rank at once, and only while the mode is on), so DCP's planning, on any
    thread, computes this rank's shard offsets.
    """

    _sim_rank: int

    @classmethod
    def of(cls, mesh: DeviceMesh, rank: int, coordinate: tuple[int, ...]) -> "_RankMesh":
        view = object.__new__(cls)
        view.__dict__.update(mesh.__dict__)
        view._coordinate_on_dim = coordinate
        view._sim_rank = rank
        return view

    def get_coordinate(self) -> tuple[int, ...] | None:
        return self._coordinate_on_dim

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, index: int) -> int:
        return self._coordinate_on_dim[index]  # type: ignore[index]

    def get_rank(self) -> int:
        return self._sim_rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        d = 0 if mesh_dim is None else mesh_dim
        if isinstance(d, str):
            d = list(self.mesh_dim_names or ()).index(d)
        return self._coordinate_on_dim[d]  # type: ignore[index]


def _on_rank(value: Any, rank: int) -> int:
    from torch.distributed._local_tensor import _int_on_rank

    return _int_on_rank(value.node if isinstance(value, torch.SymInt) else value, rank)


def _block(t: torch.Tensor, rank: int) -> torch.Tensor:
    local = getattr(t, "_local_tensors", None)
    return local[rank] if local is not None else t


def per_rank_state_dicts(state_dict: dict[str, Any], *, copy: bool = False) -> list[dict[str, Any]]:
    """Each simulated rank's state dict: DTensor leaves as that rank's block on its
    :class:`_RankMesh`, tensors as that rank's block, other values as they are.

    Args:
      state_dict: flat ``{key: leaf}`` made inside the simulation.
      copy: copy tensors to CPU (a background save: the caller may change them).

    Returns:
      One state dict per rank, in rank order, holding plain tensors only.
    """
    sim = simulation.active()
    assert sim is not None, "per_rank_state_dicts runs under fs.simulate"
    n = sim.world_size
    coords: dict[int, list[tuple[int, ...]]] = {}
    for x in state_dict.values():
        if isinstance(x, DTensor) and id(x.device_mesh) not in coords:
            c = x.device_mesh.get_coordinate()  # per-rank ints while the mode is on
            assert c is not None
            coords[id(x.device_mesh)] = [tuple(_on_rank(v, r) for v in c) for r in range(n)]
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    with simulation.outside():
        for k, x in state_dict.items():
            for r in range(n):
                if isinstance(x, DTensor):
                    local = _block(x._local_tensor, r).detach()
                    if copy:
                        local = local.to("cpu", copy=True)
                    mesh = _RankMesh.of(x.device_mesh, r, coords[id(x.device_mesh)][r])
                    spec = DTensorSpec(mesh, x._spec.placements, tensor_meta=x._spec.tensor_meta)
                    out[r][k] = DTensor(local, spec, requires_grad=False)
                elif isinstance(x, torch.Tensor):
                    t = _block(x, r).detach()
                    out[r][k] = t.to("cpu", copy=True) if copy else t
                else:
                    out[r][k] = x
    return out


def save_per_rank(state_dicts: list[dict[str, Any]], writers: list[Any]) -> None:
    """DCP's save steps for every rank (``state_dicts[r]`` with ``writers[r]``), rank 0 coordinating.

    Raises:
      Exception: the first rank's failure, as ``dcp.save`` raises it on every rank.
    """
    with simulation.outside():
        n = len(state_dicts)
        planners = [DefaultSavePlanner() for _ in range(n)]
        local_plans = []
        for r in range(n):
            w = writers[r]
            planners[r].set_up_planner(state_dict=state_dicts[r], storage_meta=w.storage_meta(), is_coordinator=r == 0)
            w.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
            local_plans.append(w.prepare_local_plan(planners[r].create_local_plan()))
        global_plans, metadata = planners[0].create_global_plan(local_plans)
        global_plans = writers[0].prepare_global_plan(global_plans)
        results = []
        for r in range(n):
            final = planners[r].finish_plan(global_plans[r])
            fut = writers[r].write_data(final, planners[r])
            fut.wait()
            results.append(fut.value())
        writers[0].finish(metadata=metadata, results=results)


def load_per_rank(state_dicts: list[dict[str, Any]], readers: list[Any]) -> None:
    """DCP's load steps for every rank, reading into ``state_dicts[r]`` in place (rank 0 coordinating)."""
    with simulation.outside():
        n = len(state_dicts)
        planners = [DefaultLoadPlanner() for _ in range(n)]
        local_plans = []
        for r in range(n):
            md = readers[r].read_metadata()
            planners[r].set_up_planner(state_dicts[r], md, r == 0)
            readers[r].set_up_storage_reader(md, r == 0, rank=r, use_collectives=True)
            local_plans.append(readers[r].prepare_local_plan(planners[r].create_local_plan()))
        global_plans = readers[0].prepare_global_plan(planners[0].create_global_plan(local_plans))
        for r in range(n):
            final = planners[r].finish_plan(global_plans[r])
            readers[r].read_data(final, planners[r]).wait()


def empty_per_rank(keys: list[str], leaves: list[Any]) -> list[dict[str, Any]]:
    """Each rank's buffers to read into, laid out like the template ``leaves``."""
    sds = per_rank_state_dicts(dict(zip(keys, leaves)))
    with simulation.outside():
        for sd in sds:
            for k, v in sd.items():
                if isinstance(v, DTensor):
                    sd[k] = DTensor(torch.empty_like(v._local_tensor), v._spec, requires_grad=False)
                elif isinstance(v, torch.Tensor):
                    sd[k] = torch.empty_like(v, requires_grad=False)
    return sds


def combine(key: str, like: Any, state_dicts: list[dict[str, Any]]) -> Any:
    """The value of ``key`` read on every rank, as one simulated value laid out like ``like``:
    a DTensor of every rank's block, a tensor per rank (the template's kind), or rank 0's value."""
    from torch.distributed._local_tensor import LocalTensor

    values = [sd[key] for sd in state_dicts]
    if isinstance(like, DTensor):
        with simulation.outside():
            local = LocalTensor({r: v._local_tensor for r, v in enumerate(values)})
        return DTensor(local, like._spec, requires_grad=False)
    if isinstance(like, torch.Tensor):
        if isinstance(like, LocalTensor):
            with simulation.outside():
                return LocalTensor(dict(enumerate(values)))
        return values[0]  # a plain tensor is one value for every rank
    return values[0]

"""``Mesh``: named axes over a torch ``DeviceMesh``, and the current-mesh context.

A mesh is an n-d grid of ranks with one name per axis, row-major over global ranks:
``make_mesh({"dp": 2, "tp": 2})`` puts ranks 0,1 on ``dp=0`` and 2,3 on ``dp=1``.
Collectives over a single axis use the ``DeviceMesh``'s own groups; collectives over
several axes at once (``psum(x, ("dp", "tp"))``) use groups built here, eagerly, when
the mesh is made, so that no collective ever has to create a group on some ranks only.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import numbers
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fshard.runtime import gloo_workers, process, teardown

__all__ = ["Mesh", "make_mesh", "current_mesh", "get_mesh"]

_CURRENT: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar("fshard_current_mesh", default=None)
# make_mesh is collective (it creates process groups), so the cache is filled in the
# same order on every rank; keyed per default group so a new world starts afresh.
_MESH_CACHE: dict[tuple[Any, ...], "Mesh"] = {}


class Mesh:
    """A named grid of ranks.

    Attributes:
      axis_names: the axis names, major to minor.
      shape: ``{name: size}`` in axis order.
      size: the number of ranks (product of the axis sizes).
      device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
      device_mesh: the underlying ``torch.distributed.device_mesh.DeviceMesh``.

    Use it as a context manager to make it the current mesh::

      with fs.make_mesh({"fsdp": 4}) as mesh:
          ...  # fs.shard(..., mesh=None) and shard_map pick it up
    """

    def __init__(self, device_mesh: DeviceMesh, axis_names: Sequence[str]) -> None:
        self.device_mesh = device_mesh
        self.axis_names: tuple[str, ...] = tuple(axis_names)
        self.shape: dict[str, int] = dict(zip(self.axis_names, device_mesh.mesh.shape))
        self.size: int = math.prod(self.shape.values())
        self.device_type: str = device_mesh.device_type
        self._groups: dict[tuple[str, ...], Any] = {}
        # fs.lax's per-axes facts (group, size, this rank's index), kept on the mesh itself: a
        # cache keyed by id(mesh) would hand a new mesh that reuses a freed one's id the freed
        # mesh's (destroyed) groups.
        self._lax_axes: dict[tuple[str, ...], Any] = {}
        self._tokens: list[contextvars.Token] = []
        coord = device_mesh.get_coordinate()
        self._coord: dict[str, int] = dict(zip(self.axis_names, coord or ()))

    # --- context manager -------------------------------------------------------
    def __enter__(self) -> "Mesh":
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(self._tokens.pop())

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"Mesh({axes}; {self.device_type})"

    # --- queries ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device local shards live on (``cuda:<local rank>`` or ``cpu``)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def axis_size(self, axes: str | Sequence[str]) -> int:
        """Size of one axis, or the product of several."""
        return math.prod(self.shape[a] for a in self.check_axes(axes))

    def axis_index(self, axes: str | Sequence[str]) -> int:
        """This rank's index along ``axes`` (row-major over a tuple, in the tuple's order)."""
        idx = 0
        for a in self.check_axes(axes):
            idx = idx * self.shape[a] + self._coord[a]
        return idx

    def coordinate(self) -> dict[str, int]:
        """This rank's position ``{axis: index}``."""
        return dict(self._coord)

    def check_axes(self, axes: str | Sequence[str], *, what: str = "axis_name") -> tuple[str, ...]:
        """Normalizes ``axes`` to a tuple and checks each name exists once.

        Raises:
          ValueError: an unknown or repeated axis; the message lists the mesh axes.
        """
        tup = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in tup if a not in self.shape]
        if unknown:
            raise ValueError(
                f"{what}={axes!r} names {unknown!r}, which is not an axis of {self!r}; "
                f"mesh axes are {list(self.axis_names)}."
            )
        if len(set(tup)) != len(tup):
            raise ValueError(f"{what}={axes!r} repeats an axis of {self!r}.")
        return tup

    def group(self, axes: str | Sequence[str]) -> Any:
        """The process group spanning ``axes`` (ranks ordered by global rank).

        For several axes, the group's rank order is the mesh order of those axes; callers
        that need another major-to-minor order permute (see ``fshard.lax``).
        """
        tup = self.check_axes(axes)
        key = tuple(sorted(tup, key=self.axis_names.index))
        if len(key) == 1:
            return self.device_mesh.get_group(key[0])
        return self._groups[key]

    def sub_axes_in_mesh_order(self, axes: Sequence[str]) -> tuple[str, ...]:
        return tuple(sorted(axes, key=self.axis_names.index))

    def _build_multi_axis_groups(self, backend: str | None) -> None:
        ranks = self.device_mesh.mesh  # tensor of global ranks, shape = mesh shape
        n = len(self.axis_names)
        for k in range(2, n + 1):
            for dims in itertools.combinations(range(n), k):
                others = [d for d in range(n) if d not in dims]
                moved = ranks.permute(*others, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
                enumeration = [row.tolist() for row in moved]
                # torch would give these groups its own 30-minute default, not the world's timeout
                group, _ = dist.new_subgroups_by_enumeration(
                    enumeration, backend=backend, timeout=process.group_timeout()
                )
                self._groups[tuple(self.axis_names[d] for d in dims)] = group


def make_mesh(
    axes: Mapping[str, int],
    *,
    device_type: str | None = None,
) -> Mesh:
    """Makes a named mesh over all ranks: ``make_mesh({"pp": 2, "fsdp": 2})``.

    Axis order is the dict's order (major to minor over global ranks). Starts the
    process group first when needed (see :func:`fshard.init`), so a plain one-process
    script can call ``make_mesh({"fsdp": 1})`` directly. Meshes are cached: asking for
    the same axes again returns the same ``Mesh`` (making one is collective).

    Args:
      axes: ``{axis_name: size}``; the product must equal the world size.
      device_type: ``"cpu"`` or ``"cuda"``; default follows the process group's backend
        (``"cuda"`` for nccl, else ``"cpu"``).

    Returns:
      The :class:`Mesh`.

    Every group the mesh holds (one per axis, one per set of axes) waits at most
    :func:`fshard.runtime.process.group_timeout` in a collective: the world's timeout, not
    torch's 30-minute default for new groups.

    Raises:
      ValueError: empty axes, a size that is not a positive int (a bool, a float, a string,
        zero, a negative number), a name that is not an identifier string, a name given
        twice, or sizes whose product differs from the world size. The message names the
        axis and the value.
    """
    axes = _checked_axes(axes)
    total = math.prod(axes.values())
    process.ensure_initialized(total)
    world = dist.get_world_size()
    if total != world:
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ValueError(
            f"make_mesh({axes}): the mesh has {shape} = {total} ranks but the world size is "
            f"{world}. Choose axis sizes whose product is {world}."
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (id(dist.group.WORLD), device_type, tuple(axes.items()))
    mesh = _MESH_CACHE.get(key)
    if mesh is None:
        with gloo_workers.one_worker():  # torch's two gloo workers race (fshard.runtime.gloo_workers)
            dm = init_device_mesh(
                device_type,
                tuple(axes.values()),
                mesh_dim_names=tuple(axes),
                backend_override=_timeout_overrides(axes, world, dist.get_backend()) or None,
            )
            mesh = Mesh(dm, tuple(axes))
            mesh._build_multi_axis_groups(dist.get_backend())
        from fshard.comm import register_group

        for a in mesh.axis_names:
            register_group(dm.get_group(a), (a,))
        for axes_key, group in mesh._groups.items():
            register_group(group, axes_key)
        _MESH_CACHE[key] = mesh
    return mesh


def _checked_axes(axes: Any) -> dict[str, int]:
    """``axes`` as ``{name: size}``, or a ValueError naming the axis and the bad value.

    Accepts a mapping or a sequence of ``(name, size)`` pairs (where a repeated name is
    an error, not a silent overwrite). Sizes must be ints (``numpy`` integers too) and
    positive: a bool is refused even though Python counts it as an int, because
    ``{"dp": True}`` is a typo, not a size of 1.
    """
    example = "e.g. make_mesh({'dp': 2, 'fsdp': 2})"
    if isinstance(axes, Mapping):
        pairs = list(axes.items())
    elif isinstance(axes, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in axes):
        pairs = [tuple(p) for p in axes]
    else:  # a string, a number, a list of names: no size to read
        raise ValueError(
            f"make_mesh: axes must be a dict {{name: size}} or (name, size) pairs, got "
            f"{type(axes).__name__} {axes!r}; {example}."
        )
    if not pairs:
        raise ValueError(f"make_mesh needs at least one axis, {example} or make_mesh({{'fsdp': 1}}).")
    out: dict[str, int] = {}
    for name, size in pairs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"make_mesh: axis name {name!r} ({type(name).__name__}) must be an identifier string; {example}."
            )
        if name in out:
            raise ValueError(f"make_mesh: axis {name!r} is given twice; each axis name must be unique.")
        out[name] = _checked_size(name, size)
    return out


def _checked_size(name: str, size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise ValueError(
            f"make_mesh: axis {name!r} has size {size!r} ({type(size).__name__}); a size must be "
            f"a positive int, e.g. {{{name!r}: 2}}."
        )
    if size < 1:
        raise ValueError(
            f"make_mesh: axis {name!r} has size {size!r}; a size must be a positive int "
            f"(use {{{name!r}: 1}} for an axis that does not split)."
        )
    return int(size)


def _timeout_overrides(axes: Mapping[str, int], world: int, backend: str) -> dict[int | str, Any]:
    """``init_device_mesh``'s ``backend_override``: the world's timeout for each axis whose
    groups torch would otherwise create with its own 30-minute default.

    An axis that spans the whole world reuses the default group, which has the timeout
    already; overriding it would make torch build a second world-sized group instead. On a
    CUDA machine with a gloo world torch builds a new group for that axis anyway, so it is
    overridden too, and so is a gloo world group with more than one worker thread (one the
    caller made with ``dist.init_process_group``): its workers race
    (:mod:`fshard.runtime.gloo_workers`), so the axis gets a one-worker group of its own. A
    backend with no options class (not gloo or nccl) keeps torch's behaviour.
    """
    options_cls = {
        "gloo": getattr(dist, "ProcessGroupGloo", None),
        "nccl": getattr(dist, "ProcessGroupNCCL", None),
    }.get(backend)
    if options_cls is None:
        return {}
    timeout = process.group_timeout()
    world_reuses_default = not (torch.cuda.is_available() and backend == "gloo")
    if backend == "gloo" and (gloo_workers.worker_threads() or 1) > 1:
        world_reuses_default = False
    out: dict[int | str, Any] = {}
    for name, size in axes.items():
        if size == world and world_reuses_default:
            continue
        opts = options_cls._Options() if backend == "gloo" else options_cls.Options()
        opts._timeout = timeout
        out[name] = opts
    return out


def forget_meshes() -> None:
    """Drops the mesh cache and every process group fshard's meshes hold (``fs.shutdown()``).

    A caller may still hold a mesh: its groups are destroyed, so it cannot be used after
    this.
    """
    for m in list(_MESH_CACHE.values()):
        m._groups.clear()
        m._lax_axes.clear()
        _forget_device_mesh_groups(m.device_mesh)
    _MESH_CACHE.clear()


def _forget_device_mesh_groups(dm: DeviceMesh) -> None:
    # The one place fshard reads torch's private DeviceMesh state, because torch offers no
    # public way: torch 2.13's DeviceMesh keeps its groups by name in its root mesh's
    # _pg_registry, which outlives destroy_process_group() and would keep the groups (and
    # their gloo worker threads) alive into interpreter finalization (fshard.runtime.teardown).
    # Missing attributes (another torch) leave nothing to clear.
    root = getattr(dm, "_root_mesh", None) or dm
    for d in (dm, root):
        registry = getattr(d, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def current_mesh() -> Mesh | None:
    """The mesh of the innermost ``with mesh:`` block, or ``None``."""
    return _CURRENT.get()


def get_mesh(mesh: Mesh | None, *, what: str) -> Mesh:
    """``mesh`` if given, else the current mesh; a clear error when neither exists."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{what}: mesh must be an fshard Mesh (fs.make_mesh), got {type(mesh).__name__}.")
        return mesh
    cur = _CURRENT.get()
    if cur is None:
        raise ValueError(f"{what} needs a mesh: pass mesh=... or call it inside `with fs.make_mesh({{...}}):`.")
    return cur


def _mesh_groups() -> list[Any]:
    """Every process group the cached meshes hold: one per axis, one per set of axes."""
    out: list[Any] = []
    for m in _MESH_CACHE.values():
        out.extend(m.device_mesh.get_group(a) for a in m.axis_names)
        out.extend(m._groups.values())
    return out


def _detach_after_fork() -> dict[tuple[Any, ...], Mesh]:
    kept = dict(_MESH_CACHE)
    _MESH_CACHE.clear()
    return kept


teardown.register_group_owner(
    teardown.GroupOwner("fshard.mesh", groups=_mesh_groups, forget=forget_meshes, after_fork=_detach_after_fork)
)

"""Raw collectives over a process group, and ``comm_log``, which counts them.

These are the non-differentiable building blocks under :mod:`fshard.lax` (and the
layer loops of :mod:`fshard.parallel`). They use torch's functional collectives
(``torch.ops._c10d_functional``: out-of-place, so activation checkpointing can save or
replay them) and ``batch_isend_irecv`` for point-to-point.

``with comm_log() as log:`` counts what is really sent: a dispatch mode sees every
functional collective that reaches the wire (also those issued by autograd in
backward, by DTensor, or by a recomputation; not those a checkpoint policy served from
its cache), and maps its process group back to mesh axes. Point-to-point exchanges
are recorded by :func:`permute` itself.

``log.timeline`` orders what one rank did, for tests that observe *when* things happen
(prefetch, regathers, overlap) rather than only how often: every issue of a collective,
every wait on one (``wait_tensor``), and every :func:`mark` the caller made (e.g. "layer
3's compute starts"), in program order. Sequence positions, not wall times, so the
order is deterministic.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import Counter
from typing import Iterator, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommLog", "Event", "comm_log", "mark", "record", "all_reduce", "all_gather", "reduce_scatter",
           "all_to_all", "permute", "Handle", "all_gather_async", "reduce_scatter_async",
           "backend_of", "p2p_via_host"]

_F = torch.ops._c10d_functional
_LOGS: contextvars.ContextVar[tuple["CommLog", ...]] = contextvars.ContextVar("fshard_comm_logs", default=())


@attrs.frozen
class Event:
    """One entry of :attr:`CommLog.timeline`.

    Attributes:
      what: ``"issue"`` (a collective was started), ``"wait"`` (its result was waited
        for) or ``"mark"`` (a :func:`mark` call).
      kind, axes, nbytes: the collective, as in :attr:`CommLog.events` (a wait repeats
        those of the issue it ends); ``None``, ``()``, ``0`` for a mark.
      label: the mark's label (any value); ``None`` otherwise.
    """

    what: str
    kind: str | None = None
    axes: tuple[str, ...] = ()
    nbytes: int = 0
    label: object = None


@attrs.define
class CommLog:
    """Collective counts and bytes, by kind and by (kind, axes).

    Attributes:
      counts: ``Counter`` of calls per kind (``"all_gather"``, ``"psum_scatter"``,
        ``"psum"``, ``"pmax"``, ``"pmin"``, ``"ppermute"``, ``"all_to_all"``).
      bytes: ``Counter`` of bytes each rank contributed (its input payload), per kind.
      by_axis: ``Counter`` keyed by ``(kind, axes)``, axes a tuple of mesh axis names.
      bytes_by_axis: like ``by_axis``, in bytes.
      events: ``(kind, axes, nbytes)`` in issue order.
      timeline: :class:`Event` s in program order: issues, waits (functional
        collectives; point-to-point exchanges are synchronous and log their issue
        only) and :func:`mark` s.
    """

    counts: Counter = attrs.field(factory=Counter)
    bytes: Counter = attrs.field(factory=Counter)
    by_axis: Counter = attrs.field(factory=Counter)
    bytes_by_axis: Counter = attrs.field(factory=Counter)
    events: list = attrs.field(factory=list)
    timeline: list = attrs.field(factory=list)

    def total(self) -> int:
        """Number of collectives of every kind."""
        return sum(self.counts.values())

    def __str__(self) -> str:
        rows = [f"{k:>14} {tuple(a)!s:<18} x{n:<5} {self.bytes_by_axis[(k, a)] / 1e6:10.3f} MB"
                for (k, a), n in sorted(self.by_axis.items())]
        return "\n".join(["comm_log:"] + rows) if rows else "comm_log: no collectives"


# group_name -> mesh axes, filled by Mesh for every group it owns. Several meshes may share
# one group (every 1-D mesh over the whole world uses the default group), so fshard's own
# calls name their axes through _CALL_AXES and the registry is only a fallback (DTensor).
_GROUP_AXES: dict[str, tuple[str, ...]] = {}
_CALL_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("fshard_call_axes", default=None)
_KINDS = {
    _F.all_gather_into_tensor.default: "all_gather",
    _F.reduce_scatter_tensor.default: "psum_scatter",
    _F.all_to_all_single.default: "all_to_all",
}
_REDUCE_KINDS = {"sum": "psum", "avg": "pmean", "max": "pmax", "min": "pmin"}


def register_group(group, axes: Sequence[str]) -> None:
    """Names ``group`` by its mesh axes in logs."""
    _GROUP_AXES[group.group_name] = tuple(axes)


class _LogMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        # id(result) -> (weak ref to the result, its issue Event): a wait names its collective.
        self._issued: dict[int, tuple[weakref.ref, Event]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F.wait_tensor.default:
            entry = self._issued.pop(id(args[0]), None)
            if entry is not None and entry[0]() is args[0]:
                _append(attrs.evolve(entry[1], what="wait"))
            return func(*args, **kwargs)
        kind = _KINDS.get(func)
        if kind is None and (func is _F.all_reduce.default or func is _F.all_reduce_.default):
            kind = _REDUCE_KINDS.get(args[1], "all_reduce")
        if kind is None:
            return func(*args, **kwargs)
        x = args[0]
        axes = _CALL_AXES.get() or _GROUP_AXES.get(args[-1], (args[-1],))
        event = record(kind, axes, x.numel() * x.element_size())
        out = func(*args, **kwargs)
        if event is not None and isinstance(out, torch.Tensor):
            self._issued[id(out)] = (weakref.ref(out), event)
        return out


@contextlib.contextmanager
def comm_log() -> Iterator[CommLog]:
    """Counts every collective issued by this rank inside the block (nesting allowed).

    Example:
      >>> with fs.comm_log() as log:
      ...     loss, grads = step(params, batch)
      >>> log.counts["all_gather"], log.by_axis[("psum", ("dp",))]
    """
    log = CommLog()
    outer = not _LOGS.get()
    token = _LOGS.set(_LOGS.get() + (log,))
    mode = _LogMode() if outer else contextlib.nullcontext()
    try:
        with mode:
            yield log
    finally:
        _LOGS.reset(token)


def record(kind: str, axes: Sequence[str], nbytes: int) -> Event | None:
    """Adds one collective to every active :class:`CommLog`.

    Returns:
      Its ``"issue"`` :class:`Event`, or ``None`` when no log is active.
    """
    logs = _LOGS.get()
    if not logs:
        return None
    axes = tuple(axes)
    event = Event("issue", kind, axes, nbytes)
    for log in logs:
        log.counts[kind] += 1
        log.bytes[kind] += nbytes
        log.by_axis[(kind, axes)] += 1
        log.bytes_by_axis[(kind, axes)] += nbytes
        log.events.append((kind, axes, nbytes))
        log.timeline.append(event)
    return event


def mark(label: object) -> None:
    """Puts ``label`` on the timeline of every active :class:`CommLog` (else does nothing).

    For observing when collectives happen relative to the caller's own steps::

        def block(p, h):
            fs.comm.mark(("start", i)); h = f(p, h); fs.comm.mark(("end", i)); return h
    """
    _append(Event("mark", label=label))


def _append(event: Event) -> None:
    for log in _LOGS.get():
        log.timeline.append(event)


@contextlib.contextmanager
def _named(axes: Sequence[str]):
    """Names the mesh axes of the collective issued inside, for comm_log."""
    if not _LOGS.get():
        yield
        return
    token = _CALL_AXES.set(tuple(axes))
    try:
        yield
    finally:
        _CALL_AXES.reset(token)


def all_reduce_async(x: torch.Tensor, group, op: str = "sum", *, axes: Sequence[str] = (),
                     inplace: bool = False) -> Handle:
    """Starts an all-reduce of ``x`` over ``group``.

    ``inplace``: reduce into ``x`` itself (contiguous, owned by the caller, not read before
    ``wait()``) rather than into a new tensor: on CPU a fresh multi-MB buffer costs a page
    fault per 4 KiB page on first write, every step.
    """
    with _named(axes):
        if inplace:
            return Handle(_F.all_reduce_(x, op, group.group_name))
        return Handle(_F.all_reduce(x.contiguous(), op, group.group_name))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Handle:
    """A collective in flight; ``wait()`` returns its result."""

    __slots__ = ("_tensor", "_post")

    def __init__(self, tensor: torch.Tensor, post=None) -> None:
        self._tensor, self._post = tensor, post

    def wait(self) -> torch.Tensor:
        out = _F.wait_tensor(self._tensor)
        return self._post(out) if self._post is not None else out


def all_reduce(x: torch.Tensor, group, op: str, *, axes: Sequence[str]) -> torch.Tensor:
    """All-reduce (``op`` in sum/max/min/avg) of ``x`` over ``group``; a new tensor."""
    with _named(axes):
        return _F.wait_tensor(_F.all_reduce(x.contiguous(), op, group.group_name))


def all_gather_async(x: torch.Tensor, group, n: int, *, axes: Sequence[str] = ()) -> Handle:
    """Starts an all-gather along dim 0 (result ``(n * x.shape[0], ...)``, group rank order)."""
    with _named(axes):
        return Handle(_F.all_gather_into_tensor(x.contiguous(), n, group.group_name))


def all_gather(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """All-gather along dim 0; see :func:`all_gather_async`."""
    return all_gather_async(x, group, n, axes=axes).wait()


def reduce_scatter_async(x: torch.Tensor, group, n: int, op: str = "sum", *,
                         axes: Sequence[str] = ()) -> Handle:
    """Starts a reduce-scatter along dim 0 (``x.shape[0]`` divisible by ``n``)."""
    with _named(axes):
        return Handle(_F.reduce_scatter_tensor(x.contiguous(), op, n, group.group_name))


def reduce_scatter(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """Sum reduce-scatter along dim 0; see :func:`reduce_scatter_async`."""
    return reduce_scatter_async(x, group, n, axes=axes).wait()


def all_to_all(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """Splits dim 0 into ``n`` chunks, sends chunk j to group rank j, concatenates received chunks."""
    split = [x.shape[0] // n] * n
    with _named(axes):
        return _F.wait_tensor(_F.all_to_all_single(x.contiguous(), split, split, group.group_name))


def backend_of(group, device_type: str) -> str:
    """The backend ``group`` uses for tensors on ``device_type`` (``"gloo"``, ``"nccl"``, ...).

    A group started with one backend (``"gloo"``) uses it for every device; a composite one
    (``"cpu:gloo,cuda:nccl"``) names one per device type.
    """
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(item.strip().split(":", 1) for item in name.split(","))
    return per_device.get(device_type, name)


def p2p_via_host(group, device: torch.device) -> bool:
    """True when point-to-point transfers of ``device`` tensors over ``group`` must be
    staged through host memory.

    gloo's collectives copy CUDA tensors through pinned host buffers themselves, but its
    ``send``/``recv`` hand the tensor's data pointer straight to the TCP transport, which
    would read device memory as host memory. That is the case of several ranks sharing
    one GPU through gloo (NCCL refuses two ranks on one device).
    """
    return device.type != "cpu" and backend_of(group, device.type) == "gloo"


def permute(x: torch.Tensor, group, sends: Sequence[tuple[int, int]], me: int, *,
            axes: Sequence[str]) -> torch.Tensor:
    """Point-to-point exchange: for each ``(src, dst)`` group ranks, src's ``x`` goes to dst.

    Ranks that receive nothing get zeros (as ``jax.lax.ppermute``). The result is on
    ``x``'s device; transfers a backend cannot make from that device go through host
    memory (:func:`p2p_via_host`).
    """
    x = x.contiguous()
    via_host = p2p_via_host(group, x.device)
    wire = x.cpu() if via_host else x
    out = torch.zeros_like(wire)
    ops = []
    for src, dst in sends:
        if src == me and dst == me:
            out = wire.clone()
        elif src == me:
            ops.append(dist.P2POp(dist.isend, wire, dist.get_global_rank(group, dst), group))
        elif dst == me:
            ops.append(dist.P2POp(dist.irecv, out, dist.get_global_rank(group, src), group))
    n_send = sum(1 for s, d in sends if s == me and d != me)
    record("ppermute", axes, _nbytes(x) * n_send)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out.to(x.device) if via_host else out

"""Raw collectives over a process group, and ``comm_log``, which counts them.

These are the non-differentiable building blocks under :mod:`fshard.lax` (and the
layer loops of :mod:`fshard.parallel`). They use torch's functional collectives
(``torch.ops._c10d_functional``: out-of-place, so activation checkpointing can save or
replay them). :func:`permute` (``fs.lax.ppermute``) is one too: an ``all_to_all_single``
whose split sizes send this rank's whole tensor to one peer and nothing to the others.

``with comm_log() as log:`` counts what is really sent: a dispatch mode sees every
functional collective that reaches the wire (also those issued by autograd in
backward, by DTensor, or by a recomputation; not those a checkpoint policy served from
its cache), and maps its process group back to mesh axes.

``log.timeline`` orders what one rank did, for tests that observe *when* things happen
(prefetch, regathers, overlap) rather than only how often: every issue of a collective,
every wait on one (``wait_tensor``), and every :func:`mark` the caller made (e.g. "layer
3's compute starts"), in program order. Sequence positions, not wall times, so the
order is deterministic.

``log.wire`` counts the bytes each rank puts on the wire (what it sends,
``fshard._wire.wire_bytes`` of its ``CollectiveKind``, the planner's count too): the minimum of
the algorithm a collective needs (ring all-reduce, direct all-gather / all-to-all), and
for gloo's native ``reduce_scatter_tensor`` the all-reduce it really runs. On gloo,
:func:`reduce_scatter_async` is lowered to ``all_to_all_single`` plus a local sum
(``(n-1)/n`` of the input on the wire instead of ``2(n-1)/n``); it is still logged as
``psum_scatter``.

Every collective here first calls :func:`fshard._contract.enter`: numbered on its group
and, with ``FSHARD_CHECK_COLLECTIVES=1``, agreed across the group's ranks before it starts
(a rank that differs in kind, axes, shape, dtype or op makes every rank raise
``CollectiveMismatchError``); a wait that times out says which collective each rank is in.
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

from fshard import _contract
from fshard._wire import REDUCE_KINDS, CollectiveKind, c10d_kind, wire_bytes
from fshard.runtime import simulation, teardown

__all__ = [
    "CommLog",
    "Event",
    "comm_log",
    "mark",
    "record",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "permute",
    "permute_async",
    "Handle",
    "all_gather_async",
    "reduce_scatter_async",
    "backend_of",
    "via_host",
    "one_at_a_time",
]

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
    wire: int = 0


@attrs.define
class CommLog:
    """Collective counts and bytes, by kind and by (kind, axes).

    Attributes:
      counts: ``Counter`` of calls per kind (``"all_gather"``, ``"psum_scatter"``,
        ``"psum"``, ``"pmax"``, ``"pmin"``, ``"ppermute"``, ``"all_to_all"``).
      bytes: ``Counter`` of bytes each rank contributed (its input payload), per kind.
      by_axis: ``Counter`` keyed by ``(kind, axes)``, axes a tuple of mesh axis names.
      bytes_by_axis: like ``by_axis``, in bytes.
      wire: ``Counter`` of bytes this rank sent on the wire, per kind (see the module
        docstring: e.g. ``(n-1)/n`` of the input for a reduce-scatter at the minimum).
      wire_by_axis: like ``by_axis``, in bytes on the wire.
      events: ``(kind, axes, nbytes)`` in issue order.
      timeline: :class:`Event` s in program order: issues, waits (of every
        collective issued; a ppermute whose pairs are all ``(i, i)`` issues none and
        logs its issue only) and :func:`mark` s.
    """

    counts: Counter = attrs.field(factory=Counter)
    bytes: Counter = attrs.field(factory=Counter)
    by_axis: Counter = attrs.field(factory=Counter)
    bytes_by_axis: Counter = attrs.field(factory=Counter)
    wire: Counter = attrs.field(factory=Counter)
    wire_by_axis: Counter = attrs.field(factory=Counter)
    events: list = attrs.field(factory=list)
    timeline: list = attrs.field(factory=list)

    def total(self) -> int:
        """Number of collectives of every kind."""
        return sum(self.counts.values())

    def __str__(self) -> str:
        rows = [
            f"{k:>14} {tuple(a)!s:<18} x{n:<5} {self.bytes_by_axis[(k, a)] / 1e6:10.3f} MB"
            for (k, a), n in sorted(self.by_axis.items())
        ]
        return "\n".join(["comm_log:"] + rows) if rows else "comm_log: no collectives"


# group_name -> mesh axes, filled by Mesh for every group it owns. Several meshes may share
# one group (every 1-D mesh over the whole world uses the default group), so fshard's own
# calls name their axes through _CALL_AXES and the registry is only a fallback (DTensor).
_GROUP_AXES: dict[str, tuple[str, ...]] = {}
_CALL_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("fshard_call_axes", default=None)
# The kind a lowered collective is logged as (a reduce-scatter run as an all-to-all).
_CALL_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("fshard_call_kind", default=None)
_REDUCE_KINDS = {op: kind.value for op, kind in REDUCE_KINDS.items()}  # c10d op name -> comm_log's kind


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
        kind = c10d_kind(func, args)
        if kind is None:
            return func(*args, **kwargs)
        x = args[0]
        axes = _CALL_AXES.get() or _GROUP_AXES.get(args[-1], (args[-1],))
        wire = _wire_bytes(kind, args, x.device.type)
        event = record(_CALL_KIND.get() or kind.value, axes, x.numel() * x.element_size(), wire=wire)
        out = func(*args, **kwargs)
        if event is not None and isinstance(out, torch.Tensor):
            self._issued[id(out)] = (weakref.ref(out), event)
        return out


def _wire_bytes(kind: CollectiveKind, args: tuple, device: str) -> int:
    """Bytes this rank sends for one functional collective (see the module docstring):
    ``fshard._wire.wire_bytes`` of its kind, but for an all-to-all's own split (it may be
    uneven) and gloo's reduce-scatter, which runs an all-reduce."""
    x, name = args[0], args[-1]
    nb = x.numel() * x.element_size()
    if kind is CollectiveKind.ALL_GATHER:
        return wire_bytes(kind, nb, args[1])
    group = _resolve_group(name)
    n = group.size()
    if kind is CollectiveKind.ALL_TO_ALL:
        splits = args[2]
        rows = x.shape[0] if x.dim() else 1
        mine = splits[group.rank()] if splits else rows // n
        return nb - nb * mine // max(rows, 1)
    if kind is CollectiveKind.PSUM_SCATTER and _is_gloo(group, device):
        kind = CollectiveKind.PSUM
    return wire_bytes(kind, nb, n)


def _resolve_group(name: str):
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(name))


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


def record(kind: str, axes: Sequence[str], nbytes: int, *, wire: int | None = None) -> Event | None:
    """Adds one collective to every active :class:`CommLog`.

    Args:
      nbytes: the rank's input payload.
      wire: the bytes the rank sends; ``None``: ``nbytes``.

    Returns:
      Its ``"issue"`` :class:`Event`, or ``None`` when no log is active.
    """
    logs = _LOGS.get()
    if not logs:
        return None
    axes = tuple(axes)
    wire = nbytes if wire is None else wire
    event = Event("issue", kind, axes, nbytes, wire=wire)
    for log in logs:
        log.counts[kind] += 1
        log.bytes[kind] += nbytes
        log.by_axis[(kind, axes)] += 1
        log.bytes_by_axis[(kind, axes)] += nbytes
        log.wire[kind] += wire
        log.wire_by_axis[(kind, axes)] += wire
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
def _named(axes: Sequence[str], kind: str | None = None):
    """Names the mesh axes (and, for a lowered collective, the kind) of the collective
    issued inside, for comm_log."""
    if not _LOGS.get():
        yield
        return
    token = _CALL_AXES.set(tuple(axes))
    ktoken = _CALL_KIND.set(kind)
    try:
        yield
    finally:
        _CALL_KIND.reset(ktoken)
        _CALL_AXES.reset(token)


def all_reduce_async(
    x: torch.Tensor, group, op: str = "sum", *, axes: Sequence[str] = (), inplace: bool = False
) -> Handle:
    """Starts an all-reduce of ``x`` over ``group``.

    ``inplace``: reduce into ``x`` itself (contiguous, owned by the caller, not read before
    ``wait()``) rather than into a new tensor: on CPU a fresh multi-MB buffer costs a page
    fault per 4 KiB page on first write, every step.
    """
    one_at_a_time(group)
    _contract.enter(group, _REDUCE_KINDS.get(op, op), x, axes, op=op)
    wire, back = _stage(group, x, into=x if inplace else None)
    with _named(axes):
        if inplace and back is None:
            return Handle(_F.all_reduce_(x, op, group.group_name), group=group)
        return Handle(_F.all_reduce(wire, op, group.group_name), back, group=group)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# One collective in flight per gloo process group (docs/reliability.md).
#
# gloo runs a group's collectives on two worker threads, so two collectives in flight on
# one group (an FSDP layer's reduce-scatter beside the next one's, or beside a prefetched
# all-gather) execute at the same time. With torch 2.13's gloo that corrupts the heap now
# and then: a rank dies of SIGSEGV or of glibc's "malloc(): unaligned tcache chunk
# detected", and a core dump shows a freed chunk overwritten with the vtable pointer of
# the control block of a gloo tcp::UnboundBuffer while both workers of the group were
# running all-reduces. fshard therefore starts a collective on a gloo group only after
# the previous one it started there has completed. Compute still overlaps communication
# (the worker thread runs beside the caller); what is given up is two collectives of one
# group running at once, which on one host share the same loopback anyway.
_LAST: dict[str, "Handle"] = {}
# Keyed by id, name and device type: a destroyed group's id may be reused by a new group,
# group names restart after destroy_process_group(), and a composite group
# ("cpu:gloo,cuda:nccl") uses gloo only for some devices.
_IS_GLOO: dict[tuple[int, str, str], bool] = {}


def _is_gloo(group, device_type: str) -> bool:
    key = (id(group), group.group_name, device_type)
    known = _IS_GLOO.get(key)
    if known is None:
        try:
            known = backend_of(group, device_type) == "gloo"
        except (RuntimeError, ValueError):  # not a registered group (e.g. destroyed): no claim, not cached
            return False
        _IS_GLOO[key] = known
    return known


_contract.is_gloo = _is_gloo


def forget_groups() -> None:
    """Drops the cached backend and the collective numbering of every group
    (``fs.shutdown()`` destroys the groups)."""
    _IS_GLOO.clear()
    _contract.forget_groups()


def one_at_a_time(group) -> None:
    """Waits for the collective fshard still has in flight on ``group`` (gloo groups only).

    Called before every collective fshard issues, so that at most one of them is in
    flight per gloo process group (see the note above). A no-op on other backends.
    """
    prev = _LAST.pop(group.group_name, None)
    if prev is not None and prev._group is group:
        prev._complete()


class Handle:
    """A collective in flight; ``wait()`` returns its result.

    On a gloo group it is the group's only collective in flight: the next one fshard
    starts there completes it first (``wait()`` then returns at once).
    """

    __slots__ = ("_tensor", "_post", "_group", "_done")

    def __init__(self, tensor: torch.Tensor, post=None, group=None) -> None:
        self._tensor, self._post, self._group, self._done = tensor, post, group, False
        if group is not None and _is_gloo(group, tensor.device.type):
            _LAST[group.group_name] = self

    @classmethod
    def done(cls, tensor: torch.Tensor) -> "Handle":
        """A handle of a result that needs no communication (``wait()`` returns ``tensor``)."""
        handle = cls(tensor)
        handle._done = True
        return handle

    def _complete(self) -> None:
        if not self._done:
            try:
                self._tensor = _F.wait_tensor(self._tensor)
            except RuntimeError as e:  # a timeout: say which collective each rank is in
                _contract.explain_timeout(e, self._group)
                raise
            _contract.done()
            self._done = True
            # Done: a handle the program keeps must not keep its group (and gloo's worker
            # threads) alive into the interpreter's finalization (fshard.runtime.teardown).
            self._group = None

    def wait(self) -> torch.Tensor:
        group = self._group
        self._complete()
        if group is not None and _LAST.get(group.group_name) is self:
            del _LAST[group.group_name]
        return self._post(self._tensor) if self._post is not None else self._tensor


def complete_in_flight() -> list[BaseException]:
    """Completes the collective fshard has in flight on each gloo group (``fs.shutdown``).

    Returns:
      The errors of those that failed (a peer gone), after trying every one.
    """
    pending = list(_LAST.values())
    _LAST.clear()
    errors: list[BaseException] = []
    for handle in pending:
        try:
            handle._complete()
        except Exception as e:  # noqa: BLE001 - reported by the caller, after the others
            errors.append(e)
            handle._group = None
    return errors


def all_reduce(x: torch.Tensor, group, op: str, *, axes: Sequence[str]) -> torch.Tensor:
    """All-reduce (``op`` in sum/max/min/avg) of ``x`` over ``group``; a new tensor."""
    return all_reduce_async(x, group, op, axes=axes).wait()


def all_gather_async(x: torch.Tensor, group, n: int, *, axes: Sequence[str] = ()) -> Handle:
    """Starts an all-gather along dim 0 (result ``(n * x.shape[0], ...)``, group rank order)."""
    one_at_a_time(group)
    _contract.enter(group, "all_gather", x, axes, n=n)
    wire, back = _stage(group, x)
    with _named(axes):
        return Handle(_F.all_gather_into_tensor(wire, n, group.group_name), back, group=group)


def all_gather(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """All-gather along dim 0; see :func:`all_gather_async`."""
    return all_gather_async(x, group, n, axes=axes).wait()


def reduce_scatter_async(x: torch.Tensor, group, n: int, op: str = "sum", *, axes: Sequence[str] = ()) -> Handle:
    """Starts a reduce-scatter along dim 0 (``x.shape[0]`` divisible by ``n``).

    On gloo it runs as ``all_to_all_single`` (chunk j to group rank j) and the received
    chunks are reduced locally in ``wait()``: gloo's own ``reduce_scatter_tensor`` is an
    all-reduce plus a slice, twice the bytes on the wire (and it ignores ``op``).
    Other backends use their reduce-scatter; ``fs.simulate``'s (``"fake"``) takes gloo's
    path, so that the simulated ranks add the chunks in the order gloo ranks do.
    """
    one_at_a_time(group)
    _contract.enter(group, "psum_scatter", x, axes, op=op, n=n)
    if n > 1 and backend_of(group, x.device.type) in ("gloo", "fake"):
        rows = [x.shape[0] // n] * n
        wire, back = _stage(group, x)
        with _named(axes, "psum_scatter"):
            received = _F.all_to_all_single(wire, rows, rows, group.group_name)
        # Staged: reduced on the host before the copy back, so 1/n of the bytes cross to the device.
        post = _LocalReduce(n, op)
        return Handle(received, _restaged(x, post, back), group=group)
    with _named(axes):
        return Handle(_F.reduce_scatter_tensor(x.contiguous(), op, n, group.group_name), group=group)


class _LocalReduce:
    """Reduces the ``n`` chunks an all-to-all received (group rank order) into one."""

    __slots__ = ("n", "op")

    def __init__(self, n: int, op: str) -> None:
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"fs.comm.reduce_scatter: op={op!r}; use sum, avg, max or min.")
        self.n, self.op = n, op

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        chunks = received.view(self.n, received.shape[0] // self.n, *received.shape[1:])
        if self.op == "max":
            return chunks.amax(0)
        if self.op == "min":
            return chunks.amin(0)
        out = chunks.sum(0, dtype=chunks.dtype)  # torch's sum widens integers to int64; a reduce-scatter does not
        return out.div_(self.n) if self.op == "avg" else out


def reduce_scatter(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """Sum reduce-scatter along dim 0; see :func:`reduce_scatter_async`."""
    return reduce_scatter_async(x, group, n, axes=axes).wait()


def all_to_all(x: torch.Tensor, group, n: int, *, axes: Sequence[str]) -> torch.Tensor:
    """Splits dim 0 into ``n`` chunks, sends chunk j to group rank j, concatenates received chunks."""
    split = [x.shape[0] // n] * n
    one_at_a_time(group)
    _contract.enter(group, "all_to_all", x, axes, n=n)
    wire, back = _stage(group, x)
    with _named(axes):
        return Handle(_F.all_to_all_single(wire, split, split, group.group_name), back, group=group).wait()


def all_to_all_v(
    x: torch.Tensor,
    group,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    *,
    axes: Sequence[str],
    kind: str = "ragged_all_to_all",
) -> torch.Tensor:
    """Rows ``x[sum(send_splits[:j]):][:send_splits[j]]`` go to group rank ``j``; the rows
    from every rank come back concatenated in group-rank order (``sum(recv_splits)`` rows).

    The split sizes are this rank's host ints (per rank under ``fs.simulate``). The row
    count differs per rank, so the contract's header is ``x[:0]`` (dtype and row shape).
    Logged as ``kind``.
    """
    one_at_a_time(group)
    _contract.enter(group, kind, x[:0], axes, n=group.size())
    wire, back = _stage(group, x)
    with _named(axes, kind):
        return Handle(
            _F.all_to_all_single(wire, list(recv_splits), list(send_splits), group.group_name), back, group=group
        ).wait()


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


def via_host(group, device: torch.device) -> bool:
    """True when collectives and transfers of ``device`` tensors over ``group`` are
    staged through host memory: a non-CPU device on a group that uses gloo for it.

    That is the case of several ranks sharing one GPU through gloo (NCCL refuses two
    ranks on one device). gloo's ``send``/``recv`` hand the tensor's data pointer straight
    to the TCP transport, which would read device memory as host memory. Its collectives
    on CUDA tensors (``all_gather_into_tensor`` and DTensor's ``full_tensor`` over it) die
    of SIGSEGV in ``wait_tensor`` (bench/gpu_checks/README.md). Staging costs what gloo's
    own CUDA path does: one copy to the host and one back.
    """
    return device.type != "cpu" and backend_of(group, device.type) == "gloo"


class _Staged:
    """Applies ``post`` to a host-staged (or widened) result, then moves it back to
    ``device`` and ``dtype`` (into ``into`` when given: the in-place all-reduce)."""

    __slots__ = ("device", "post", "into", "dtype")

    def __init__(
        self, device: torch.device, post=None, into: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> None:
        self.device, self.post, self.into, self.dtype = device, post, into, dtype

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.post is not None:
            t = self.post(t)
        return self.into.copy_(t) if self.into is not None else t.to(self.device, self.dtype)


# Dtypes gloo has no kernels for ("Invalid scalar type"), sent as a wider one: exact for
# data movement, and for sums (modular arithmetic), max and min once narrowed back.
_GLOO_WIDEN = {torch.int16: torch.int32}


def _stage(group, x: torch.Tensor, into: torch.Tensor | None = None):
    """``(tensor to hand to the collective, post-processing or None)`` for ``x`` (contiguous)."""
    wire = x.contiguous()
    host = via_host(group, x.device)
    if host:
        wire = wire.cpu()
    widen = wire.dtype in _GLOO_WIDEN and _is_gloo(group, wire.device.type)
    if widen:
        wire = wire.to(_GLOO_WIDEN[wire.dtype])
    if not (host or widen):
        return wire, None
    return wire, _Staged(x.device, into=into, dtype=x.dtype)


def _restaged(x: torch.Tensor, post, back):
    """``post`` run on the staged result, then back to ``x``'s device and dtype (if staged)."""
    return post if back is None else _Staged(x.device, post, dtype=x.dtype)


def permute(x: torch.Tensor, group, sends: Sequence[tuple[int, int]], me: int, *, axes: Sequence[str]) -> torch.Tensor:
    """Point-to-point exchange: for each ``(src, dst)`` group ranks, src's ``x`` goes to dst.

    Ranks that receive nothing get zeros (as ``jax.lax.ppermute``). The result is on
    ``x``'s device; transfers a backend cannot make from that device go through host
    memory (:func:`via_host`). See :func:`permute_async`.
    """
    return permute_async(x, group, sends, me, axes=axes).wait()


def permute_async(x: torch.Tensor, group, sends: Sequence[tuple[int, int]], me: int, *, axes: Sequence[str]) -> Handle:
    """Starts the exchange of :func:`permute`; every rank of ``group`` must call it.

    It runs as one functional ``all_to_all_single`` over ``x`` flattened to 1-D, with
    per-peer split sizes: this rank's whole ``x`` to its destination and zero elements to
    every other rank; ``x.numel()`` elements from its source and zero from the others (a
    rank that sends nothing passes an empty input, one that receives nothing gets zeros).
    Being a functional collective, it can be captured by ``fs.jit``: the split sizes are
    Python ints of this rank, baked into its graph (each rank's graph differs in them).
    A pair ``(me, me)`` is a copy, and a perm without a pair between two ranks issues no
    collective. Either way the exchange is logged as one ``"ppermute"`` whose bytes (and
    bytes on the wire) are those this rank sends to another rank.

    Eager runs it too, not only ``fs.jit``: on gloo it takes at most the time of a
    ``batch_isend_irecv`` exchange (``bench/README.md``, "Host costs behind the code").

    Args:
      x: the tensor (same shape and dtype on every rank).
      sends: ``(src, dst)`` group ranks; sources unique, destinations unique.
      me: this rank's group rank.

    Returns:
      A :class:`Handle` whose ``wait()`` gives the received tensor (``x``'s shape, dtype and
      device), zeros if nothing is received.

    Raises:
      ValueError: a repeated source or destination.
    """
    srcs, dsts = [s for s, _ in sends], [d for _, d in sends]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"fs.comm.permute over {tuple(axes)}: sends={list(sends)} must have unique sources and "
            f"unique destinations (a permutation)."
        )
    x = x.contiguous()
    n, numel = group.size(), x.numel()
    # This rank's part, from its group rank: per rank under fs.simulate, where ``me`` differs.
    keep = simulation.per_rank(_keep_code)(sends, me)
    post = _Received(x, keep)
    if all(s == d for s, d in sends):  # every rank knows it: nobody issues the collective
        record("ppermute", axes, 0, wire=0)
        return Handle.done(post(x))
    send_to = simulation.per_rank(_split_sizes)(sends, me, n, numel, True)
    recv_from = simulation.per_rank(_split_sizes)(sends, me, n, numel, False)
    one_at_a_time(group)
    _contract.enter(group, "ppermute", x, axes, extra=tuple(v for pair in sends for v in pair))
    wire, back = _stage(group, simulation.per_rank(_sent)(x.view(-1), sends, me))
    with _named(axes, "ppermute"):
        received = _F.all_to_all_single(wire, recv_from, send_to, group.group_name)
    return Handle(received, _restaged(x, post, back), group=group)


_RECV, _COPY, _ZEROS = 0, 1, 2


def _keep_code(sends: Sequence[tuple[int, int]], me: int) -> int:
    """What group rank ``me`` of a permute keeps: the elements it receives (``_RECV``), a copy
    of its own (``_COPY``: a pair ``(me, me)``), or zeros (``_ZEROS``: nothing received)."""
    if any(s == me == d for s, d in sends):
        return _COPY
    return _RECV if any(d == me for _, d in sends) else _ZEROS


def _split_sizes(sends: Sequence[tuple[int, int]], me: int, n: int, numel: int, sending: bool) -> list[int]:
    """``me``'s split sizes for the permute's all-to-all: ``numel`` elements to its destination
    (``sending``) or from its source, 0 for every other group rank and for a pair ``(me, me)``."""
    peer = next((d for s, d in sends if s == me) if sending else (s for s, d in sends if d == me), None)
    return [numel if r == peer != me else 0 for r in range(n)]


def _sent(flat: torch.Tensor, sends: Sequence[tuple[int, int]], me: int) -> torch.Tensor:
    """What ``me`` hands the all-to-all: all of ``flat`` if it sends to another rank, else nothing."""
    dst = next((d for s, d in sends if s == me), None)
    return flat if dst not in (None, me) else flat[:0]


class _Received:
    """What a rank of :func:`permute_async` keeps (``keep``, see :func:`_keep_code`)."""

    __slots__ = ("x", "keep")

    def __init__(self, x: torch.Tensor, keep: int) -> None:
        self.x, self.keep = x, keep

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        return simulation.per_rank(_kept)(received, self.x, self.keep)


def _kept(received: torch.Tensor, x: torch.Tensor, keep: int) -> torch.Tensor:
    if keep == _RECV:
        return received.view(x.shape)
    return x.clone() if keep == _COPY else torch.zeros_like(x)


def _drain() -> None:
    errors = complete_in_flight()
    if errors:
        raise RuntimeError(
            f"fs.shutdown(): {len(errors)} collective(s) in flight failed; the first: {errors[0]}"
        ) from errors[0]


def _detach_after_fork() -> tuple[dict, dict]:
    kept = dict(_LAST), dict(_IS_GLOO)
    _LAST.clear()
    forget_groups()
    return kept


teardown.register_group_owner(
    teardown.GroupOwner("fshard.comm", forget=forget_groups, drain=_drain, after_fork=_detach_after_fork)
)

"""Parameter groups: gather a group's shards in one flat collective, reduce its grads in one.

This is the engine under :func:`fshard.parallel.scan_layers` and
:func:`fshard.parallel.gather_params`, used inside a shard_map body on local shards.
One *group* (a layer, or the embeddings and head) is moved as one flat buffer:

forward  : cast shards to ``param_dtype`` -> pad each to ``ceil(N / n)`` rows -> one
           all-gather over the shard axis -> full parameters (views of no one else)
backward : full grads -> ``reduce_dtype`` -> pad -> one reduce-scatter over the shard
           axis (sum) -> one all-reduce over the replicate axis (HSDP/DDP) -> shards

The transpose is the one ``fs.lax.all_gather`` has (psum_scatter), just flattened over
many tensors and padded for uneven shards (``torch.chunk`` layout, as FSDP2 and DTensor).
With no shard axis the forward is the identity and backward only all-reduces
(replicate / DDP).

Overlap: the reduction of a group starts as soon as its gradients exist and is waited
only at the end of backward. Autograd runs the node with the highest sequence number
first, so a :class:`_Sink` made before any group is used runs last: each group's
backward starts its reduction and leaves the result with the sink, which hands every
shard its gradient at the end.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from fshard import comm, lax
from fshard.transforms.policy import Policy
from fshard.transforms.shard_map import global_shape, input_spec

__all__ = ["GroupLayout", "Groups"]


@attrs.frozen
class GroupLayout:
    """Static layout of one group's flat buffer on this rank.

    Attributes:
      shapes: global shape per leaf.
      dims: the sharded dim per leaf.
      rows: padded rows per rank per leaf (``ceil(N / n)``), along the sharded dim.
      row_numel: elements per row (product of the other dims).
      local_rows: rows this rank holds (may be fewer, even zero, for uneven shards).
    """

    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    rows: tuple[int, ...]
    row_numel: tuple[int, ...]
    local_rows: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(r * e for r, e in zip(self.rows, self.row_numel))


def gathered_shape(x: torch.Tensor, shard_axes: tuple[str, ...], mesh) -> tuple[int, ...] | None:
    """The shape of ``x`` once gathered over ``shard_axes`` only (other axes stay split).

    With no ``shard_axes`` (replicate), that is ``x``'s local shape under the other axes
    (e.g. a tensor-parallel shard).

    Raises:
      ValueError: a dim splits over the shard axes and then over another axis: the
        gathered rows would not be one block (put the FSDP axis last on that dim).
    """
    shape, spec = global_shape(x), input_spec(x)
    if shape is None:
        return None
    if spec is None:
        return tuple(shape)
    out, coord = list(shape), mesh.coordinate()
    for d in range(len(spec)):
        # Size-1 axes split nothing, so their place in the order does not matter (and
        # DTensor placements do not keep it).
        axes = tuple(a for a in spec.dim_axes(d) if mesh.shape[a] > 1)
        others = [a for a in axes if a not in shard_axes]
        if tuple(axes[:len(others)]) != tuple(others):  # the gathered axes are not the minor ones
            raise ValueError(
                f"fs.parallel: dim {d} of a parameter with spec {spec} splits over {axes}; the "
                f"gathered axes {shard_axes} must come last (minor) on that dim, e.g. "
                f"P(({', '.join(repr(a) for a in others + list(shard_axes))},))."
            )
        for a in others:  # this rank's torch.chunk block, major to minor (as fs.shard cuts it)
            c = -(-out[d] // mesh.shape[a])
            lo = min(coord[a] * c, out[d])
            out[d] = min(lo + c, out[d]) - lo
    return tuple(out)


def _layout(leaves: Sequence[torch.Tensor], n: int, dims: Sequence[int], shard_axes=(), mesh=None) -> GroupLayout:
    shapes, rows, numel, local_rows = [], [], [], []
    for x, d in zip(leaves, dims):
        shape = gathered_shape(x, shard_axes, mesh) if mesh is not None else global_shape(x)
        if shape is None and n == 1:
            shape = tuple(x.shape)
        if shape is None:
            raise ValueError(
                "fs.parallel: a group leaf is not a shard_map input, so its global shape is "
                "unknown; pass parameters into the shard_map body as DTensors (fs.shard)."
            )
        shapes.append(tuple(shape))
        rows.append(-(-shape[d] // n) if shape else 1)
        numel.append(int(torch.Size(shape[:d] + shape[d + 1:]).numel()) if shape else 1)
        local_rows.append(x.shape[d] if x.dim() else 1)
    return GroupLayout(tuple(shapes), tuple(dims), tuple(rows), tuple(numel), tuple(local_rows))


def _flatten(leaves: Sequence[torch.Tensor], lay: GroupLayout, dtype: torch.dtype | None) -> torch.Tensor:
    parts = []
    for x, d, r in zip(leaves, lay.dims, lay.rows):
        x = x.detach()
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        x = x.movedim(d, 0) if x.dim() else x.reshape(1)
        if x.shape[0] < r:  # uneven shard: pad to the common row count
            x = torch.cat([x, x.new_zeros(r - x.shape[0], *x.shape[1:])])
        parts.append(x.reshape(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _unflatten_full(out: torch.Tensor, n: int, lay: GroupLayout) -> list[torch.Tensor]:
    """``out``: (n * F,) gathered buffer -> full tensors (global shapes)."""
    out = out.view(n, -1)
    fulls, off = [], 0
    for shape, d, r, e, size in zip(lay.shapes, lay.dims, lay.rows, lay.row_numel, lay.sizes):
        moved = (shape[d],) + shape[:d] + shape[d + 1:] if shape else (1,)
        block = out[:, off:off + size].reshape(n * r, *moved[1:])[: moved[0]]
        full = block.movedim(0, d) if shape else block.reshape(())
        fulls.append(full.contiguous() if not full.is_contiguous() else full)
        off += size
    return fulls


def _grad_parts(grads: Sequence[torch.Tensor | None], n: int, lay: GroupLayout,
                dtype: torch.dtype) -> list[torch.Tensor]:
    """Full grads -> per-leaf (n, rows * row_numel) blocks, padded, in ``dtype``."""
    parts = []
    for g, shape, d, r, e in zip(grads, lay.shapes, lay.dims, lay.rows, lay.row_numel):
        if g is None:
            parts.append(torch.zeros(n, r * e, dtype=dtype))
            continue
        g = g.to(dtype)
        g = g.movedim(d, 0) if g.dim() else g.reshape(1)
        if g.shape[0] < n * r:
            g = torch.cat([g, g.new_zeros(n * r - g.shape[0], *g.shape[1:])])
        parts.append(g.reshape(n, r * e))
    return parts


def _flatten_grads(grads: Sequence[torch.Tensor | None], n: int, lay: GroupLayout,
                   dtype: torch.dtype) -> torch.Tensor:
    """Full grads -> (n * F,) in rank-major order, padded, ready for reduce-scatter."""
    parts = _grad_parts(grads, n, lay, dtype)
    return torch.cat(parts, dim=1).reshape(-1) if len(parts) > 1 else parts[0].reshape(-1)


def _unflatten_shards(flat: torch.Tensor, lay: GroupLayout, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for x, d, r, e, size, lr in zip(like, lay.dims, lay.rows, lay.row_numel, lay.sizes, lay.local_rows):
        moved_shape = (x.shape[d],) + tuple(x.shape[:d]) + tuple(x.shape[d + 1:]) if x.dim() else (1,)
        g = flat[off:off + size].view(r, *moved_shape[1:])[:lr]
        g = g.movedim(0, d) if x.dim() else g.reshape(())
        out.append(g.to(x.dtype).contiguous())
        off += size
    return out


def _claim(owners: dict, groups: list[list[torch.Tensor]]) -> None:
    """Records which group owns each leaf; a leaf may not belong to two different groups.

    Using one group twice (a layer applied twice) is fine: its gradients add up. Putting a
    leaf in two groups would reduce its gradient twice and gather it twice per use.
    """
    for g, leaves in enumerate(groups):
        members = frozenset(id(x) for x in leaves)
        for k, x in enumerate(leaves):
            # The record keeps the leaf alive: a freed tensor's id could otherwise be reused
            # by a later microbatch's leaf and look like a second claim.
            prev, _ = owners.setdefault(id(x), (members, x))
            if prev != members:
                raise ValueError(
                    f"fs.parallel: leaf {k} of group {g} (shape {tuple(x.shape)}) is already managed by "
                    f"another parameter group. A tied parameter must live in one group: gather it "
                    f"once (e.g. tied embedding and output both in the root group) and use it twice."
                )


@attrs.define
class Groups:
    """Per-call state: layouts, in-flight gathers, pending reductions, regather cache.

    Args:
      groups: list of lists of local leaves (one list per group).
      shard_axes: mesh axes the leaves are sharded over (FSDP); ``()`` for DDP.
      replicate_axes: mesh axes gradients are all-reduced over (DDP/HSDP); ``()`` for FSDP.
      dims: per group, the sharded dim of each leaf.
      policy: mixed precision.
    """

    groups: list[list[torch.Tensor]]
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    dims: list[list[int]]
    policy: Policy
    bucket_bytes: int = 25 * 2**20
    accumulator: Any = None
    sync: bool | str = True
    layouts: list[GroupLayout] = attrs.field(init=False)
    n: int = attrs.field(init=False)
    _sgroup: Any = attrs.field(init=False)
    _rgroup: Any = attrs.field(init=False)
    _rn: int = attrs.field(init=False)
    _inflight: dict[int, comm.Handle] = attrs.field(init=False, factory=dict)
    _pending: dict[int, tuple[Any, comm.Handle | None, comm.Handle | None]] = attrs.field(init=False, factory=dict)
    _cache: dict[int, list[torch.Tensor]] = attrs.field(init=False, factory=dict)
    _bucket: list[tuple[int, list[torch.Tensor]]] = attrs.field(init=False, factory=list)
    sunk: list[list[torch.Tensor]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        body = lax.BODY.get()
        if body is None:
            raise RuntimeError("fs.parallel layer loops run inside a shard_map body (they issue collectives).")
        if self.sync not in (True, False, "reduce_scatter"):
            raise ValueError(f"fs.parallel: sync={self.sync!r}; use True, False or 'reduce_scatter'.")
        mesh = body.mesh
        self.n = mesh.axis_size(self.shard_axes) if self.shard_axes else 1
        self._rn = mesh.axis_size(self.replicate_axes) if self.replicate_axes else 1
        self._sgroup = mesh.group(self.shard_axes) if self.n > 1 else None
        self._rgroup = mesh.group(self.replicate_axes) if self._rn > 1 else None
        self.layouts = [_layout(g, self.n, d, self.shard_axes, mesh) for g, d in zip(self.groups, self.dims)]
        _claim(body.owners, self.groups)


    # --- forward --------------------------------------------------------------------
    def start_gather(self, i: int) -> None:
        """Starts group ``i``'s all-gather unless it is in flight or not needed."""
        if self.n == 1 or i in self._inflight or not 0 <= i < len(self.groups):
            return
        flat = _flatten(self.groups[i], self.layouts[i], self.policy.param_dtype)
        self._inflight[i] = comm.all_gather_async(flat, self._sgroup, self.n, axes=self.shard_axes)

    def gathered(self, i: int) -> list[torch.Tensor]:
        """Group ``i``'s full parameters (waits for, or issues, its all-gather)."""
        if self.n == 1:
            dt = self.policy.param_dtype
            return [x.detach().to(dt) if dt is not None and x.is_floating_point() else x.detach()
                    for x in self.groups[i]]
        self.start_gather(i)
        return _unflatten_full(self._inflight.pop(i).wait(), self.n, self.layouts[i])

    # --- backward: regather for saved tensors -----------------------------------------
    def regathered(self, i: int, prefetch: Sequence[int] = ()) -> list[torch.Tensor]:
        full = self._cache.get(i)
        if full is None:
            self.start_gather(i)  # this layer's own gather first, then the prefetch behind it
            for j in prefetch:
                self.start_gather(j)
            full = self._cache[i] = self.gathered(i)
        return full

    def drop(self, i: int) -> None:
        """Ends group ``i``'s backward: frees its regathered parameters.

        A backward prefetch for ``i`` that no saved tensor asked for (a layer whose
        backward needs no parameter, e.g. the first one when its input needs no grad) is
        waited here, so that no collective is left in flight.
        """
        self._cache.pop(i, None)
        stale = self._inflight.pop(i, None)
        if stale is not None:
            stale.wait()

    def finish(self) -> None:
        """Waits for any gather still in flight (end of backward)."""
        for i in list(self._inflight):
            self._inflight.pop(i).wait()

    # --- backward: reductions ---------------------------------------------------------------
    def reduce(self, i: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Starts group ``i``'s gradient reduction; the sink collects it at the end."""
        lay = self.layouts[i]
        dtype = self.policy.grad_reduce_dtype or next(
            (g.dtype for g in grads if g is not None), self.groups[i][0].dtype)
        if self.n == 1 and self._rn > 1 and self.accumulator is None:
            # DDP: gradients of consecutive groups share one all-reduce (a bucket), launched
            # when it is full or when the first group (the last in backward) is done; the
            # bucket is built with one copy of every gradient.
            parts = [p.reshape(-1) for p in _grad_parts(grads, 1, lay, dtype)]
            self._bucket.append((i, parts))
            if sum(p.numel() * p.element_size() for _, ps in self._bucket for p in ps) >= self.bucket_bytes or i == 0:
                self._flush()
            return
        flat = _flatten_grads(grads, self.n, lay, dtype)
        if self.accumulator is not None and self.sync != "reduce_scatter":
            key = self._key(i)
            if not self.sync:
                self.accumulator.add(key, flat)  # no reduction: this call's shard grads are zeros
                return
            prev = self.accumulator.take(key)
            if prev is not None:
                flat = flat + prev
        rs = comm.reduce_scatter_async(flat, self._sgroup, self.n, axes=self.shard_axes) if self.n > 1 else None
        if rs is None and self._rn > 1:  # DDP with accumulation: one group per all-reduce
            self._bucket.append((i, [flat]))
            self._flush()
            return
        self._pending[i] = (flat, rs, None)

    def _key(self, i: int) -> tuple:
        return (self.layouts[i].shapes, i, self.groups[i][0].untyped_storage().data_ptr())

    def _flush(self) -> None:
        if not self._bucket:
            return
        parts = [p for _, ps in self._bucket for p in ps]
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        handle = _Shared(comm.all_reduce_async(buf, self._rgroup, axes=self.replicate_axes))
        off = 0
        for i, ps in self._bucket:
            numel = sum(p.numel() for p in ps)
            self._pending[i] = (None, None, (handle, off, numel))
            off += numel
        self._bucket = []

    def collect(self, i: int) -> list[torch.Tensor | None]:
        """Waits for group ``i``'s reduction and returns its shard gradients."""
        if i not in self._pending and any(j == i for j, _ in self._bucket):
            self._flush()  # a bucket left open (backward stopped before group 0)
        entry = self._pending.pop(i, None)
        if entry is None:
            return [None] * len(self.groups[i])
        flat, rs, ar = entry
        if rs is not None:
            flat = rs.wait()
            if self.accumulator is not None:
                key = ("reduce_scattered",) + self._key(i)
                if self.sync == "reduce_scatter":  # HSDP: keep the shard-reduced grads, skip the all-reduce
                    self.accumulator.add(key, flat)
                    return [None] * len(self.groups[i])
                prev = self.accumulator.take(key)
                if prev is not None:
                    flat = flat + prev
            if self._rn > 1:  # HSDP: reduce-scatter over the shard axis, then all-reduce over replicas
                flat = comm.all_reduce(flat, self._rgroup, "sum", axes=self.replicate_axes)
        elif ar is not None:
            shared, off, numel = ar
            flat = shared.result()[off:off + numel]
        return _unflatten_shards(flat, self.layouts[i], self.groups[i])


class _Shared:
    """One bucket's all-reduce, waited once and shared by its groups."""

    __slots__ = ("_handle", "_out")

    def __init__(self, handle: comm.Handle) -> None:
        self._handle, self._out = handle, None

    def result(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._handle.wait()
        return self._out


class Sink(torch.autograd.Function):
    """Identity on every leaf; in backward hands each leaf its reduced gradient (runs last)."""

    @staticmethod
    def forward(state: Groups, *leaves: torch.Tensor):
        return tuple(x.view_as(x) for x in leaves)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *unused):
        state: Groups = ctx.state
        state.finish()
        out: list[torch.Tensor | None] = [None]
        for i in range(len(state.groups)):
            out.extend(state.collect(i))
        return tuple(out)


class Gather(torch.autograd.Function):
    """Group ``i``'s shards -> its full parameters; backward starts the reduction."""

    @staticmethod
    def forward(state: Groups, i: int, *leaves: torch.Tensor):
        return tuple(state.gathered(i))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.i = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.reduce(ctx.i, grads)
        ctx.state.drop(ctx.i)
        return (None, None) + (None,) * len(grads)

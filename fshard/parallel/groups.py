"""Parameter groups: gather a group's shards in one flat collective, reduce its grads in one.

This is the engine under :func:`fshard.parallel.scan_layers` and
:func:`fshard.parallel.gather_params`, used inside a shard_map body on local shards.
One *group* (a layer, or the embeddings and head) is moved as one flat buffer:

forward  : cast shards to ``param_dtype`` -> pad each to ``ceil(N / n)`` rows -> one
           all-gather over the shard axis -> full parameters (views of no one else)
backward : full grads -> ``reduce_dtype`` -> pad -> one reduce-scatter over the shard
           axis (sum) -> one all-reduce over the replicate axis (HSDP/DDP) -> shards

The transpose is the one ``fs.lax.all_gather`` has (psum_scatter), just flattened over
many tensors and padded for uneven shards (``torch.chunk`` layout, as FSDP2 and DTensor;
over several axes, the blocks ``fs.shard`` cuts per axis: see :attr:`GroupLayout.spans`).
With no shard axis the forward is the identity and backward only all-reduces
(replicate / DDP).

Partial reshard (``post_axes``, FSDP2's ``reshard_after_forward=k``): after a group's
forward gather, each rank keeps a copy of its ``1/k`` slice of the gathered flat buffer,
``k`` the size of ``post_axes`` (a sub-group of the shard axes, e.g. the intra-node
axis); backward rebuilds the buffer with one all-gather over ``post_axes`` only.

Offload (``offload=True``): shards live on the CPU. Each group's flat shard buffer is
built on the host (pinned when the compute device is CUDA) and copied to the compute
device without blocking right before its all-gather, so a prefetched gather prefetches
the copy too; reduced shard gradients are copied back to the host at the end of
backward, with one synchronization for all groups.

Overlap: the reduction of a group starts as soon as its gradients exist and is waited
only at the end of backward. Autograd runs the node with the highest sequence number
first, so a :class:`_Sink` made before any group is used runs last: each group's
backward starts its reduction and leaves the result with the sink, which hands every
shard its gradient at the end.
"""

from __future__ import annotations

import functools
import itertools
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
      spans: per leaf, ``None`` when rank ``g`` of the gather holds rows
        ``[g * rows, (g + 1) * rows)`` (one ``torch.chunk``, the usual case), else the
        ``(first row, row count)`` each rank of the gather holds, in the gather's rank
        order: an uneven dim cut over several axes is cut once per axis (nested
        ``torch.chunk``: 33 rows over 2 x 2 is 9, 8, 8, 8, not 9, 9, 9, 6), and a spec
        whose axes are not in mesh order puts the blocks in another order.
    """

    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    rows: tuple[int, ...]
    row_numel: tuple[int, ...]
    local_rows: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int], ...] | None, ...] = ()

    def span(self, k: int) -> tuple[tuple[int, int], ...] | None:
        return self.spans[k] if self.spans else None

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


def _spans(x: torch.Tensor, d: int, length: int, shard_axes: tuple[str, ...], mesh) -> tuple[tuple[int, int], ...] | None:
    """The rows of dim ``d`` each rank of the gather over ``shard_axes`` holds (see
    :attr:`GroupLayout.spans`); ``None`` when that is the plain ``torch.chunk`` layout."""
    spec = input_spec(x)
    # Size-1 axes cut nothing (and DTensor placements may drop them from the spec).
    cutting = {a for a in shard_axes if mesh is not None and mesh.shape[a] > 1}
    if spec is None or len(cutting) < 2 or d >= len(spec):
        return None  # one cutting axis: always the plain torch.chunk layout
    split = [a for a in spec.dim_axes(d) if a in cutting]  # major to minor, as fs.shard cuts
    if set(split) != cutting:
        return None
    order = mesh.sub_axes_in_mesh_order(shard_axes)  # the gather's rank order (mesh.group)
    spans = []
    for coords in itertools.product(*(range(mesh.shape[a]) for a in order)):
        at = dict(zip(order, coords))
        lo, size = 0, length
        for a in split:  # this rank's torch.chunk block of the block above it
            c = -(-size // mesh.shape[a])
            start = min(at[a] * c, size)
            lo, size = lo + start, min(start + c, size) - start
        spans.append((lo, size))
    r = max(size for _, size in spans)
    if all(lo == g * r and size == max(0, min(r, length - g * r)) for g, (lo, size) in enumerate(spans)):
        return None
    return tuple(spans)


def _layout(leaves: Sequence[torch.Tensor], n: int, dims: Sequence[int], shard_axes=(), mesh=None) -> GroupLayout:
    shapes, rows, numel, local_rows, spans = [], [], [], [], []
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
        span = _spans(x, d, shape[d], tuple(shard_axes), mesh) if shape and n > 1 else None
        spans.append(span)
        rows.append(max(size for _, size in span) if span else -(-shape[d] // n) if shape else 1)
        numel.append(int(torch.Size(shape[:d] + shape[d + 1:]).numel()) if shape else 1)
        local_rows.append(x.shape[d] if x.dim() else 1)
    return GroupLayout(tuple(shapes), tuple(dims), tuple(rows), tuple(numel), tuple(local_rows), tuple(spans))


def _flatten(leaves: Sequence[torch.Tensor], lay: GroupLayout, dtype: torch.dtype | None,
             pin: bool = False) -> torch.Tensor:
    """Local shards -> one flat buffer (cast, padded to ``lay.rows``); pinned if ``pin``."""
    parts = []
    for x, d, r in zip(leaves, lay.dims, lay.rows):
        x = x.detach()
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        x = x.movedim(d, 0) if x.dim() else x.reshape(1)
        if x.shape[0] < r:  # uneven shard: pad to the common row count
            x = torch.cat([x, x.new_zeros(r - x.shape[0], *x.shape[1:])])
        parts.append(x.reshape(-1))
    if pin:
        # Built straight into page-locked memory: only a copy from pinned memory to the GPU
        # is asynchronous; from pageable memory the host would stall on a staging copy.
        out_dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
        out = torch.empty(sum(p.numel() for p in parts), dtype=out_dtype, pin_memory=True)
        return torch.cat(parts, out=out) if len(parts) > 1 else out.copy_(parts[0])
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _to_compute(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An offloaded flat buffer -> the compute device (returned as is when already there).

    ``non_blocking``: from pinned memory the copy is queued on the current stream and the
    host moves on; the all-gather issued next on that stream is ordered after it.
    """
    if flat.device == device:
        return flat
    return flat.to(device, non_blocking=True)


def _to_host(flat: torch.Tensor) -> torch.Tensor:
    """A reduced gradient buffer -> the CPU (pinned; the caller synchronizes before use).

    The copy is queued without blocking so that every group's copy is in flight at once;
    :meth:`Groups.collect_all` waits once for all of them before the host reads any.
    """
    if flat.device.type == "cpu":
        return flat
    out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
    return out.copy_(flat, non_blocking=True)


def _unflatten_full(out: torch.Tensor, n: int, lay: GroupLayout) -> list[torch.Tensor]:
    """``out``: (n * F,) gathered buffer -> full tensors (global shapes)."""
    out = out.view(n, -1)
    fulls, off = [], 0
    for k, (shape, d, r, e, size) in enumerate(zip(lay.shapes, lay.dims, lay.rows, lay.row_numel, lay.sizes)):
        moved = (shape[d],) + shape[:d] + shape[d + 1:] if shape else (1,)
        span = lay.span(k)
        if span is None:
            block = out[:, off:off + size].reshape(n * r, *moved[1:])[: moved[0]]
        else:  # each rank's valid rows, put back in row order
            blocks = out[:, off:off + size].reshape(n, r, *moved[1:])
            block = torch.cat([blocks[g, :cnt] for g, (_, cnt) in sorted(enumerate(span), key=lambda t: t[1][0])])
        full = block.movedim(0, d) if shape else block.reshape(())
        fulls.append(full.contiguous() if not full.is_contiguous() else full)
        off += size
    return fulls


def _grad_parts(grads: Sequence[torch.Tensor | None], n: int, lay: GroupLayout,
                dtype: torch.dtype, device: torch.device | None = None) -> list[torch.Tensor]:
    """Full grads -> per-leaf (n, rows * row_numel) blocks, padded, in ``dtype``.

    A missing gradient becomes zeros on ``device`` (default: that of the other grads).
    """
    if device is None:
        device = next((g.device for g in grads if g is not None), None)
    parts = []
    for k, (g, shape, d, r, e) in enumerate(zip(grads, lay.shapes, lay.dims, lay.rows, lay.row_numel)):
        if g is None:
            parts.append(torch.zeros(n, r * e, dtype=dtype, device=device))
            continue
        g = g.to(dtype)
        g = g.movedim(d, 0) if g.dim() else g.reshape(1)
        span = lay.span(k)
        if span is not None:  # rank g's rows, each padded to r, in the gather's rank order
            blocks = g.new_zeros(n, r, *g.shape[1:])
            for rank, (lo, cnt) in enumerate(span):
                blocks[rank, :cnt] = g[lo:lo + cnt]
            parts.append(blocks.reshape(n, r * e))
            continue
        if g.shape[0] < n * r:
            g = torch.cat([g, g.new_zeros(n * r - g.shape[0], *g.shape[1:])])
        parts.append(g.reshape(n, r * e))
    return parts


def _flatten_grads(grads: Sequence[torch.Tensor | None], n: int, lay: GroupLayout,
                   dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Full grads -> (n * F,) in rank-major order, padded, ready for reduce-scatter."""
    parts = _grad_parts(grads, n, lay, dtype, device)
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
      post_axes: a proper sub-group of ``shard_axes`` to keep the gathered parameters
        sharded over between forward and backward (``reshard_after_forward=k``); ``()``
        keeps nothing (backward regathers from the shards over all of ``shard_axes``).
      offload: the leaves live on the CPU; gathers copy them to the mesh's device and
        gradients come back to the CPU.
    """

    groups: list[list[torch.Tensor]]
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    dims: list[list[int]]
    policy: Policy
    bucket_bytes: int = 25 * 2**20
    accumulator: Any = None
    sync: bool | str = True
    post_axes: tuple[str, ...] = ()
    offload: bool = False
    layouts: list[GroupLayout] = attrs.field(init=False)
    n: int = attrs.field(init=False)
    device: torch.device = attrs.field(init=False)
    _sgroup: Any = attrs.field(init=False)
    _rgroup: Any = attrs.field(init=False)
    _rn: int = attrs.field(init=False)
    _pgroup: Any = attrs.field(init=False, default=None)
    _pk: int = attrs.field(init=False, default=1)
    _pidx: int = attrs.field(init=False, default=0)
    _pin: bool = attrs.field(init=False, default=False)
    _inflight: dict[int, comm.Handle] = attrs.field(init=False, factory=dict)
    _pending: dict[int, tuple[Any, comm.Handle | None, comm.Handle | None]] = attrs.field(init=False, factory=dict)
    _cache: dict[int, list[torch.Tensor]] = attrs.field(init=False, factory=dict)
    _post: dict[int, torch.Tensor] = attrs.field(init=False, factory=dict)
    _bucket: list[tuple[int, list[torch.Tensor]]] = attrs.field(init=False, factory=list)
    sunk: list[list[torch.Tensor]] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        body = lax.BODY.get()
        if body is None:
            raise RuntimeError("fs.parallel layer loops run inside a shard_map body (they issue collectives).")
        if self.sync not in (True, False, "reduce_scatter"):
            raise ValueError(f"fs.parallel: sync={self.sync!r}; use True, False or 'reduce_scatter'.")
        mesh = body.mesh
        self.device = mesh.device
        self._check_devices(mesh)
        # Stage offloaded shards in pinned memory only where that buys an async copy.
        self._pin = self.offload and self.device.type == "cuda"
        self.n = mesh.axis_size(self.shard_axes) if self.shard_axes else 1
        self._rn = mesh.axis_size(self.replicate_axes) if self.replicate_axes else 1
        self._sgroup = mesh.group(self.shard_axes) if self.n > 1 else None
        self._rgroup = mesh.group(self.replicate_axes) if self._rn > 1 else None
        if self.post_axes:
            self._pk = mesh.axis_size(self.post_axes)
            self._pgroup = mesh.group(self.post_axes)
            # mesh.group orders its ranks by the mesh order of the axes: index likewise.
            self._pidx = mesh.axis_index(mesh.sub_axes_in_mesh_order(self.post_axes))
        self.layouts = [_layout(g, self.n, d, self.shard_axes, mesh) for g, d in zip(self.groups, self.dims)]
        _claim(body.owners, self.groups)

    def _check_devices(self, mesh) -> None:
        """Offloaded leaves must be on the CPU; on a GPU mesh, others must not be.

        Raises:
          ValueError: names the group, leaf, its device and the remedy.
        """
        for g, leaves in enumerate(self.groups):
            for k, x in enumerate(leaves):
                if self.offload and x.device.type != "cpu":
                    raise ValueError(
                        f"fs.parallel: offload=True, but leaf {k} of group {g} (shape {tuple(x.shape)}) is on "
                        f"{x.device}. With offload the shards live on the CPU: move them there before the "
                        f"step (fs.parallel.scan.offload_shards(params)), or pass offload=False."
                    )
                if not self.offload and x.device.type == "cpu" and self.device.type != "cpu":
                    raise ValueError(
                        f"fs.parallel: leaf {k} of group {g} (shape {tuple(x.shape)}) is on the CPU but the "
                        f"mesh computes on {self.device}. Pass offload=True to keep shards on the CPU and "
                        f"gather them onto {self.device}, or move the shards to {self.device}."
                    )

    # --- forward --------------------------------------------------------------------
    def start_gather(self, i: int) -> None:
        """Starts group ``i``'s all-gather unless it is in flight or not needed."""
        if self.n == 1 or i in self._inflight or not 0 <= i < len(self.groups):
            return
        flat = _flatten(self.groups[i], self.layouts[i], self.policy.param_dtype, pin=self._pin)
        if self.offload:
            flat = _to_compute(flat, self.device)  # queued just ahead of the gather it feeds
        self._inflight[i] = comm.all_gather_async(flat, self._sgroup, self.n, axes=self.shard_axes)

    def gathered(self, i: int, keep: bool = False) -> list[torch.Tensor]:
        """Group ``i``'s full parameters (waits for, or issues, its all-gather).

        Args:
          keep: with ``post_axes``, keep this rank's slice of the gathered buffer for
            backward's regather (the forward gather of a layer whose backward will run).
        """
        if self.n == 1:
            dt = self.policy.param_dtype
            full = [x.detach().to(dt) if dt is not None and x.is_floating_point() else x.detach()
                    for x in self.groups[i]]
            return [_to_compute(x, self.device) for x in full] if self.offload else full
        self.start_gather(i)
        buf = self._inflight.pop(i).wait()
        if keep and self.post_axes:
            self._post[i] = self._post_chunk(buf)
        return _unflatten_full(buf, self.n, self.layouts[i])

    def _post_chunk(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's ``1/k`` slice of a gathered buffer, as a copy.

        A view would keep the whole gathered buffer alive until backward, which is the
        memory partial resharding exists to free. The ``k`` ranks of one ``post_axes``
        group hold the ``k`` consecutive slices, so an all-gather over ``post_axes`` (in
        that group's rank order) puts the buffer back together exactly.
        """
        return buf.view(self._pk, -1)[self._pidx].clone()

    # --- backward: regather for saved tensors -----------------------------------------
    def start_regather(self, i: int) -> None:
        """Starts group ``i``'s backward all-gather: over ``post_axes`` from the kept slice
        when there is one, else from the shards over all of ``shard_axes``."""
        post = self._post.get(i)
        if post is None:
            self.start_gather(i)
        elif i not in self._inflight:
            self._inflight[i] = comm.all_gather_async(post, self._pgroup, self._pk, axes=self.post_axes)

    def regathered(self, i: int, prefetch: Sequence[int] = ()) -> list[torch.Tensor]:
        full = self._cache.get(i)
        if full is None:
            self.start_regather(i)  # this layer's own gather first, then the prefetch behind it
            for j in prefetch:
                self.start_regather(j)
            if self.n == 1:
                full = self.gathered(i)
            else:
                # Either gather rebuilds the same (n * F,) buffer: the full one directly, the
                # partial one from the k slices kept after forward.
                full = _unflatten_full(self._inflight.pop(i).wait(), self.n, self.layouts[i])
            self._cache[i] = full
        return full

    def drop(self, i: int) -> None:
        """Ends group ``i``'s backward: frees its regathered parameters and kept slice.

        A backward prefetch for ``i`` that no saved tensor asked for (a layer whose
        backward needs no parameter, e.g. the first one when its input needs no grad) is
        waited here, so that no collective is left in flight.
        """
        self._cache.pop(i, None)
        self._post.pop(i, None)
        stale = self._inflight.pop(i, None)
        if stale is not None:
            stale.wait()

    def finish(self) -> None:
        """Waits for any gather still in flight (end of backward); frees kept slices."""
        for i in list(self._inflight):
            self._inflight.pop(i).wait()
        self._post.clear()

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
            parts = [p.reshape(-1) for p in _grad_parts(grads, 1, lay, dtype, self.device)]
            self._bucket.append((i, parts))
            if sum(p.numel() * p.element_size() for _, ps in self._bucket for p in ps) >= self.bucket_bytes or i == 0:
                self._flush()
            return
        flat = _flatten_grads(grads, self.n, lay, dtype, self.device)
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
        flat = self._reduced(i)
        if flat is None:
            return [None] * len(self.groups[i])
        if self.offload:
            flat = _to_host(flat)
            _wait_host_copies(self.device)
        return _unflatten_shards(flat, self.layouts[i], self.groups[i])

    def collect_all(self) -> list[torch.Tensor | None]:
        """Every group's shard gradients, in order (end of backward).

        With offload, every group's copy back to the CPU is queued first and waited
        once, so the copies overlap each other instead of one stall per group.
        """
        flats = [self._reduced(i) for i in range(len(self.groups))]
        if self.offload:
            flats = [None if f is None else _to_host(f) for f in flats]
            _wait_host_copies(self.device)
        out: list[torch.Tensor | None] = []
        for i, flat in enumerate(flats):
            out.extend([None] * len(self.groups[i]) if flat is None else
                       _unflatten_shards(flat, self.layouts[i], self.groups[i]))
        return out

    def _reduced(self, i: int) -> torch.Tensor | None:
        """Waits for group ``i``'s reduction: its reduced flat shard gradient, or None."""
        if i not in self._pending and any(j == i for j, _ in self._bucket):
            self._flush()  # a bucket left open (backward stopped before group 0)
        entry = self._pending.pop(i, None)
        if entry is None:
            return None
        flat, rs, ar = entry
        if rs is not None:
            flat = rs.wait()
            if self.accumulator is not None:
                key = ("reduce_scattered",) + self._key(i)
                if self.sync == "reduce_scatter":  # HSDP: keep the shard-reduced grads, skip the all-reduce
                    self.accumulator.add(key, flat)
                    return None
                prev = self.accumulator.take(key)
                if prev is not None:
                    flat = flat + prev
            if self._rn > 1:  # HSDP: reduce-scatter over the shard axis, then all-reduce over replicas
                flat = comm.all_reduce(flat, self._rgroup, "sum", axes=self.replicate_axes)
        elif ar is not None:
            shared, off, numel = ar
            flat = shared.result()[off:off + numel]
        return flat


def _wait_host_copies(device: torch.device) -> None:
    """Blocks until the device-to-host copies queued by :func:`_to_host` are done.

    They were queued without blocking, so the host must not read their targets before
    the stream they run on has reached them.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
        return (None, *state.collect_all())


class Gather(torch.autograd.Function):
    """Group ``i``'s shards -> its full parameters; backward starts the reduction."""

    @staticmethod
    def forward(state: Groups, i: int, *leaves: torch.Tensor):
        # Backward will run for this gather: keep the post-forward slice if resharding to k.
        return tuple(state.gathered(i, keep=True))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.i = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.reduce(ctx.i, grads)
        ctx.state.drop(ctx.i)
        return (None, None) + (None,) * len(grads)


def saved_as_tokens(full: Sequence[torch.Tensor], regather):
    """A ``saved_tensors_hooks`` context: saved tensors living in ``full``'s storage
    become tokens, and unpacking one calls ``regather()`` (which returns tensors laid out
    as ``full``, the same gather; cache it per backward step) and views into it.

    This is "reshard after forward" without recompute: autograd keeps no gathered
    parameter between forward and backward.
    """
    storages = {f.untyped_storage()._cdata: k for k, f in enumerate(full)}

    def pack(t: torch.Tensor):
        k = storages.get(t.untyped_storage()._cdata)
        if k is None:
            return t
        return (k, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(obj):
        if isinstance(obj, torch.Tensor):
            return obj
        k, shape, stride, offset = obj
        return regather()[k].as_strided(shape, stride, offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

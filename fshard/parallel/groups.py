"""Parameter groups: gather a group's shards in one flat collective, reduce its grads in one.

This is the engine under :func:`fshard.parallel.scan_layers` and
:func:`fshard.parallel.gather_params`, used inside a shard_map body on local shards.
One *group* (a layer, or the embeddings and head) is moved as one flat buffer:

forward  : cast shards to ``param_dtype`` -> pad each to ``ceil(N / n)`` rows -> one
           all-gather over the shard axis -> full parameters (views of no one else)
backward : full grads -> ``reduce_dtype`` -> pad -> one reduce-scatter over the shard
           axis (sum) -> one all-reduce over the replicate axis (HSDP/DDP) -> shards

The transpose is the one ``fs.lax.all_gather`` has (psum_scatter), just flattened over
many tensors and padded for uneven shards (the flat layout: :mod:`fshard.parallel.flat`).
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

from typing import Any, Sequence

import attrs
import torch

from fshard import comm, lax
from fshard.parallel import flat as layout
from fshard.parallel.flat import GroupLayout
from fshard.transforms.policy import Policy
from fshard.transforms.shard_map import input_spec

__all__ = ["GroupLayout", "Groups"]


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
        A leaf whose spec splits it over one of them (an expert split over ``ep``, with the
        dense leaves replicated over ``ep``) is not summed over that axis: its blocks are
        different tensors, and whatever sums its gradient over that axis lives in the body
        (the expert dispatch's transpose). The rule is read from each leaf's spec.
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
    _raxes: tuple[str, ...] = attrs.field(init=False)
    _extra: list[list[tuple[tuple[str, ...], list[tuple[int, int]]]]] = attrs.field(init=False)
    _mesh: Any = attrs.field(init=False)
    _pgroup: Any = attrs.field(init=False, default=None)
    _pk: int = attrs.field(init=False, default=1)
    _pidx: int = attrs.field(init=False, default=0)
    _pin: bool = attrs.field(init=False, default=False)
    _inflight: dict[int, comm.Handle] = attrs.field(init=False, factory=dict)
    _pending: dict[int, tuple[Any, comm.Handle | None, comm.Handle | None]] = attrs.field(init=False, factory=dict)
    _last_rs: int | None = attrs.field(init=False, default=None)
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
        self._mesh = mesh
        self.layouts = [layout.layout(g, self.n, d, self.shard_axes, mesh) for g, d in zip(self.groups, self.dims)]
        self._raxes, self._extra = _replica_sets(self.groups, self.layouts, self.replicate_axes, mesh)
        self._rn = mesh.axis_size(self._raxes) if self._raxes else 1
        self._sgroup = mesh.group(self.shard_axes) if self.n > 1 else None
        self._rgroup = mesh.group(self._raxes) if self._rn > 1 else None
        if self.post_axes:
            self._pk = mesh.axis_size(self.post_axes)
            self._pgroup = mesh.group(self.post_axes)
            # mesh.group orders its ranks by the mesh order of the axes: index likewise.
            self._pidx = mesh.axis_index(mesh.sub_axes_in_mesh_order(self.post_axes))
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
        flat = layout.flatten(self.groups[i], self.layouts[i], self.policy.param_dtype, pin=self._pin)
        if self.offload:
            flat = layout.to_compute(flat, self.device)  # queued just ahead of the gather it feeds
        self._inflight[i] = comm.all_gather_async(flat, self._sgroup, self.n, axes=self.shard_axes)

    def gathered(self, i: int, keep: bool = False) -> list[torch.Tensor]:
        """Group ``i``'s full parameters (waits for, or issues, its all-gather).

        Args:
          keep: with ``post_axes``, keep this rank's slice of the gathered buffer for
            backward's regather (the forward gather of a layer whose backward will run).
        """
        if self.n == 1:
            dt = self.policy.param_dtype
            full = [
                x.detach().to(dt) if dt is not None and x.is_floating_point() else x.detach() for x in self.groups[i]
            ]
            return [layout.to_compute(x, self.device) for x in full] if self.offload else full
        self.start_gather(i)
        buf = self._inflight.pop(i).wait()
        if keep and self.post_axes:
            self._post[i] = self._post_chunk(buf)
        return layout.unflatten_full(buf, self.n, self.layouts[i])

    def _post_chunk(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's ``1/k`` slice of a gathered buffer, as a copy.

        A view would keep the whole gathered buffer alive until backward, which is the
        memory partial resharding exists to free. The ``k`` ranks of one ``post_axes``
        group hold the ``k`` consecutive slices, so an all-gather over ``post_axes`` (in
        that group's rank order) puts the buffer back together exactly.
        """
        # select, not [ ]: under fs.simulate the index is a per-rank int, which [ ] cannot take.
        return buf.view(self._pk, -1).select(0, self._pidx).clone()

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
                full = layout.unflatten_full(self._inflight.pop(i).wait(), self.n, self.layouts[i])
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
            (g.dtype for g in grads if g is not None), self.groups[i][0].dtype
        )
        if self.n == 1 and self._rn > 1 and self.accumulator is None:
            # DDP: gradients of consecutive groups share one all-reduce (a bucket), launched
            # when it is full or when the first group (the last in backward) is done; the
            # bucket is built with one copy of every gradient.
            parts = [p.reshape(-1) for p in layout.grad_parts(grads, 1, lay, dtype, self.device)]
            self._bucket.append((i, parts))
            if sum(p.numel() * p.element_size() for _, ps in self._bucket for p in ps) >= self.bucket_bytes or i == 0:
                self._flush()
            return
        flat = layout.flatten_grads(grads, self.n, lay, dtype, self.device)
        if self.accumulator is not None and self.sync != "reduce_scatter":
            key = self._key(i)
            if not self.sync:
                self.accumulator.add(key, flat)  # no reduction: this call's shard grads are zeros
                return
            prev = self.accumulator.take(key)
            if prev is not None:
                flat = flat + prev
        # At most one reduce-scatter in flight (as FSDP2): finishing the previous one here,
        # a block's backward after it started, frees its full-size buffers (the flat
        # gradient, or on gloo the all-to-all's received chunks) now, not at the end of
        # backward.
        prev = self._pending.get(self._last_rs) if self._last_rs is not None else None
        if prev is not None and prev[1] is not None:
            self._pending[self._last_rs] = (None, comm.Handle(prev[1].wait()), None)
        self._last_rs = None
        rs = comm.reduce_scatter_async(flat, self._sgroup, self.n, axes=self.shard_axes) if self.n > 1 else None
        if rs is None and self._rn > 1:  # DDP with accumulation: one group per all-reduce
            self._bucket.append((i, [flat]))
            self._flush()
            return
        self._pending[i] = (flat if rs is None else None, rs, None)  # no reduction: flat is the result
        if rs is not None:
            self._last_rs = i

    def _key(self, i: int) -> tuple:
        # The storage object's address, not its data pointer: fs.jit traces on fake
        # tensors, whose data pointer cannot be read.
        return (self.layouts[i].shapes, i, self.groups[i][0].untyped_storage()._cdata)

    def _flush(self) -> None:
        if not self._bucket:
            return
        parts = [p for _, ps in self._bucket for p in ps]
        # A concatenated bucket is ours alone: reduce it in place (no second buffer). One
        # part may be a view of a gradient autograd handed out: reduce that into a new one.
        ours = len(parts) > 1
        buf = torch.cat(parts) if ours else parts[0]
        handle = _Shared(comm.all_reduce_async(buf, self._rgroup, axes=self._raxes, inplace=ours))
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
            flat = layout.to_host(flat)
            _wait_host_copies(self.device)
        return layout.unflatten_shards(flat, self.layouts[i], self.groups[i])

    def collect_all(self) -> list[torch.Tensor | None]:
        """Every group's shard gradients, in order (end of backward).

        With offload, every group's copy back to the CPU is queued first and waited
        once, so the copies overlap each other instead of one stall per group.
        """
        flats = [self._reduced(i) for i in range(len(self.groups))]
        if self.offload:
            flats = [None if f is None else layout.to_host(f) for f in flats]
            _wait_host_copies(self.device)
        out: list[torch.Tensor | None] = []
        for i, flat in enumerate(flats):
            out.extend(
                [None] * len(self.groups[i])
                if flat is None
                else layout.unflatten_shards(flat, self.layouts[i], self.groups[i])
            )
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
                flat = comm.all_reduce(flat, self._rgroup, "sum", axes=self._raxes)
        elif ar is not None:
            shared, off, numel = ar
            flat = shared.result()[off : off + numel]
        return self._reduce_extra(i, flat)

    def _reduce_extra(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Sums the leaves replicated over more axes than every leaf shares over those
        (the all-reduce above covered the shared ones): one all-reduce per distinct set."""
        if not self._extra[i]:
            return flat
        flat = flat.clone()  # may be a view of a gradient autograd handed out
        for axes, segments in self._extra[i]:
            part = torch.cat([flat[o : o + k] for o, k in segments])
            part = comm.all_reduce(part, self._mesh.group(axes), "sum", axes=axes)
            at = 0
            for o, k in segments:
                flat[o : o + k].copy_(part[at : at + k])
                at += k
        return flat


def _replica_sets(
    groups: list[list[torch.Tensor]], layouts: list[GroupLayout], replicate_axes: tuple[str, ...], mesh: Any
) -> tuple[tuple[str, ...], list[list[tuple[tuple[str, ...], list[tuple[int, int]]]]]]:
    """The replicate axes every leaf is summed over, and per group the rest.

    A leaf is summed over the replicate axes of size > 1 its spec does not split it over.
    Returns the axes all leaves share (one all-reduce of each whole flat buffer, bucketed
    as before) and, per group, ``[(more axes, [(offset, numel) of each leaf's segment in
    the reduced flat shard]), ...]`` for the leaves that need more.
    """
    big = tuple(a for a in replicate_axes if mesh.shape[a] > 1)
    per_leaf = [[tuple(a for a in big if a not in _spec_axes(x)) for x in g] for g in groups]
    every = [s for g in per_leaf for s in g]
    shared = tuple(a for a in big if all(a in s for s in every))
    if len(shared) == len(big):  # the usual case: one all-reduce over replicate_axes as given
        return replicate_axes, [[] for _ in groups]
    extra = []
    for sets, lay in zip(per_leaf, layouts):
        by_axes: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        off = 0
        for s, size in zip(sets, lay.sizes):
            more = tuple(a for a in s if a not in shared)
            if more:
                by_axes.setdefault(more, []).append((off, size))
            off += size
        extra.append(list(by_axes.items()))
    return shared, extra


def _spec_axes(x: torch.Tensor) -> set[str]:
    spec = input_spec(x)
    return set() if spec is None else set(spec.axes())


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

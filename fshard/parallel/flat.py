"""The flat buffer of a parameter group: its layout, and packing and unpacking it.

One group's leaves travel as one flat buffer. Per leaf, this rank's shard is moved so
that its sharded dim is first, padded to ``ceil(N / n)`` rows (uneven ``torch.chunk``
shards, as FSDP2 and DTensor cut them; over several axes, the blocks ``fs.shard`` cuts
per axis: see :attr:`GroupLayout.spans`), cast, flattened and concatenated; the
all-gather of those buffers, rank-major, unflattens into the full parameters, and full
gradients flatten the same way for the reduce-scatter. :mod:`fshard.parallel.groups`
runs the collectives; this module only computes.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

import attrs
import torch

from fshard.runtime import simulation
from fshard.transforms.shard_map import global_shape, input_spec

__all__ = [
    "GroupLayout",
    "flatten",
    "flatten_grads",
    "gathered_shape",
    "grad_parts",
    "layout",
    "to_compute",
    "to_host",
    "unflatten_full",
    "unflatten_shards",
]


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
    cuts = []
    for d in range(len(spec)):
        # Size-1 axes split nothing, so their place in the order does not matter (and
        # DTensor placements do not keep it).
        axes = tuple(a for a in spec.dim_axes(d) if mesh.shape[a] > 1)
        others = [a for a in axes if a not in shard_axes]
        if tuple(axes[: len(others)]) != tuple(others):  # the gathered axes are not the minor ones
            raise ValueError(
                f"fs.parallel: dim {d} of a parameter with spec {spec} splits over {axes}; the "
                f"gathered axes {shard_axes} must come last (minor) on that dim, e.g. "
                f"P(({', '.join(repr(a) for a in others + list(shard_axes))},))."
            )
        cuts.append(others)
    coord = mesh.coordinate()
    sizes = [mesh.shape[a] for others in cuts for a in others]
    # The block depends on this rank's coordinates: one run per rank under fs.simulate.
    return simulation.per_rank(_blocks)(
        tuple(shape), [len(o) for o in cuts], sizes, [coord[a] for o in cuts for a in o]
    )


def _blocks(shape: tuple[int, ...], counts: list[int], sizes: list[int], coords: list[int]) -> tuple[int, ...]:
    """``shape`` cut, on dim ``d``, by the ``counts[d]`` next axes (their ``sizes`` and this
    rank's ``coords``), major to minor: this rank's nested torch.chunk block, as fs.shard cuts it."""
    out, k = list(shape), 0
    for d, count in enumerate(counts):
        for size, at in zip(sizes[k : k + count], coords[k : k + count]):
            c = -(-out[d] // size)
            lo = min(at * c, out[d])
            out[d] = min(lo + c, out[d]) - lo
        k += count
    return tuple(out)


def _spans(
    x: torch.Tensor, d: int, length: int, shard_axes: tuple[str, ...], mesh
) -> tuple[tuple[int, int], ...] | None:
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


def layout(leaves: Sequence[torch.Tensor], n: int, dims: Sequence[int], shard_axes=(), mesh=None) -> GroupLayout:
    shapes: list[tuple[int, ...]] = []
    rows, numel, local_rows, spans = [], [], [], []
    for x, d in zip(leaves, dims):
        shape = gathered_shape(x, shard_axes, mesh) if mesh is not None else global_shape(x)
        if shape is None and n == 1:
            shape = tuple(x.shape)
        if shape is None:
            raise ValueError(
                "fs.parallel: a group leaf is not a shard_map input, so its global shape is "
                "unknown; pass parameters into the shard_map body as DTensors (fs.shard)."
            )
        _refuse_per_rank_shape(len(shapes), x, tuple(shape), shard_axes)
        shapes.append(tuple(shape))
        span = _spans(x, d, shape[d], tuple(shard_axes), mesh) if shape and n > 1 else None
        spans.append(span)
        rows.append(max(size for _, size in span) if span else -(-shape[d] // n) if shape else 1)
        numel.append(int(torch.Size(shape[:d] + shape[d + 1 :]).numel()) if shape else 1)
        local_rows.append(x.shape[d] if x.dim() else 1)
    return GroupLayout(tuple(shapes), tuple(dims), tuple(rows), tuple(numel), tuple(local_rows), tuple(spans))


def _refuse_per_rank_shape(k: int, x: torch.Tensor, shape: tuple[Any, ...], shard_axes: Sequence[str]) -> None:
    """Under ``fs.simulate``: a leaf whose gathered shape differs per rank (cut unevenly over
    an axis the group does not gather, e.g. tensor parallelism) would give every rank another
    flat layout, which the simulated layer loop does not build.

    Raises:
      RankBranchError: names the leaf, its per-rank sizes and the fix.
    """
    per_rank = {d: s.node._local_ints for d, s in enumerate(shape) if hasattr(getattr(s, "node", None), "_local_ints")}
    if not per_rank:
        return
    d, sizes = next(iter(per_rank.items()))
    shown = ", ".join(f"rank {r}: {v}" for r, v in sorted(sizes.items()))
    raise simulation.RankBranchError(
        f"fs.parallel under fs.simulate: leaf {k} of a group (local shape {tuple(x.shape)}) gathers over "
        f"{tuple(shard_axes)} to a shape that differs per rank on dim {d} ({shown}): it is cut unevenly "
        f"over another mesh axis (e.g. tp), so each rank would build another flat buffer, which the "
        f"simulated layer loop does not do yet. Make that dim divisible by the other axes' sizes, or run "
        f"on real ranks (fs.run_local / torchrun)."
    )


def flatten(
    leaves: Sequence[torch.Tensor], lay: GroupLayout, dtype: torch.dtype | None, pin: bool = False
) -> torch.Tensor:
    """Local shards -> one flat buffer (cast, padded to ``lay.rows``); pinned if ``pin``."""
    parts = []
    for x, d, r in zip(leaves, lay.dims, lay.rows):
        x = x.detach()
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        x = x.movedim(d, 0) if x.dim() else x.reshape(1)
        # Uneven shards differ in rows per rank: padded in one run per rank under fs.simulate.
        parts.append(simulation.per_rank(_pad_rows)(x, r).reshape(-1))
    if pin:
        # Built straight into page-locked memory: only a copy from pinned memory to the GPU
        # is asynchronous; from pageable memory the host would stall on a staging copy.
        out_dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
        out = torch.empty(sum(p.numel() for p in parts), dtype=out_dtype, pin_memory=True)
        return torch.cat(parts, out=out) if len(parts) > 1 else out.copy_(parts[0])
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` padded with zero rows (dim 0) to ``rows``: an uneven shard to the common row count."""
    if x.shape[0] < rows:
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
    return x


def to_compute(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An offloaded flat buffer -> the compute device (returned as is when already there).

    ``non_blocking``: from pinned memory the copy is queued on the current stream and the
    host moves on; the all-gather issued next on that stream is ordered after it.
    """
    if flat.device == device:
        return flat
    return flat.to(device, non_blocking=True)


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """A reduced gradient buffer -> the CPU (pinned; the caller synchronizes before use).

    The copy is queued without blocking so that every group's copy is in flight at once;
    :meth:`Groups.collect_all` waits once for all of them before the host reads any.
    """
    if flat.device.type == "cpu":
        return flat
    out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
    return out.copy_(flat, non_blocking=True)


def unflatten_full(out: torch.Tensor, n: int, lay: GroupLayout) -> list[torch.Tensor]:
    """``out``: (n * F,) gathered buffer -> full tensors (global shapes)."""
    out = out.view(n, -1)
    fulls, off = [], 0
    for k, (shape, d, r, _e, size) in enumerate(zip(lay.shapes, lay.dims, lay.rows, lay.row_numel, lay.sizes)):
        moved = (shape[d],) + shape[:d] + shape[d + 1 :] if shape else (1,)
        span = lay.span(k)
        if span is None:
            block = out[:, off : off + size].reshape(n * r, *moved[1:])[: moved[0]]
        else:  # each rank's valid rows, put back in row order
            blocks = out[:, off : off + size].reshape(n, r, *moved[1:])
            block = torch.cat([blocks[g, :cnt] for g, (_, cnt) in sorted(enumerate(span), key=lambda t: t[1][0])])
        full = block.movedim(0, d) if shape else block.reshape(())
        fulls.append(full.contiguous() if not full.is_contiguous() else full)
        off += size
    return fulls


def grad_parts(
    grads: Sequence[torch.Tensor | None],
    n: int,
    lay: GroupLayout,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Full grads -> per-leaf (n, rows * row_numel) blocks, padded, in ``dtype``.

    A missing gradient becomes zeros on ``device`` (default: that of the other grads).
    """
    if device is None:
        device = next((g.device for g in grads if g is not None), None)
    parts = []
    for k, (g, _shape, d, r, e) in enumerate(zip(grads, lay.shapes, lay.dims, lay.rows, lay.row_numel)):
        if g is None:
            parts.append(torch.zeros(n, r * e, dtype=dtype, device=device))
            continue
        g = g.to(dtype)
        g = g.movedim(d, 0) if g.dim() else g.reshape(1)
        span = lay.span(k)
        if span is not None:  # rank g's rows, each padded to r, in the gather's rank order
            blocks = g.new_zeros(n, r, *g.shape[1:])
            for rank, (lo, cnt) in enumerate(span):
                blocks[rank, :cnt] = g[lo : lo + cnt]
            parts.append(blocks.reshape(n, r * e))
            continue
        if g.shape[0] < n * r:
            g = torch.cat([g, g.new_zeros(n * r - g.shape[0], *g.shape[1:])])
        parts.append(g.reshape(n, r * e))
    return parts


def flatten_grads(
    grads: Sequence[torch.Tensor | None],
    n: int,
    lay: GroupLayout,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Full grads -> (n * F,) in rank-major order, padded, ready for reduce-scatter."""
    parts = grad_parts(grads, n, lay, dtype, device)
    return torch.cat(parts, dim=1).reshape(-1) if len(parts) > 1 else parts[0].reshape(-1)


def unflatten_shards(flat: torch.Tensor, lay: GroupLayout, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for x, d, r, _e, size, lr in zip(like, lay.dims, lay.rows, lay.row_numel, lay.sizes, lay.local_rows):
        moved_shape = (x.shape[d],) + tuple(x.shape[:d]) + tuple(x.shape[d + 1 :]) if x.dim() else (1,)
        g = flat[off : off + size].view(r, *moved_shape[1:])[:lr]
        g = g.movedim(0, d) if x.dim() else g.reshape(())
        out.append(g.to(x.dtype).contiguous())
        off += size
    return out

"""Data parallelism (``dp``: DDP, or HSDP's replica axis over FSDP shards) in the planner.

- The search: any divisor of the devices left; the data axes together divide the batch.
- Collectives: the loss mean over every data axis (``fs.parallel.DATA_AXES``) and cp, and
  the gradients' reduction over dp and cp (the replica axes: each cp rank's gradient is its
  share of the sequence's): without FSDP, DDP's all-reduce (``scan_layers``' buckets
  of :data:`BUCKET_BYTES`, or one per layer group with gradient accumulation, or one per
  pipeline stage); with FSDP (HSDP), the all-reduce of each reduce-scattered shard.
- Memory: without FSDP, over replicas, the full gradients wait for their all-reduce (autograd's, then
  the bucket they are copied into).
"""

from __future__ import annotations

from fshard.parallel.layout import Layout
from fshard.plan.axes.base import AxisRule, Collective, LayerShards, Step, flat_bytes

__all__ = ["BUCKET_BYTES", "DATA", "buckets", "loss_axes", "replica_axes", "summed_axes"]

BUCKET_BYTES = 25 * 2**20  # scan_layers' DDP bucket


def buckets(layer_bytes: int, n_layers: int) -> list[int]:
    """Layers per DDP bucket, in backward order: a bucket is sent once it reaches
    :data:`BUCKET_BYTES` or at layer 0."""
    out, cur = [], 0
    for i in range(n_layers - 1, -1, -1):
        cur += 1
        if cur * layer_bytes >= BUCKET_BYTES or i == 0:
            out.append(cur)
            cur = 0
    return out


def replica_axes(layout: Layout) -> tuple[str, ...]:
    """The axes parameters are replicated over with their gradients summed: dp and cp."""
    return tuple(a for a in ("dp", "cp") if layout.size(a) > 1)


def summed_axes(layout: Layout, shards: LayerShards, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of ``axes`` (plus ep) that every leaf of a group with ``shards`` is summed
    over (``fs.parallel``'s Groups): ep when no leaf is split over it, else not (the
    experts; the others' sum over ep is :mod:`fshard.plan.axes.ep`'s extra all-reduce)."""
    if layout.ep == 1:
        return axes
    whole = shards.flat if layout.fsdp > 1 else shards.local
    rest = tuple(a for a in axes if a != "ep")
    if shards.over_ep < whole:  # it holds experts
        return rest
    return tuple(a for a in layout.shape if a in rest or a == "ep")


def loss_axes(layout: Layout) -> tuple[str, ...]:
    """The axes the loss is averaged over: the data axes, then cp."""
    return layout.data_axes + (("cp",) if layout.cp > 1 else ())


class DataParallel(AxisRule):
    name = "dp"
    splits_batch = True

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        layout = step.layout
        if phase == "loss" and loss_axes(layout):
            nbytes = 8 if step.pipeline or layout.dtype == "float64" else 4
            return [Collective("psum", loss_axes(layout), nbytes, 1, "loss mean")]
        if phase != "replicas":
            return []
        sh, rdt = step.shards, layout.master_dtype
        assert sh is not None
        da = summed_axes(layout, sh, replica_axes(layout))
        if step.pipeline:
            if layout.fsdp > 1:
                if da:
                    return [Collective("psum", da, flat_bytes(sh.flat, rdt), 1, "hsdp all-reduce stage")]
                return []
            la = summed_axes(layout, sh, loss_axes(layout))
            if la:
                hide = None if step.last else "bwd"
                return [Collective("psum", la, flat_bytes(sh.local, rdt), 1, "pipeline all-reduce stage", hide)]
            return []
        root = step.root
        assert root is not None
        ra = summed_axes(layout, root, replica_axes(layout))
        if not da and not ra:
            return []
        L = step.model.layers[step.model.repeated].count
        out: list[Collective] = []
        if layout.fsdp > 1:  # HSDP: the shard's all-reduce over dp, at the end of backward
            if da:
                out.append(Collective("psum", da, flat_bytes(sh.flat, rdt), L, "hsdp all-reduce block"))
            if ra:
                out.append(Collective("psum", ra, flat_bytes(root.flat, rdt), 1, "hsdp all-reduce root"))
            return out
        layer = flat_bytes(sh.local, rdt)
        if da and layout.microbatches > 1:  # with accumulation: one all-reduce per group
            out.append(Collective("psum", da, layer, L - 1, "ddp all-reduce block", "bwd"))
            out.append(Collective("psum", da, layer, 1, "ddp all-reduce block"))
        elif da:
            groups = buckets(layer, L)
            for j, n_layers in enumerate(groups):
                last = j == len(groups) - 1
                out.append(Collective("psum", da, layer * n_layers, 1, "ddp bucket", None if last else "bwd"))
        if ra:
            out.append(Collective("psum", ra, flat_bytes(root.local, rdt), 1, "ddp all-reduce root"))
        return out

    def pending_grads(self, step: Step, full_grads: float) -> float:
        # DDP: autograd's gradients, then the bucket they are copied into; over ep alone,
        # each block's flat gradients wait for their ep all-reduce at the end of backward
        layout = step.layout
        return full_grads if layout.fsdp == 1 and (replica_axes(layout) or layout.ep > 1) else 0.0


DATA = DataParallel()

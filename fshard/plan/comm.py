"""The collectives of one training step, and their times on a machine.

:func:`step_collectives` lists, for one rank, every collective a layout's step issues,
in the terms of ``fs.comm_log`` (kind, mesh axes, payload bytes per call, count): FSDP
gathers and reduce-scatters of the flat buffers (sizes from the spec rules, see
:mod:`fshard.plan.shards`), DDP buckets, HSDP all-reduces, Megatron TP region
collectives (with and without sequence parallelism), the vocab-parallel loss, pipeline
sends and receives counted on the lowered schedule itself, and the loss reductions.
The test suite checks the list against ``comm_log`` on traced steps.

:func:`collective_time` turns one into seconds with the ring formulas (tree for small
all-reduces) over the link the mesh axes use::

    all_gather    (n - 1) * (a + x / B)              x: this rank's input
    psum_scatter  (n - 1) * (a + x / (n B))          x: the full input
    psum          min(2 (n - 1) (a + x / (n B)),     ring
                      2 ceil(log2 n) a + 2 x / B)    tree
    send / recv   a + x / B
    broadcast     ceil(log2 n) * (a + x / B)
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

import attrs

from fshard.plan.layout import Layout, layout_schedule
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, ModelDesc
from fshard.plan.shards import layer_shards, stage_layers, stage_shards

__all__ = ["Collective", "collective_time", "log_totals", "p2p_counts", "pipeline_payload", "step_collectives"]

BUCKET_BYTES = 25 * 2**20  # scan_layers' DDP bucket


@attrs.frozen
class Collective:
    """One kind of collective call a step issues on one rank.

    Attributes:
      kind: ``comm_log``'s kind: ``all_gather``, ``psum_scatter``, ``psum``, ``pmax``,
        ``send``, ``recv``, ``broadcast``.
      axes: the mesh axes it runs over.
      nbytes: payload per call (the input this rank contributes, as ``comm_log`` counts).
      count: calls.
      what: where it comes from (``"fsdp gather block"``, ``"tp exit"``, ...).
      hide: the compute it may overlap: ``"fwd"`` / ``"bwd"`` (one block's forward or
        backward), or ``None`` (on the critical path).
      pipeline: issued inside the pipeline's per-microbatch actions (its time belongs to
        F, I or W: ``"F"``, ``"I"``, ``"W"``), or ``""``.
      logged: ``comm_log`` sees it (``fs.optim.global_norm``'s scalar all-reduces call
        torch.distributed directly and are not logged).
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    count: int = 1
    what: str = ""
    hide: str | None = None
    pipeline: str = ""
    logged: bool = True


def log_totals(colls: Iterable[Collective]) -> dict[tuple[str, tuple[str, ...]], tuple[int, int]]:
    """``{(kind, axes): (calls, bytes)}`` of the logged collectives, as ``comm_log``'s
    ``by_axis`` / ``bytes_by_axis`` count them."""
    calls: Counter = Counter()
    nbytes: Counter = Counter()
    for c in colls:
        if c.logged and c.count:
            calls[(c.kind, c.axes)] += c.count
            nbytes[(c.kind, c.axes)] += c.count * c.nbytes
    return {k: (calls[k], nbytes[k]) for k in calls}


def _tp_layer(
    model: ModelDesc, layout: Layout, i: int, samples: int, calls: int, *, remat: bool, pipeline: bool
) -> list[Collective]:
    """Tensor-parallel collectives of ``calls`` forward + backward calls of layer ``i``."""
    layer = model.layers[i]
    tp = layout.tp
    if tp == 1 or not calls:
        return []
    s = DTYPE_BYTES[layout.dtype]
    act = int(samples * model.seq_len * model.hidden * s)  # one (b, T, D) activation
    sp = layout.sequence_parallel
    ax = ("tp",)
    F, I = ("F", "I") if pipeline else ("", "")
    fwd_calls = calls * (2 if remat else 1)  # remat runs the forward again in backward ...
    # ... but stops after the last tensor backward needs: the block's final exit is not redone.
    exit_calls = calls * (2 * layer.tp_exit - 1) if remat and layer.tp_exit else layer.tp_exit * fwd_calls
    out: list[Collective] = []

    def add(kind: str, nbytes: int, n: int, what: str, phase: str) -> None:
        if n:
            out.append(Collective(kind, ax, nbytes, n, f"tp {what} {layer.name}", None, phase))

    if sp:
        add("all_gather", act // tp, layer.tp_enter * fwd_calls, "enter", F)
        add("psum_scatter", act, exit_calls, "exit", F)
        add("psum_scatter", act, layer.tp_enter * calls, "enter grad", I)
        add("all_gather", act // tp, layer.tp_exit * calls, "exit grad", I)
        add("psum", layer.sp_param_numel * s, calls if layer.sp_param_numel else 0, "sp params grad", I)
    else:
        add("psum", act, exit_calls, "exit", F)
        add("psum", act, layer.tp_enter * calls, "enter grad", I)
    # Extra collectives are described in float32 (the loss's softmax runs in at least fp32).
    k = max(4, s) / 4
    for kind, phase, per_sample in layer.tp_extra:
        n = fwd_calls if phase == "fwd" else calls
        add(kind, int(per_sample * samples * k), n, "loss" if layer.loss else "extra", F if phase == "fwd" else I)
    return out


def pipeline_payload(model: ModelDesc, layout: Layout) -> int:
    """Bytes of one activation (or its gradient) sent between pipeline stages: a
    microbatch's ``(b, T, D)`` hidden state, ``(b, T / tp, D)`` with sequence parallelism."""
    t = model.seq_len // (layout.tp if layout.sequence_parallel else 1)
    return int(layout.microbatch_size * t * model.hidden * DTYPE_BYTES[layout.dtype])


def _flat_bytes(numel: int, dtype: str) -> int:
    return numel * DTYPE_BYTES[dtype]


def step_collectives(model: ModelDesc, layout: Layout, *, pp_rank: int = 0) -> list[Collective]:
    """Every collective one step of ``layout`` issues on one rank (rank ``pp_rank`` of pp).

    Without pp: all ranks issue the same. With pp, ranks hold different stages; pass
    ``pp_rank`` to pick one.

    Returns:
      A list of :class:`Collective`, in the order the step issues them (roughly).
    """
    if layout.pp > 1:
        return _pipeline_collectives(model, layout, pp_rank)
    return _flat_collectives(model, layout)


def _grad_norm(layout: Layout) -> list[Collective]:
    """``fs.optim.global_norm``: one scalar all-reduce over the sharded axes (one if they span
    every rank, else one per axis), plus one over pp (``sum_over``). Not logged."""
    sharded = [a for a in ("fsdp", "tp") if layout.size(a) > 1]
    spans = math.prod(layout.size(a) for a in sharded) == layout.n_devices // layout.pp
    groups = ([tuple(sharded)] if spans and layout.pp == 1 else [(a,) for a in sharded]) if sharded else []
    if layout.pp > 1:
        groups.append(("pp",))
    return [Collective("psum", g, 4, 1, "grad norm", None, "", logged=False) for g in groups]


def _flat_collectives(model: ModelDesc, layout: Layout) -> list[Collective]:
    """``examples/train_lm.py``'s step without pp: ``gather_params`` for the root layers,
    ``scan_layers`` for the blocks, gradient accumulation over ``microbatches``."""
    rep = model.repeated
    block = model.layers[rep]
    L = block.count
    roots = [i for i in range(len(model.layers)) if i != rep]
    fsdp, dp = layout.fsdp, layout.dp
    pdt = layout.dtype  # gathers in the compute dtype (policy.param_dtype)
    rdt = layout.master_dtype  # reductions in the masters' dtype
    b = layout.microbatch_size
    K = layout.microbatches
    reshard = layout.resharding and fsdp > 1 and not layout.remat
    root_sh = [layer_shards(model.layers[i], layout) for i in roots]
    blk = layer_shards(block, layout)
    out: list[Collective] = []
    fa, da = ("fsdp",), ("dp",)
    loss_bytes = 8 if layout.dtype == "float64" else 4

    root_flat = sum(s.flat for s in root_sh)
    root_full = sum(s.gathered for s in root_sh)
    root_local = sum(s.local for s in root_sh)
    for k in range(K):
        sync = k == K - 1
        # forward
        if fsdp > 1:
            out.append(Collective("all_gather", fa, _flat_bytes(root_flat, pdt), 1, "fsdp gather root"))
            out.append(Collective("all_gather", fa, _flat_bytes(blk.flat, pdt), 1, "fsdp gather block"))
            out.append(Collective("all_gather", fa, _flat_bytes(blk.flat, pdt), L - 1, "fsdp gather block", "fwd"))
        for i in range(len(model.layers)):
            out += _tp_layer(
                model, layout, i, b, model.layers[i].count, remat=layout.remat and i == rep, pipeline=False
            )
        if layout.data_axes:
            out.append(Collective("psum", layout.data_axes, loss_bytes, 1, "loss mean"))
        # backward
        if reshard:
            out.append(Collective("all_gather", fa, _flat_bytes(blk.flat, pdt), L, "fsdp regather block", "bwd"))
        if layout.remat and fsdp > 1:  # the recomputation gathers again
            out.append(Collective("all_gather", fa, _flat_bytes(blk.flat, pdt), L, "fsdp remat gather block", "bwd"))
        if not sync:
            continue
        if fsdp > 1:
            full = _flat_bytes(blk.flat * fsdp, rdt)
            out.append(Collective("psum_scatter", fa, full, L - 1, "fsdp reduce-scatter block", "bwd"))
            out.append(Collective("psum_scatter", fa, full, 1, "fsdp reduce-scatter block"))
            out.append(
                Collective("psum_scatter", fa, _flat_bytes(root_flat * fsdp, rdt), 1, "fsdp reduce-scatter root")
            )
            if dp > 1:  # HSDP: the shard's all-reduce over dp, at the end of backward
                out.append(Collective("psum", da, _flat_bytes(blk.flat, rdt), L, "hsdp all-reduce block"))
                out.append(Collective("psum", da, _flat_bytes(root_flat, rdt), 1, "hsdp all-reduce root"))
        elif dp > 1:
            if K > 1:  # with accumulation: one all-reduce per group
                out.append(Collective("psum", da, _flat_bytes(blk.local, rdt), L - 1, "ddp all-reduce block", "bwd"))
                out.append(Collective("psum", da, _flat_bytes(blk.local, rdt), 1, "ddp all-reduce block"))
            else:
                for j, n_layers in enumerate(_buckets(_flat_bytes(blk.local, rdt), L)):
                    last = j == len(_buckets(_flat_bytes(blk.local, rdt), L)) - 1
                    out.append(
                        Collective(
                            "psum", da, _flat_bytes(blk.local, rdt) * n_layers, 1, "ddp bucket", None if last else "bwd"
                        )
                    )
            out.append(Collective("psum", da, _flat_bytes(root_local, rdt), 1, "ddp all-reduce root"))
    del root_full
    return out + _grad_norm(layout)


def _buckets(layer_bytes: int, n_layers: int) -> list[int]:
    """Layers per DDP bucket, in backward order: a bucket is sent once it reaches
    :data:`BUCKET_BYTES` or at layer 0."""
    out, cur = [], 0
    for i in range(n_layers - 1, -1, -1):
        cur += 1
        if cur * layer_bytes >= BUCKET_BYTES or i == 0:
            out.append(cur)
            cur = 0
    return out


def _pipeline_collectives(model: ModelDesc, layout: Layout, pp_rank: int) -> list[Collective]:
    """``fs.sched.pipeline_step`` with ``StageFSDP`` (one gather per stage and step by
    default), TP inside each stage's body, and the lowered schedule's sends and receives."""
    sch = layout_schedule(layout)
    stages = stage_layers(model, sch.n_stages)
    held = sch.stages_of(pp_rank)
    fsdp, dp = layout.fsdp, layout.dp
    pdt, rdt = layout.dtype, layout.master_dtype
    b = layout.microbatch_size
    m = layout.microbatches
    out: list[Collective] = []
    fa, da = ("fsdp",), ("dp",)
    reshard = layout.reshard is True
    for j, s in enumerate(held):
        sh = stage_shards(model, layout, stages[s])
        if fsdp > 1:
            n_gathers = 1 if not reshard else m * 3
            out.append(
                Collective(
                    "all_gather",
                    fa,
                    _flat_bytes(sh.flat, pdt),
                    n_gathers,
                    "stage fsdp gather",
                    None if j == 0 else "fwd",
                )
            )
        for i, k in stages[s]:
            out += _tp_layer(model, layout, i, b, k * m, remat=layout.remat and i == model.repeated, pipeline=True)
    act = pipeline_payload(model, layout)
    sends, recvs = p2p_counts(sch)[pp_rank]
    if sends:
        out.append(Collective("send", ("pp",), act, sends, "p2p", None, "p2p"))
    if recvs:
        out.append(Collective("recv", ("pp",), act, recvs, "p2p", None, "p2p"))
    for j, s in enumerate(held):
        sh = stage_shards(model, layout, stages[s])
        last = j == len(held) - 1
        if fsdp > 1:
            out.append(
                Collective(
                    "psum_scatter",
                    fa,
                    _flat_bytes(sh.flat * fsdp, rdt),
                    1,
                    "stage fsdp reduce-scatter",
                    None if s == min(held) else "bwd",
                )
            )
            if dp > 1:
                out.append(Collective("psum", da, _flat_bytes(sh.flat, rdt), 1, "hsdp all-reduce stage"))
        elif layout.data_axes:
            out.append(
                Collective(
                    "psum",
                    layout.data_axes,
                    _flat_bytes(sh.local, rdt),
                    1,
                    "pipeline all-reduce stage",
                    None if last else "bwd",
                )
            )
    out.append(Collective("broadcast", ("pp",), 16, 1, "loss broadcast"))
    if layout.data_axes:
        out.append(Collective("psum", layout.data_axes, 8, 1, "loss mean"))
    return out + _grad_norm(layout)


_P2P: dict[int, tuple[object, tuple[tuple[int, int], ...]]] = {}


def p2p_counts(schedule: object) -> tuple[tuple[int, int], ...]:
    """Per rank, ``(sends, receives)`` one step of ``schedule`` posts: its lowered actions'
    SEND_F / SEND_B and RECV_F / RECV_B (cached per schedule object).

    Args:
      schedule: an ``fs.sched`` schedule (e.g. ``fs.plan.layout_schedule(layout)``).

    Returns:
      One ``(sends, receives)`` pair per pipeline rank.
    """
    from fshard.sched import Kind, lower

    hit = _P2P.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    rows = lower(schedule).actions
    counts = tuple(
        (
            sum(1 for a in row if a.kind in (Kind.SEND_F, Kind.SEND_B)),
            sum(1 for a in row if a.kind in (Kind.RECV_F, Kind.RECV_B)),
        )
        for row in rows
    )
    if len(_P2P) > 512:
        _P2P.clear()
    _P2P[id(schedule)] = (schedule, counts)  # the schedule is kept alive, so its id stays unique
    return counts


def _span(layout: Layout, axes: tuple[str, ...]) -> tuple[int, int]:
    """(group size, largest rank distance spanned + 1) of a collective over ``axes``."""
    n = math.prod(layout.size(a) for a in axes)
    span = max((layout.stride(a) * layout.size(a) for a in axes), default=1)
    return n, span


def collective_time(machine: Machine, layout: Layout, c: Collective) -> float:
    """Seconds for one call of ``c`` (ring / tree formulas, see the module docstring)."""
    n, span = _span(layout, c.axes)
    if n <= 1:
        return 0.0
    level = "intra" if span <= machine.devices_per_node else "inter"
    kind = {"pmax": "psum", "send": "ppermute", "recv": "ppermute", "broadcast": "psum"}.get(c.kind, c.kind)
    link = machine.link(kind, level)
    a, B, x = link.latency, link.bandwidth, float(c.nbytes)
    if c.kind == "all_gather":
        return (n - 1) * (a + x / B)
    if c.kind == "psum_scatter":
        return (n - 1) * (a + x / (n * B))
    if c.kind in ("psum", "pmax"):
        ring = 2 * (n - 1) * (a + x / (n * B))
        tree = 2 * math.ceil(math.log2(n)) * a + 2 * x / B
        return min(ring, tree)
    if c.kind in ("send", "recv"):
        return a + x / B
    if c.kind == "broadcast":
        return math.ceil(math.log2(n)) * (a + x / B)
    raise ValueError(f"collective_time: unknown kind {c.kind!r}")

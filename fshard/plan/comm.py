"""The collectives of one training step, and their times on a machine.

:func:`step_collectives` lists, for one rank, every collective a layout's step issues,
in the terms of ``fs.comm_log`` (kind, mesh axes, payload bytes per call, count): it walks
the step's phases and asks each axis rule (:data:`fshard.plan.axes.RULES`) what it issues
in each: FSDP gathers and reduce-scatters of the flat buffers (sizes from the spec rules,
see :mod:`fshard.plan.shards`), DDP buckets, HSDP all-reduces, Megatron TP region
collectives (with and without sequence parallelism), the vocab-parallel loss, pipeline
sends and receives counted on the lowered schedule itself, and the loss reductions
(``plan/axes/{fsdp,data,tp,pp}.py``). The test suite checks the list against
``comm_log`` on traced steps.

:func:`collective_time` turns one into seconds with the ring formulas (tree for small
all-reduces) over the link the mesh axes use, the hops and bytes per hop of
``fshard._wire.ring_hops`` (what ``comm_log``'s wire bytes count)::

    all_gather    (n - 1) * (a + x / B)              x: this rank's input
    psum_scatter  (n - 1) * (a + x / (n B))          x: the full input
    psum          min(2 (n - 1) (a + x / (n B)),     ring
                      2 ceil(log2 n) a + 2 x / B)    tree
    send / recv   a + x / B
    broadcast     ceil(log2 n) * (a + x / B)
    ragged_all_to_all  (n - 1) * (a + x / (n B))  x: the busiest rank's rows (routing skew)
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from fshard._wire import ring_hops
from fshard.plan.axes import RULES
from fshard.plan.axes.base import Collective, LayerShards, Step
from fshard.plan.axes.data import BUCKET_BYTES
from fshard.plan.axes.pp import layout_schedule, p2p_counts, pipeline_payload, stage_layers
from fshard.plan.layout import Layout
from fshard.plan.machine import Machine
from fshard.plan.model import ModelDesc
from fshard.plan.shards import layer_shards, stage_shards

__all__ = [
    "BUCKET_BYTES",
    "Collective",
    "collective_time",
    "log_totals",
    "p2p_counts",
    "pipeline_payload",
    "step_collectives",
]


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


def _issue(step: Step, phase: str) -> list[Collective]:
    return [c for r in RULES for c in r.collectives(step, phase)]


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
    """``fs.optim.global_norm``: one scalar all-reduce over the axes that shard parameters
    (one if they span every rank of a stage, else one per axis), plus one over pp
    (``sum_over``). Not logged."""
    by_name = {r.name: r for r in RULES}
    sharded = [a for a in layout.shape if by_name[a].shards_params and layout.size(a) > 1]
    spans = math.prod(layout.size(a) for a in sharded) == layout.n_devices // layout.pp
    groups = ([tuple(sharded)] if spans and layout.pp == 1 else [(a,) for a in sharded]) if sharded else []
    if layout.pp > 1:
        groups.append(("pp",))
    return [Collective("psum", g, 4, 1, "grad norm", None, "", logged=False) for g in groups]


def _sum(shards: Iterable[LayerShards]) -> LayerShards:
    tot = LayerShards(0, 0, 0, 0)
    for s in shards:
        tot = tot + s
    return tot


def flat_step(model: ModelDesc, layout: Layout, layers: tuple[tuple[int, int], ...] = ()) -> Step:
    """The :class:`~fshard.plan.axes.base.Step` of a flat step (no pp): the repeated block's
    sizes, and the other layers' summed (one group)."""
    rep = model.repeated
    root = _sum(layer_shards(model.layers[i], layout) for i in range(len(model.layers)) if i != rep)
    return Step(model, layout, False, layers, layer_shards(model.layers[rep], layout), root)


def _flat_collectives(model: ModelDesc, layout: Layout) -> list[Collective]:
    """``examples/train_lm.py``'s step without pp: ``gather_params`` for the root layers,
    ``scan_layers`` for the blocks, gradient accumulation over ``microbatches``."""
    step = flat_step(model, layout, tuple((i, layer.count) for i, layer in enumerate(model.layers)))
    out: list[Collective] = []
    K = layout.microbatches
    for k in range(K):
        for phase in ("gather", "layers", "loss", "regather"):
            out += _issue(step, phase)
        if k == K - 1:  # the gradients are reduced once, after the last microbatch
            out += _issue(step, "reduce") + _issue(step, "replicas")
    return out + _grad_norm(layout)


def _pipeline_collectives(model: ModelDesc, layout: Layout, pp_rank: int) -> list[Collective]:
    """``fs.sched.pipeline_step`` with ``StageFSDP`` (one gather per stage and step by
    default), TP inside each stage's body, and the lowered schedule's sends and receives."""
    sch = layout_schedule(layout)
    stages = stage_layers(model, sch.n_stages)
    held = sch.stages_of(pp_rank)
    m = layout.microbatches

    def at(j: int, s: int) -> Step:
        parts = tuple((i, k * m) for i, k in stages[s])
        sh = stage_shards(model, layout, stages[s])
        return Step(model, layout, True, parts, sh, None, j == 0, j == len(held) - 1, s == min(held), pp_rank)

    out: list[Collective] = []
    for j, s in enumerate(held):
        out += _issue(at(j, s), "gather") + _issue(at(j, s), "layers")
    whole = Step(model, layout, True, pp_rank=pp_rank)
    out += _issue(whole, "p2p")
    for j, s in enumerate(held):
        out += _issue(at(j, s), "reduce") + _issue(at(j, s), "replicas")
    out += _issue(whole, "broadcast") + _issue(whole, "loss")
    return out + _grad_norm(layout)


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
    if c.kind not in _TIMED:
        raise ValueError(f"collective_time: unknown kind {c.kind!r}")
    kind = {"pmax": "psum", "send": "ppermute", "recv": "ppermute", "broadcast": "psum"}.get(c.kind, c.kind)
    # A ragged exchange is an all_to_all_single with split sizes, priced as the busiest rank's.
    wire = "all_to_all" if c.kind == "ragged_all_to_all" else c.kind
    link = machine.link(kind, level)  # a kind without a fitted link takes the level's
    a, B, x = link.latency, link.bandwidth, float(max(c.nbytes, c.peak_nbytes))
    hops, share = ring_hops(wire, n)  # fshard._wire: the algorithm comm_log's wire bytes count
    ring = hops * (a + x / (share * B))
    if c.kind in ("psum", "pmax"):
        tree = 2 * math.ceil(math.log2(n)) * a + 2 * x / B
        return min(ring, tree)
    return ring


# The kinds the machine files have links for (pmax, send, recv and broadcast borrow one).
_TIMED = ("all_gather", "psum_scatter", "psum", "pmax", "send", "recv", "broadcast", "ppermute", "ragged_all_to_all")

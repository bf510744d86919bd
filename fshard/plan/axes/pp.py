"""Pipeline parallelism (``pp``) in the planner: schedules, stages, transfers, held microbatches.

- Layout: the schedule (``fs.sched``'s generators) must accept ``pp`` and the microbatches,
  the model must have a block per stage, and remat is not modeled with a split backward.
- The search: pp up to the number of blocks; every schedule it is given.
- Stages: the blocks cut into contiguous runs (:func:`stage_layers`), the other layers on
  the first and last stage.
- Collectives: the lowered schedule's sends and receives of one microbatch's activation
  (:func:`pipeline_payload`, counted by :func:`p2p_counts`), and the loss broadcast.
- Memory: the microbatches alive on a rank, and those between their I and W
  (:func:`held_states`, :func:`held_peak`).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

from fshard.parallel.layout import Layout, LayoutError
from fshard.plan.axes.base import AxisRule, Collective, Step, divisors
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, ModelDesc

__all__ = [
    "PP",
    "held_peak",
    "held_states",
    "layout_schedule",
    "p2p_counts",
    "pipeline_payload",
    "schedule_of",
    "stage_layers",
]


@functools.lru_cache(maxsize=512)
def _schedule(name: str, pp: int, m: int, virtual: int | None) -> Any:
    from fshard.sched.registry import build_schedule

    return build_schedule(name, pp, m, n_virtual=virtual)


def schedule_of(key: tuple) -> Any:
    """The schedule of ``(name, pp, microbatches, virtual)`` (cached)."""
    return _schedule(*key)


def _splits_backward(schedule: Any) -> bool:
    from fshard.sched.ir import Kind

    return any(p.kind is Kind.I for row in schedule.actions for a in row for p in a.parts)


def layout_schedule(layout: Layout) -> Any:
    """The pipeline schedule (``fs.sched``) of ``layout``, or None without pp (cached).

    Raises:
      LayoutError: the generator rejects the sizes (its reason is quoted).
    """
    if layout.pp == 1:
        return None
    try:
        return _schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    except (ValueError, KeyError) as e:
        raise LayoutError(
            f"Layout.schedule {layout.schedule!r} on pp={layout.pp} with microbatches={layout.microbatches}: {e}"
        ) from None


def stage_layers(model: ModelDesc, n_stages: int) -> list[list[tuple[int, int]]]:
    """Per pipeline stage, ``(layer index, how many)`` of the layers it runs, in order.

    The repeated layer kind (the blocks) is cut into ``n_stages`` contiguous runs as even
    as possible (``examples/train_lm.py``'s cut: stage s gets blocks
    ``[s * L // n, (s + 1) * L // n)``); the layers before it go to the first stage, the
    layers after it to the last.
    """
    rep = model.repeated
    L = model.layers[rep].count
    cuts = [s * L // n_stages for s in range(n_stages + 1)]
    out: list[list[tuple[int, int]]] = []
    for s in range(n_stages):
        parts: list[tuple[int, int]] = []
        if s == 0:
            parts += [(i, model.layers[i].count) for i in range(rep)]
        if cuts[s + 1] > cuts[s]:
            parts.append((rep, cuts[s + 1] - cuts[s]))
        if s == n_stages - 1:
            parts += [(i, model.layers[i].count) for i in range(rep + 1, len(model.layers))]
        out.append(parts)
    return out


def pipeline_payload(model: ModelDesc, layout: Layout) -> int:
    """Bytes of one activation (or its gradient) sent between pipeline stages: a
    microbatch's ``(b, T, D)`` hidden state, ``(b, T / tp, D)`` with sequence parallelism
    (``T / cp`` with context parallelism)."""
    t = model.seq_len // (layout.tp if layout.sequence_parallel else 1) // layout.cp
    return int(layout.microbatch_size * t * model.hidden * DTYPE_BYTES[layout.dtype])


_P2P: dict[int, tuple[object, tuple[tuple[int, int], ...]]] = {}


def p2p_counts(schedule: Any) -> tuple[tuple[int, int], ...]:
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


def held_states(schedule: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, ``(chunks alive, chunks between their I and their W)`` after each change,
    walking the rank's actions in list order (a rank runs them one after another, so the
    order of these events does not depend on the costs).

    A chunk (stage, microbatch) is alive from the start of its F to the end of its W or
    full B (as ``fs.sched.simulate``'s peak counts it); it is between I and W from the
    end of its I to the end of its W: then it also holds the gradients that I captured
    for W (``LayerDesc.wgrad_bytes``). At the end of an action its releases come before
    the next action's acquisitions.

    Args:
      schedule: an ``fs.sched.Schedule`` (compute-only or lowered).

    Returns:
      One tuple of states per rank, starting at ``(0, 0)``.
    """
    from fshard.sched.ir import Kind

    out = []
    for actions in schedule.actions:
        alive = pending = 0
        states = [(0, 0)]
        for a in actions:
            parts = [p for p in a.parts if p.kind in (Kind.F, Kind.B, Kind.I, Kind.W)]
            if not parts:
                continue
            alive += sum(p.kind is Kind.F for p in parts)
            states.append((alive, pending))
            pending += sum(p.kind is Kind.I for p in parts) - sum(p.kind is Kind.W for p in parts)
            alive -= sum(p.kind in (Kind.B, Kind.W) for p in parts)
            states.append((alive, pending))
        out.append(tuple(states))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def held_states_of(schedule_key: tuple) -> tuple[tuple[tuple[int, int], ...], ...]:
    """:func:`held_states` of the schedule of ``(name, pp, microbatches, virtual)`` (cached)."""
    return held_states(schedule_of(schedule_key))


def held_peak(states: Sequence[tuple[int, int]], act_bytes: float, wgrad_bytes: float) -> tuple[int, int]:
    """The state of ``states`` (one rank's, from :func:`held_states`) that holds the most
    bytes, a chunk alive costing ``act_bytes`` and one between its I and W ``wgrad_bytes``
    more: ``(chunks alive, chunks between I and W)`` then."""
    return max(states, key=lambda s: (s[0] * act_bytes + s[1] * wgrad_bytes, s))


class PipelineParallel(AxisRule):
    name = "pp"

    def check(self, layout: Layout, model: ModelDesc) -> None:
        if layout.pp == 1:
            return
        sch = layout_schedule(layout)
        if model.n_blocks < sch.n_stages:
            raise LayoutError(
                f"Layout: schedule {layout.schedule!r} on pp={layout.pp} has {sch.n_stages} stages "
                f"but model {model.name!r} has {model.n_blocks} blocks"
            )
        if layout.remat and _splits_backward(sch):
            # Each W group's pass recomputes the checkpointed block (comm_log, pp=2 x tp=2,
            # zb: 13 TP psums per block and microbatch instead of 5).
            raise LayoutError(
                f"Layout.remat with schedule {layout.schedule!r} (backward split into I and W) "
                f"is not modeled: fshard's executor recomputes a checkpointed block in each W "
                f"pass; use remat with 1f1b, gpipe or interleaved"
            )

    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        return [p for p in divisors(rest) if p <= model.n_blocks]

    def choices(self, options: Any, mesh: Mapping[str, int]) -> dict[str, list[Any]]:
        # (schedule, virtual stages per rank): the generators' default number of virtual stages
        return {"schedule": [(s, None) for s in options.schedules] if mesh["pp"] > 1 else [("1f1b", None)]}

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        if not step.pipeline:
            return []
        if phase == "p2p":
            act = pipeline_payload(step.model, step.layout)
            sends, recvs = p2p_counts(layout_schedule(step.layout))[step.pp_rank]
            out = []
            if sends:
                out.append(Collective("send", ("pp",), act, sends, "p2p", None, "p2p"))
            if recvs:
                out.append(Collective("recv", ("pp",), act, recvs, "p2p", None, "p2p"))
            return out
        if phase == "broadcast":
            return [Collective("broadcast", ("pp",), 16, 1, "loss broadcast")]
        return []


PP = PipelineParallel()

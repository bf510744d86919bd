"""Lowering passes: compute-only schedule -> schedule a runtime can execute.

:func:`lower` adds SEND/RECV actions for every stage boundary that crosses ranks;
:func:`add_unshard_reshard` and :func:`add_reduce_grad` add the optional FSDP
hooks. Each pass is a pure function Schedule -> Schedule.
"""

from __future__ import annotations

from collections import defaultdict, deque

import attrs

from fshard.sched.ir import Action, Kind, Schedule, ScheduleError
from fshard.sched.simulate import _costs, _ticks

__all__ = ["add_reduce_grad", "add_unshard_reshard", "lower"]


def _outputs(part: Action, schedule: Schedule, rank: int) -> list[tuple[Action, Action, int]]:
    """(send on this rank, matching recv, receiving rank) for each cross-rank output."""
    s, mb = part.stage, part.microbatch
    if part.kind is Kind.F and s + 1 < schedule.n_stages:
        peer, send, recv = s + 1, Kind.SEND_F, Kind.RECV_F
    elif part.kind in (Kind.B, Kind.I) and s > 0:
        peer, send, recv = s - 1, Kind.SEND_B, Kind.RECV_B
    else:
        return []
    dest = schedule.rank_of(peer)
    if dest == rank:
        return []
    return [(Action._trusted(send, s, mb), Action._trusted(recv, peer, mb), dest)]


def lower(schedule: Schedule) -> Schedule:
    """Adds matched SEND/RECV actions between ranks.

    After an F whose next stage lives on another rank the sender gets
    ``SEND_F(stage, mb)`` and the receiver ``RECV_F(stage + 1, mb)``; after a B or
    I whose previous stage lives elsewhere, ``SEND_B(stage, mb)`` and
    ``RECV_B(stage - 1, mb)``. Co-located consecutive stages (the tip of a V)
    exchange nothing. Each RECV is placed at the point where, with unit costs,
    the data would have been sent: before the first compute action of the
    receiver that starts no earlier. Hence for every pair of ranks the receives
    come in the same order as the sends, and running every rank's list with
    non-blocking sends and blocking receives cannot deadlock. A runtime should
    still post a RECV when it reaches it and wait on it only before the compute
    action that consumes it.

    Args:
        schedule: a compute-only schedule (FSDP hooks are kept in place).

    Returns:
        The lowered schedule (same sizes, placement and name).

    Raises:
        ScheduleError: the schedule already has SEND/RECV actions, or its compute
            order deadlocks (the message names each stuck rank's head action).
    """
    if any(a.is_comm for row in schedule.actions for a in row):
        raise ScheduleError(
            f"schedule {schedule.name!r} already has SEND/RECV actions; lower() takes a "
            f"compute-only schedule (use schedule.compute_only() to strip them)"
        )
    jobs, ticks, _ = _ticks(schedule, _costs(1, 1, 1, 0))
    inbox: list[list[tuple[int, int, int, Action]]] = [[] for _ in schedule.actions]
    sends: dict[tuple[int, int], list[Action]] = {}
    starts: dict[tuple[int, int], int] = {}
    for rank, row in enumerate(jobs):
        seq = 0
        for job, (start, end) in zip(row, ticks[rank]):
            starts[(rank, job.index)] = start
            for part in job.action.parts:
                for send, recv, dest in _outputs(part, schedule, rank):
                    sends.setdefault((rank, job.index), []).append(send)
                    inbox[dest].append((end, rank, seq, recv))
                    seq += 1
    rows = []
    for rank, row in enumerate(schedule.actions):
        pending = deque(sorted(inbox[rank], key=lambda item: item[:3]))
        out: list[Action] = []
        for index, action in enumerate(row):
            if action.is_compute:
                start = starts[(rank, index)]
                while pending and pending[0][0] <= start:
                    out.append(pending.popleft()[3])
            out.append(action)
            out.extend(sends.get((rank, index), ()))
        if pending:
            raise ScheduleError(f"rank {rank}: receives {[str(p[3]) for p in pending]} have no consumer on that rank")
        rows.append(out)
    return attrs.evolve(schedule, actions=rows)


def add_unshard_reshard(schedule: Schedule, *, max_active_stages: int = 3) -> Schedule:
    """Adds FSDP ``UNSHARD``/``RESHARD`` around each rank's compute on a stage.

    Looking ahead over the next ``max_active_stages`` distinct stages a rank
    computes on, a stage is unsharded before its first compute in that window
    and resharded once it leaves the window, so parameters are gathered once
    per window of consecutive use rather than once per microbatch.

    Args:
        schedule: a schedule (compute-only or lowered) without FSDP hooks.
        max_active_stages: how many stages may be unsharded at once on a rank
            (optional, default 3).

    Returns:
        The schedule with UNSHARD/RESHARD actions added.

    Raises:
        ValueError: max_active_stages < 1.
    """
    if max_active_stages < 1:
        raise ValueError(f"max_active_stages must be >= 1, got {max_active_stages}")
    rows = []
    for row in schedule.actions:
        stage_seq = [p.stage for a in row if a.is_compute for p in a.parts]
        out: list[Action] = []
        active: list[int] = []
        cursor = 0
        for action in row:
            if action.is_compute:
                window: list[int] = []
                for stage in stage_seq[cursor:]:
                    if stage not in window:
                        window.append(stage)
                        if len(window) == max_active_stages:
                            break
                for stage in [s for s in active if s not in window]:
                    out.append(Action(Kind.RESHARD, stage))
                    active.remove(stage)
                for part in action.parts:
                    if part.stage not in active:
                        out.append(Action(Kind.UNSHARD, part.stage))
                        active.append(part.stage)
                cursor += len(action.parts)
            out.append(action)
        out.extend(Action(Kind.RESHARD, s) for s in active)
        rows.append(out)
    return attrs.evolve(schedule, actions=rows)


def add_reduce_grad(schedule: Schedule) -> Schedule:
    """Adds one ``REDUCE_GRAD(stage)`` right after each stage's last weight gradient.

    That is the last B or W of the stage on its rank, the point where the
    stage's data-parallel gradient reduction (and any 1/m scaling) may start.

    Args:
        schedule: a schedule (compute-only or lowered) without REDUCE_GRAD.

    Returns:
        The schedule with REDUCE_GRAD actions added.
    """
    rows = []
    for row in schedule.actions:
        last: dict[int, int] = {}
        for index, action in enumerate(row):
            for part in action.parts:
                if part.kind in (Kind.B, Kind.W):
                    last[part.stage] = index
        after: defaultdict[int, list[Action]] = defaultdict(list)
        for stage, index in sorted(last.items()):
            after[index].append(Action(Kind.REDUCE_GRAD, stage))
        rows.append([x for i, a in enumerate(row) for x in [a, *after[i]]])
    return attrs.evolve(schedule, actions=rows)

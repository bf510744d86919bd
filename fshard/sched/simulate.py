"""Discrete-event simulation of a schedule: makespan, bubble, activation peaks.

Cost model (pipeline_anchors.md sections 2.1 and 3.1): ``f``, ``b`` and ``w`` are
the per-microbatch costs of one rank's whole layer set (1/p of the model), so a
chunk action costs f/v (F), b/v (I), w/v (W) or (b+w)/v (full B). Every rank starts
at t=0 and runs its compute actions in list order, each as soon as the rank is
free and its inputs exist; ``comm`` is added on cross-rank edges only. An
OVERLAP_F_B pair starts once *both* halves' inputs are ready and takes F + B.
SEND/RECV and FSDP actions cost nothing here. Times are exact Fractions.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple, Union

import attrs

from fshard.sched.ir import COMPUTE_KINDS, Action, Kind, Schedule, ScheduleError

__all__ = ["SimReport", "Span", "simulate", "timeline"]

Number = Union[int, float, Fraction]


class Span(NamedTuple):
    """One compute action placed in time.

    Attributes:
        rank: the rank that runs it.
        index: its position in that rank's action list.
        action: the action (possibly an OVERLAP_F_B).
        start: start time.
        end: end time.
    """

    rank: int
    index: int
    action: Action
    start: Fraction
    end: Fraction


class _Costs(NamedTuple):
    f: Fraction
    b: Fraction
    w: Fraction
    comm: Fraction

    def of(self, part: Action, v: int) -> Fraction:
        per_rank = {Kind.F: self.f, Kind.I: self.b, Kind.W: self.w, Kind.B: self.b + self.w}[part.kind]
        return per_rank / v


def _costs(f: Number, b: Number, w: Number, comm: Number) -> _Costs:
    values = {"f": f, "b": b, "w": w, "comm": comm}
    for name, value in values.items():
        if value < 0 or (name != "comm" and name != "w" and value == 0):
            raise ValueError(f"cost {name}={value} must be > 0 (w and comm may be 0)")
    return _Costs(*(Fraction(values[k]) for k in ("f", "b", "w", "comm")))


def _key(part: Action) -> tuple[str, int, int | None]:
    # B and I both publish the input gradient; W only needs "I ran".
    return ("G" if part.kind in (Kind.B, Kind.I) else part.kind.value, part.stage, part.microbatch)


def _inputs(part: Action, n_stages: int) -> list[tuple[str, int, int | None]]:
    s, mb = part.stage, part.microbatch
    if part.kind is Kind.F:
        return [("F", s - 1, mb)] if s > 0 else []
    if part.kind is Kind.W:
        return [("G", s, mb)]
    deps = [("F", s, mb)]
    if s < n_stages - 1:
        deps.append(("G", s + 1, mb))
    return deps


class _Job(NamedTuple):
    index: int
    action: Action
    cost: int
    deps: tuple[tuple[str, int, int | None], ...]
    outputs: tuple[tuple[str, int, int | None], ...]


def _jobs(schedule: Schedule, costs: _Costs) -> tuple[list[list[_Job]], int, int]:
    """Compute actions per rank with integer costs in ticks of 1/scale time units."""
    v = schedule.n_virtual
    unit = [costs.f / v, costs.b / v, costs.w / v, costs.comm]
    scale = math.lcm(*(u.denominator for u in unit))
    tick = {k: int(costs.of(Action(k, 0, 0), v) * scale) for k in (Kind.F, Kind.B, Kind.I, Kind.W)}
    rows = []
    for row in schedule.actions:
        jobs = []
        for index, action in enumerate(row):
            if action.kind not in COMPUTE_KINDS:
                continue
            if not action.sub:
                deps = tuple(_inputs(action, schedule.n_stages))
                jobs.append(_Job(index, action, tick[action.kind], deps, (_key(action),)))
                continue
            outputs = tuple(_key(p) for p in action.parts)
            deps = tuple(d for p in action.parts for d in _inputs(p, schedule.n_stages) if d not in outputs)
            cost = sum(tick[p.kind] for p in action.parts)
            jobs.append(_Job(index, action, cost, deps, outputs))
        rows.append(jobs)
    return rows, scale, int(costs.comm * scale)


def timeline(
    schedule: Schedule, *, f: Number = 1, b: Number = 1, w: Number = 1, comm: Number = 0
) -> tuple[tuple[Span, ...], ...]:
    """Places every compute action of every rank in time (ASAP, list order per rank).

    Args:
        schedule: the schedule; SEND/RECV and FSDP actions are skipped.
        f: forward cost per microbatch of a rank's whole layer set (optional, default 1).
        b: backward-input cost, as f (optional, default 1).
        w: backward-weight cost, as f (optional, default 1); full B costs b + w.
        comm: latency added on each cross-rank dependency (optional, default 0).

    Returns:
        Per rank, the spans of its compute actions in list order.

    Raises:
        ScheduleError: no rank can start its next compute action (deadlock), or
            an action's input is never produced; the message names each stuck
            rank's head action and what it waits for.
        ValueError: a negative cost, or f or b equal to 0.
    """
    rows, ticks, scale = _ticks(schedule, _costs(f, b, w, comm))
    return tuple(
        tuple(
            Span(r, j.index, j.action, Fraction(t0, scale), Fraction(t1, scale)) for j, (t0, t1) in zip(jobs, ticks[r])
        )
        for r, jobs in enumerate(rows)
    )


def _ticks(schedule: Schedule, costs: _Costs) -> tuple[list[list[_Job]], list[list[tuple[int, int]]], int]:
    """The ASAP sweep in integer ticks: jobs per rank, (start, end) per job, ticks per unit."""
    rows, scale, comm_ticks = _jobs(schedule, costs)
    done: dict[tuple[str, int, int | None], tuple[int, int]] = {}
    ticks: list[list[tuple[int, int]]] = [[] for _ in rows]
    free = [0] * len(rows)
    heads = [0] * len(rows)
    progressed = True
    while progressed:
        progressed = False
        for rank, jobs in enumerate(rows):
            while heads[rank] < len(jobs):
                job = jobs[heads[rank]]
                start = free[rank]
                for dep in job.deps:
                    if dep not in done:
                        break
                    end, dep_rank = done[dep]
                    start = max(start, end + comm_ticks if dep_rank != rank else end)
                else:
                    free[rank] = start + job.cost
                    for out in job.outputs:
                        done[out] = (free[rank], rank)
                    ticks[rank].append((start, free[rank]))
                    heads[rank] += 1
                    progressed = True
                    continue
                break
    stuck = [(r, (jobs[heads[r]].index, jobs[heads[r]].action)) for r, jobs in enumerate(rows) if heads[r] < len(jobs)]
    if stuck:
        raise ScheduleError(_stuck_message(stuck, schedule, done))
    return rows, ticks, scale


def _stuck_message(stuck: list[tuple[int, tuple[int, Action]]], schedule: Schedule, done: dict) -> str:
    lines = [
        f"deadlock in schedule {schedule.name!r}: no rank can start its next "
        f"compute action (n_ranks={schedule.n_ranks}, n_stages={schedule.n_stages}, "
        f"n_microbatches={schedule.n_microbatches})"
    ]
    for rank, (index, action) in stuck:
        missing = [
            d
            for p in action.parts
            for d in _inputs(p, schedule.n_stages)
            if d not in done and d not in {_key(q) for q in action.parts}
        ]
        waits = ", ".join(_describe(d, schedule) for d in missing)
        lines.append(f"  rank {rank}: head action #{index} {action} waits for {waits}")
    return "\n".join(lines)


def _describe(dep: tuple[str, int, int | None], schedule: Schedule) -> str:
    kind, stage, mb = dep
    what = "B or I" if kind == "G" else kind
    return f"{what} of stage {stage} microbatch {mb} (rank {schedule.rank_of(stage)})"


@attrs.frozen(kw_only=True)
class SimReport:
    """Result of :func:`simulate`. Times are exact Fractions (compare with floats freely).

    Attributes:
        makespan: time when the last rank finishes (T).
        ideal: busy time of one rank, m * (f + b + w).
        peak_activations: per rank, the most (chunk, microbatch) activations alive
            at once: counted from an F's start to the end of its W or full B.
        busy: per rank, total compute time.
        first_start: per rank, start of its first compute action.
        last_end: per rank, end of its last compute action.
        n_virtual: stages per rank v (to convert peaks to whole-stage units).
        spans: per rank, every compute action placed in time.
    """

    makespan: Fraction
    ideal: Fraction
    peak_activations: tuple[int, ...]
    busy: tuple[Fraction, ...]
    first_start: tuple[Fraction, ...]
    last_end: tuple[Fraction, ...]
    n_virtual: int
    spans: tuple[tuple[Span, ...], ...] = attrs.field(repr=False, eq=False)

    @property
    def bubble(self) -> Fraction:
        """Makespan minus ideal, T - m(f+b+w)."""
        return self.makespan - self.ideal

    @property
    def bubble_fraction(self) -> Fraction:
        """(T - ideal) / T: the share of the step a rank spends idle."""
        return self.bubble / self.makespan

    @property
    def bubble_ratio(self) -> Fraction:
        """(T - ideal) / ideal: Narayanan et al.'s bubble ratio."""
        return self.bubble / self.ideal

    @property
    def idle(self) -> tuple[Fraction, ...]:
        """Per rank, makespan minus busy time."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def peak_stage_activations(self) -> tuple[Fraction, ...]:
        """Per rank, peak activations in whole-stage units (chunk count / v)."""
        return tuple(Fraction(p, self.n_virtual) for p in self.peak_activations)

    def __str__(self) -> str:
        peaks = ", ".join(str(p) for p in self.peak_activations)
        return (
            f"makespan {float(self.makespan):g} (ideal {float(self.ideal):g}), bubble "
            f"{float(self.bubble_fraction):.1%} of T; peak activations per rank [{peaks}]"
        )


def _peak(spans: tuple[Span, ...]) -> int:
    events: list[tuple[Fraction, int]] = []
    for span in spans:
        for part in span.action.parts:
            if part.kind is Kind.F:
                events.append((span.start, +1))
            elif part.kind in (Kind.B, Kind.W):
                events.append((span.end, -1))
    # Releases sort before acquires at equal times (-1 < +1).
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def simulate(schedule: Schedule, f: Number = 1, b: Number = 1, w: Number = 1, comm: Number = 0) -> SimReport:
    """Simulates one isolated step of ``schedule`` and reports its timing and memory.

    Args:
        schedule: a compute-only or lowered schedule.
        f: forward cost per microbatch for one rank's whole layer set (optional, default 1).
        b: backward-input (I) cost, as f (optional, default 1).
        w: backward-weight (W) cost, as f (optional, default 1); full B costs b + w.
        comm: latency on each cross-rank dependency; same-rank stage hand-offs
            (V placement) are free (optional, default 0).

    Returns:
        A :class:`SimReport`.

    Raises:
        ScheduleError: the schedule deadlocks (names each stuck rank's head action).
        ValueError: a negative cost, or f or b equal to 0.
    """
    costs = _costs(f, b, w, comm)
    spans = timeline(schedule, f=f, b=b, w=w, comm=comm)
    zero = Fraction(0)
    last_end = tuple(s[-1].end if s else zero for s in spans)
    return SimReport(
        makespan=max(last_end),
        ideal=schedule.n_microbatches * (costs.f + costs.b + costs.w),
        peak_activations=tuple(_peak(s) for s in spans),
        busy=tuple(sum((x.end - x.start for x in s), zero) for s in spans),
        first_start=tuple(s[0].start if s else zero for s in spans),
        last_end=last_end,
        n_virtual=schedule.n_virtual,
        spans=spans,
    )

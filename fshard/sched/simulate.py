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

from fractions import Fraction
from typing import NamedTuple, Union

import attrs

from fshard.sched.ir import Action, Kind, Schedule, ScheduleError

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
        per_rank = {Kind.F: self.f, Kind.I: self.b, Kind.W: self.w,
                    Kind.B: self.b + self.w}[part.kind]
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


def timeline(schedule: Schedule, *, f: Number = 1, b: Number = 1, w: Number = 1,
             comm: Number = 0) -> tuple[tuple[Span, ...], ...]:
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
    costs = _costs(f, b, w, comm)
    v, n_stages = schedule.n_virtual, schedule.n_stages
    todo = [[(i, a) for i, a in enumerate(row) if a.is_compute] for row in schedule.actions]
    spans: list[list[Span]] = [[] for _ in todo]
    done: dict[tuple[str, int, int | None], tuple[Fraction, int]] = {}
    free = [Fraction(0)] * len(todo)
    heads = [0] * len(todo)
    progressed = True
    while progressed:
        progressed = False
        for rank, row in enumerate(todo):
            while heads[rank] < len(row):
                index, action = row[heads[rank]]
                ready = _ready(action, rank, done, schedule, costs.comm)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + sum(costs.of(p, v) for p in action.parts)
                for part in action.parts:
                    done[_key(part)] = (end, rank)
                spans[rank].append(Span(rank, index, action, start, end))
                free[rank] = end
                heads[rank] += 1
                progressed = True
    stuck = [(r, row[heads[r]]) for r, row in enumerate(todo) if heads[r] < len(row)]
    if stuck:
        raise ScheduleError(_stuck_message(stuck, schedule, done))
    return tuple(tuple(s) for s in spans)


def _ready(action: Action, rank: int, done: dict, schedule: Schedule,
           comm: Fraction) -> Fraction | None:
    own = {_key(p) for p in action.parts}
    ready = Fraction(0)
    for part in action.parts:
        for dep in _inputs(part, schedule.n_stages):
            if dep in own:
                continue
            if dep not in done:
                return None
            end, dep_rank = done[dep]
            ready = max(ready, end + (comm if dep_rank != rank else 0))
    return ready


def _stuck_message(stuck: list[tuple[int, tuple[int, Action]]], schedule: Schedule,
                   done: dict) -> str:
    lines = [f"deadlock in schedule {schedule.name!r}: no rank can start its next "
             f"compute action (n_ranks={schedule.n_ranks}, n_stages={schedule.n_stages}, "
             f"n_microbatches={schedule.n_microbatches})"]
    for rank, (index, action) in stuck:
        missing = [d for p in action.parts for d in _inputs(p, schedule.n_stages)
                   if d not in done and d not in {_key(q) for q in action.parts}]
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
        return (f"makespan {float(self.makespan):g} (ideal {float(self.ideal):g}), bubble "
                f"{float(self.bubble_fraction):.1%} of T; peak activations per rank [{peaks}]")


def _peak(spans: tuple[Span, ...], costs: _Costs, v: int) -> int:
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


def simulate(schedule: Schedule, f: Number = 1, b: Number = 1, w: Number = 1,
             comm: Number = 0) -> SimReport:
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
        peak_activations=tuple(_peak(s, costs, schedule.n_virtual) for s in spans),
        busy=tuple(sum((x.end - x.start for x in s), zero) for s in spans),
        first_start=tuple(s[0].start if s else zero for s in spans),
        last_end=last_end,
        n_virtual=schedule.n_virtual,
        spans=spans,
    )

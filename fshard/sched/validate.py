"""Schedule validation: complete work, dependency order, matched transfers, no deadlock.

:func:`validate` runs these checks in turn and raises :class:`ScheduleError` naming the
rank, the action and the sizes involved:

1. Work: every (stage, microbatch) runs F exactly once and either one full B or
   one I and one W.
2. Transfers (lowered schedules only): every cross-rank stage boundary has one
   SEND on the producer's rank and one RECV on the consumer's rank, and no SEND or
   RECV joins two stages of the same rank.
3. Execution: all ranks' lists are run together. Sends do not block; a RECV
   blocks until its sender has issued the matching SEND, and messages between
   two ranks are matched in order (as NCCL and gloo do), so a receive that
   finds a different message at the head of its channel is an error. Inputs
   must exist before use: an F needs the previous stage's F (same rank) or its
   RECV_F, a B/I needs its own F and the next stage's B/I or its RECV_B, a W
   needs its I. A compute-only schedule (no SEND/RECV) is run as data flow:
   cross-rank inputs are waited for instead of received.
4. Batched transfers (``p2p="batched"``, the default): each run of consecutive
   SEND/RECV actions on a rank is one batch, as a runtime issues it with
   ``batch_isend_irecv``; a batch completes only once every op in it is matched
   by its peer's batch, so a pair of ranks that each send before receiving in
   separate batches deadlocks, as NCCL would.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque

from fshard.sched.ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Schedule, ScheduleError

__all__ = ["ScheduleError", "validate"]

_MAX_LINES = 12
_NONE: frozenset = frozenset()


def _sizes(s: Schedule) -> str:
    return f"schedule {s.name!r} (n_ranks={s.n_ranks}, n_stages={s.n_stages}, n_microbatches={s.n_microbatches})"


def _fail(schedule: Schedule, headline: str, problems: list[str]) -> ScheduleError:
    shown = problems[:_MAX_LINES]
    more = len(problems) - len(shown)
    tail = [f"  ... and {more} more"] if more > 0 else []
    return ScheduleError("\n".join([f"{headline} in {_sizes(schedule)}:"] + [f"  {p}" for p in shown] + tail))


def _check_work(schedule: Schedule) -> None:
    count: Counter[tuple[Kind, int, int | None]] = Counter(
        (p.kind, p.stage, p.microbatch) for row in schedule.actions for a in row if a.is_compute for p in a.parts
    )
    problems = []
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            n = [count[(k, stage, mb)] for k in (Kind.F, Kind.B, Kind.I, Kind.W)]
            if n[0] == 1 and n[1:] in ([1, 0, 0], [0, 1, 1]):
                continue
            where = f"stage {stage} microbatch {mb} (rank {schedule.rank_of(stage)})"
            if n[0] != 1:
                problems.append(
                    f"{where}: F runs {n[0]} times, expected once" + _at(schedule, Action(Kind.F, stage, mb))
                )
            if n[1:] not in ([1, 0, 0], [0, 1, 1]):
                problems.append(
                    f"{where}: backward runs as B x{n[1]}, I x{n[2]}, W x{n[3]}; expected one B, or one I and one W"
                )
    if problems:
        raise _fail(schedule, "incomplete or repeated work", problems)


def _at(schedule: Schedule, action: Action) -> str:
    places = [
        f"rank {r} #{i}" for r, row in enumerate(schedule.actions) for i, a in enumerate(row) if action in a.parts
    ]
    return f" (at {', '.join(places)})" if len(places) > 1 else ""


def _check_transfers(schedule: Schedule) -> None:
    count: Counter[tuple] = Counter()
    problems = []
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if action.is_comm:
                count[action] += 1
                if schedule.peer_rank(action) == rank:
                    problems.append(
                        f"rank {rank} #{index} {action}: stages {action.stage} and "
                        f"{action.peer_stage} are both on rank {rank}; they hand "
                        f"over locally and need no transfer"
                    )
    for stage in range(schedule.n_stages - 1):
        if schedule.rank_of(stage) == schedule.rank_of(stage + 1):
            continue
        for mb in range(schedule.n_microbatches):
            for kind, at in (
                (Kind.SEND_F, stage),
                (Kind.RECV_F, stage + 1),
                (Kind.SEND_B, stage + 1),
                (Kind.RECV_B, stage),
            ):
                # Actions are tuples, so this finds Action(kind, at, mb) without building it.
                n = count[(kind, at, mb, ())]
                if n != 1:
                    problems.append(
                        f"rank {schedule.rank_of(at)}: {Action(kind, at, mb)} appears {n} times, expected once"
                    )
    if problems:
        raise _fail(schedule, "unmatched transfers", problems)


class _Run:
    """Executes all ranks' lists together; see the module docstring for the rules."""

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.lowered = schedule.is_lowered
        self.ranks = tuple(schedule.rank_of(s) for s in range(schedule.n_stages))
        self.local: list[set[tuple[str, int, int | None]]] = [set() for _ in schedule.actions]
        self.produced: set[tuple[str, int, int | None]] = set()
        self.channels: defaultdict[tuple[int, int], deque[Action]] = defaultdict(deque)
        self.heads = [0] * schedule.n_ranks
        self.unsharded: list[set[int]] = [set() for _ in schedule.actions]
        self.hooked = [{a.stage for a in row if a.kind is Kind.UNSHARD} for row in schedule.actions]
        self.weights: Counter[tuple[int, int]] = Counter()
        self.reduced: set[tuple[int, int]] = set()
        self.split = {
            (a.stage, a.microbatch) for row in schedule.actions for x in row for a in x.parts if a.kind is Kind.I
        }

    def error(self, rank: int, message: str) -> ScheduleError:
        index = self.heads[rank]
        head = self.s.actions[rank][index]
        return _fail(self.s, "invalid order", [f"rank {rank}: head action #{index} {head}: {message}"])

    def later(self, rank: int, action: Action) -> int | None:
        row = self.s.actions[rank]
        for index in range(self.heads[rank] + 1, len(row)):
            if action in row[index].parts:
                return index
        return None

    def need(self, rank: int, key: tuple[str, int, int | None], owned: set) -> bool:
        """True if the input is there; False to wait; raises if it can never come."""
        if key in self.local[rank] or key in owned:
            return True
        if key[0] in ("F", "G") and self.ranks[key[1]] != rank:
            return key in self.produced
        producer = self.producer(key)
        later = self.later(rank, producer)
        if later is None:
            raise self.error(rank, f"needs {producer}, which rank {rank} never runs")
        raise self.error(rank, f"runs before {producer} (#{later}) on the same rank")

    def inputs(self, part: Action) -> list[tuple[str, int, int | None]]:
        s, mb, last, ranks = part.stage, part.microbatch, self.s.n_stages - 1, self.ranks
        if part.kind is Kind.W:
            return [("I", s, mb)]
        cross = self.lowered and self.s.n_ranks > 1
        if part.kind is Kind.F:
            if s == 0:
                return []
            if cross and ranks[s - 1] != ranks[s]:
                return [("RF", s, mb)]
            return [("F", s - 1, mb)]
        if s == last:
            return [("F", s, mb)]
        if cross and ranks[s + 1] != ranks[s]:
            return [("F", s, mb), ("RB", s, mb)]
        return [("F", s, mb), ("G", s + 1, mb)]

    def producer(self, key: tuple[str, int, int | None]) -> Action:
        kind, stage, mb = key
        if kind == "G":
            return Action(Kind.I if (stage, mb) in self.split else Kind.B, stage, mb)
        named = {"RF": Kind.RECV_F, "RB": Kind.RECV_B}
        return Action(named.get(kind, kind), stage, mb)

    def compute(self, rank: int, action: Action) -> bool:
        owned: set[tuple[str, int, int | None]] = set()
        for part in action.parts:
            if part.stage in self.hooked[rank] and part.stage not in self.unsharded[rank]:
                raise self.error(rank, f"stage {part.stage} is resharded here (UNSHARD it first)")
            for key in self.inputs(part):
                if not self.need(rank, key, owned):
                    return False
            owned |= _outputs(part)
        for part in action.parts:
            if part.kind in (Kind.B, Kind.W):
                self.weights[(rank, part.stage)] += 1
        self.local[rank] |= owned
        self.produced |= owned
        return True

    def comm(self, rank: int, action: Action) -> bool:
        peer = self.ranks[action.peer_stage]
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            key = ("F" if action.kind is Kind.SEND_F else "G", action.stage, action.microbatch)
            self.need(rank, key, _NONE)
            self.channels[(rank, peer)].append(action)
            return True
        channel = self.channels[(peer, rank)]
        if not channel:
            return False
        send = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
        if channel[0] != (send, action.peer_stage, action.microbatch, ()):
            expected = Action(send, action.peer_stage, action.microbatch)
            raise self.error(
                rank,
                f"expects {expected} from rank {peer}, but the next message "
                f"rank {peer} sent to rank {rank} is {channel[0]}; receives "
                f"between two ranks must come in the order of the sends",
            )
        channel.popleft()
        tag = "RF" if action.kind is Kind.RECV_F else "RB"
        self.local[rank].add((tag, action.stage, action.microbatch))
        return True

    def hook(self, rank: int, action: Action) -> bool:
        stage, active = action.stage, self.unsharded[rank]
        if action.kind is Kind.UNSHARD:
            if stage in active:
                raise self.error(rank, f"stage {stage} is already unsharded")
            active.add(stage)
        elif action.kind is Kind.RESHARD:
            if stage not in active:
                raise self.error(rank, f"stage {stage} is not unsharded")
            active.discard(stage)
        elif (rank, stage) in self.reduced:
            raise self.error(rank, f"stage {stage} already reduced its gradients")
        elif self.weights[(rank, stage)] != self.s.n_microbatches:
            raise self.error(
                rank,
                f"only {self.weights[(rank, stage)]} of "
                f"{self.s.n_microbatches} weight gradients of stage {stage} exist",
            )
        else:
            self.reduced.add((rank, stage))
        return True

    def step(self, rank: int) -> bool:
        action = self.s.actions[rank][self.heads[rank]]
        if action.kind in COMPUTE_KINDS:
            return self.compute(rank, action)
        if action.kind in COMM_KINDS:
            return self.comm(rank, action)
        return self.hook(rank, action)

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for rank, row in enumerate(self.s.actions):
                while self.heads[rank] < len(row) and self.step(rank):
                    self.heads[rank] += 1
                    progressed = True
        stuck = [r for r, row in enumerate(self.s.actions) if self.heads[r] < len(row)]
        if stuck:
            raise _fail(self.s, "deadlock: no rank can make progress", [self.waiting(r) for r in stuck])
        left = [
            f"rank {src} sent {a} to rank {dst}, which never receives it"
            for (src, dst), queue in self.channels.items()
            for a in queue
        ]
        if left:
            raise _fail(self.s, "unreceived messages", left)

    def waiting(self, rank: int) -> str:
        index = self.heads[rank]
        action = self.s.actions[rank][index]
        if action.is_comm:
            peer = self.s.peer_rank(action)
            send = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
            what = f"{Action(send, action.peer_stage, action.microbatch)} from rank {peer}"
        else:
            what = " and ".join(
                f"{self.producer(key)} on rank {self.ranks[key[1]]}"
                for part in action.parts
                for key in self.inputs(part)
                if key not in self.produced
            )
        return f"rank {rank}: head action #{index} {action} waits for {what}"


def _outputs(part: Action) -> set[tuple[str, int, int | None]]:
    s, mb = part.stage, part.microbatch
    if part.kind is Kind.F:
        return {("F", s, mb)}
    if part.kind is Kind.I:
        return {("G", s, mb), ("I", s, mb)}
    if part.kind is Kind.B:
        return {("G", s, mb)}
    return {("W", s, mb)}


def _batches(schedule: Schedule) -> list[list[tuple[int, list[tuple]]]]:
    """Per rank, each maximal run of consecutive SEND/RECV actions and its first index.

    Each op is (own channel, matching channel, position in channel, action); a
    channel is (is_send, src rank, dst rank), and the k-th op posted on one
    channel matches the k-th op on its matching channel.
    """
    seen: Counter[tuple[bool, int, int]] = Counter()
    out: list[list[tuple[int, list[tuple]]]] = []
    for rank, row in enumerate(schedule.actions):
        runs: list[tuple[int, list[tuple]]] = []
        last = -2
        for index, a in enumerate(row):
            if not a.is_comm:
                continue
            peer = schedule.peer_rank(a)
            send = a.kind in (Kind.SEND_F, Kind.SEND_B)
            src, dst = (rank, peer) if send else (peer, rank)
            own = (send, src, dst)
            op = (own, (not send, src, dst), seen[own], a)
            seen[own] += 1
            if index == last + 1:
                runs[-1][1].append(op)
            else:
                runs.append((index, [op]))
            last = index
        out.append(runs)
    return out


def _check_batched(schedule: Schedule) -> None:
    """Re-runs the transfers as NCCL-style batches that complete only when fully matched."""
    batches = _batches(schedule)
    posted: Counter[tuple[bool, int, int]] = Counter()
    heads = [0] * schedule.n_ranks

    def post(rank: int) -> None:
        if heads[rank] < len(batches[rank]):
            for op in batches[rank][heads[rank]][1]:
                posted[op[0]] += 1

    def unmatched(rank: int) -> list[tuple]:
        return [op for op in batches[rank][heads[rank]][1] if posted[op[1]] <= op[2]]

    for rank in range(schedule.n_ranks):
        post(rank)
    progressed = True
    while progressed:
        progressed = False
        for rank, runs in enumerate(batches):
            while heads[rank] < len(runs) and not unmatched(rank):
                heads[rank] += 1
                post(rank)
                progressed = True
    stuck = []
    for rank, runs in enumerate(batches):
        if heads[rank] < len(runs):
            first, ops = runs[heads[rank]]
            waits = ", ".join(
                f"rank {op[0][2] if op[0][0] else op[0][1]} to post the match of {op[3]}" for op in unmatched(rank)
            )
            stuck.append(f"rank {rank}: head batch #{first} [{', '.join(str(op[3]) for op in ops)}] waits for {waits}")
    if stuck:
        raise _fail(
            schedule,
            "deadlock with batched sends/receives (each run of consecutive "
            "SEND/RECV actions completes only when all of it is matched)",
            stuck,
        )


def validate(schedule: Schedule, *, p2p: str = "batched") -> Schedule:
    """Checks that ``schedule`` computes everything once, in order, without deadlock.

    Args:
        schedule: a compute-only or lowered schedule.
        p2p: how transfers are assumed to behave. ``"eager"``: a SEND never
            blocks, a RECV waits for its SEND (gloo, or isend with unbounded
            buffering). ``"batched"``: additionally, each run of consecutive
            SEND/RECV actions is one ``batch_isend_irecv`` that completes only
            when every op in it has been posted by its peer (NCCL); a schedule
            that passes this also passes "eager" (optional, default "batched").

    Returns:
        The same schedule, so calls chain: ``validate(lower(one_f_one_b(4, 8)))``.

    Raises:
        ScheduleError: missing or repeated work, a SEND/RECV that is missing,
            duplicated or between co-located stages, an action that runs before
            its input on the same rank, receives out of send order, a deadlock
            (the message names each stuck rank's head action and what it waits
            for), or a message that is never received.
        ValueError: unknown p2p mode.
    """
    if p2p not in ("eager", "batched"):
        raise ValueError(f"p2p must be 'eager' or 'batched', got {p2p!r}")
    _check_work(schedule)
    lowered = any(a.is_comm for row in schedule.actions for a in row)
    if lowered:
        _check_transfers(schedule)
    _Run(schedule).run()
    if lowered and p2p == "batched":
        _check_batched(schedule)
    return schedule

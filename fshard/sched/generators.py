"""Schedule generators: pure functions ``(n_ranks, n_microbatches, *, n_virtual)`` -> Schedule.

Each returns a compute-only :class:`~fshard.sched.ir.Schedule` (F/B/I/W, plus
OVERLAP_F_B for DualPipeV); run :func:`fshard.sched.lower` to add the sends and
receives. Notation in the docstrings: p = n_ranks, m = n_microbatches,
v = n_virtual (stages per rank), r = rank.
"""

from __future__ import annotations

from collections import deque

from fshard.sched.ir import Action, Kind, Schedule

__all__ = [
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "zbv",
    "zero_bubble",
]

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def _check_sizes(
    name: str, n_ranks: int, n_microbatches: int, n_virtual: int, *, virtual: tuple[int, ...] | None = None
) -> None:
    sizes = f"{name}(n_ranks={n_ranks}, n_microbatches={n_microbatches}, n_virtual={n_virtual})"
    for label, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{sizes}: {label} must be an int >= 1")
    if virtual is not None and n_virtual not in virtual:
        hint = {
            "gpipe": " (use looped_bfs for several stages per rank)",
            "one_f_one_b": " (use interleaved_1f1b for several stages per rank)",
        }.get(name, "")
        raise ValueError(f"{sizes}: {name} supports n_virtual in {virtual} only{hint}")


def _rounds(name: str, n_ranks: int, n_microbatches: int, n_virtual: int) -> int:
    """Microbatches per round for interleaved schedules.

    Rounds of up to p microbatches walk through every local chunk in turn; this
    relaxes Megatron's m % p == 0 to m % rounds == 0 (p=4 allows m=10 or m=3).
    With one chunk per rank there is nothing to walk through, so any m works.
    """
    if n_virtual == 1:
        return n_microbatches
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        raise ValueError(
            f"{name}(n_ranks={n_ranks}, n_microbatches={n_microbatches}, n_virtual={n_virtual}): "
            f"n_microbatches must be a multiple of the number of rounds "
            f"max(1, n_microbatches // n_ranks) = {rounds}; try n_microbatches="
            f"{n_microbatches - n_microbatches % rounds} or {n_ranks * (rounds + 1)}"
        )
    return n_microbatches // rounds


def gpipe(n_ranks: int, n_microbatches: int, *, n_virtual: int = 1) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m full backwards (mb 0..m-1).

    Peak activations are m per rank; idle time per rank is (p-1)(F+B+W).

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1).
        n_virtual: stages per rank; only 1 (optional, default 1).

    Returns:
        A compute-only Schedule with loop placement.

    Raises:
        ValueError: non-positive sizes or n_virtual != 1.
    """
    _check_sizes("gpipe", n_ranks, n_microbatches, n_virtual, virtual=(1,))
    rows = [
        [Action(F, r, i) for i in range(n_microbatches)] + [Action(B, r, i) for i in range(n_microbatches)]
        for r in range(n_ranks)
    ]
    return Schedule(actions=rows, n_stages=n_ranks, n_microbatches=n_microbatches, name="gpipe")


def one_f_one_b(n_ranks: int, n_microbatches: int, *, n_virtual: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): p-1-r warm-up forwards, then alternate F and B.

    Same makespan as GPipe but rank r holds at most p-r microbatches of
    activations. m < p is allowed: the warm-up is capped at m.

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1).
        n_virtual: stages per rank; only 1 (optional, default 1).

    Returns:
        A compute-only Schedule with loop placement.

    Raises:
        ValueError: non-positive sizes or n_virtual != 1.
    """
    _check_sizes("one_f_one_b", n_ranks, n_microbatches, n_virtual, virtual=(1,))
    m = n_microbatches
    rows = []
    for r in range(n_ranks):
        warm = min(m, n_ranks - 1 - r)
        row = [Action(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            row += [Action(F, r, warm + i), Action(B, r, i)]
        row += [Action(B, r, i) for i in range(m - warm, m)]
        rows.append(row)
    return Schedule(actions=rows, n_stages=n_ranks, n_microbatches=m, name="1f1b")


def looped_bfs(n_ranks: int, n_microbatches: int, *, n_virtual: int = 2) -> Schedule:
    """Breadth-first looped schedule (Lamy-Poirier 2022).

    Each rank runs all m forwards of its first local stage, then of the next,
    and the full backwards in reverse stage and reverse microbatch order. Peak
    activations are m*v chunk-microbatches (like GPipe); idle time is
    (p-1)(F+B+W)/v.

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1).
        n_virtual: stages per rank v (optional, default 2).

    Returns:
        A compute-only Schedule with loop placement and p*v stages.

    Raises:
        ValueError: non-positive sizes.
    """
    _check_sizes("looped_bfs", n_ranks, n_microbatches, n_virtual)
    m = n_microbatches
    rows = []
    for r in range(n_ranks):
        stages = range(r, n_ranks * n_virtual, n_ranks)
        row = [Action(F, s, i) for s in stages for i in range(m)]
        row += [Action(B, s, i) for s in reversed(stages) for i in reversed(range(m))]
        rows.append(row)
    return Schedule(actions=rows, n_stages=n_ranks * n_virtual, n_microbatches=m, name="looped_bfs")


def _interleaved_row(r: int, p: int, m: int, v: int, per_round: int, split_backward: bool) -> list[Action]:
    """One rank of interleaved 1F1B (split_backward=False) or interleaved ZB1P (True).

    Forward op k runs chunk (k // per_round) % v; backward op k runs the chunks in
    reverse. Warm-up is (v-1)*per_round forwards plus 2 (1F1B) or 1 (ZB) per hop
    from the last rank. With split_backward, backward op k is an I and, once k >= r,
    the W of the oldest pending I follows it; leftover W's drain at the end.
    """
    total = m * v
    factor = 1 if split_backward else 2
    warm = min((v - 1) * per_round + factor * (p - 1 - r), total)
    next_f, next_b = [0] * v, [0] * v

    def op(kind: Kind, chunk: int, counters: list[int]) -> Action:
        counters[chunk] += 1
        return Action._trusted(kind, chunk * p + r, counters[chunk] - 1)

    row = [op(F, (k // per_round) % v, next_f) for k in range(warm)]
    pending_w: deque[Action] = deque()
    for k in range(total):
        if warm + k < total:
            row.append(op(F, ((warm + k) // per_round) % v, next_f))
        back = op(I if split_backward else B, v - 1 - (k // per_round) % v, next_b)
        row.append(back)
        if split_backward:
            pending_w.append(Action._trusted(W, back.stage, back.microbatch))
            if k >= r:
                row.append(pending_w.popleft())
    row.extend(pending_w)
    return row


def interleaved_1f1b(n_ranks: int, n_microbatches: int, *, n_virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021), looped placement.

    Idle time per rank is (p-1)(F+B+W)/v; rank 0 peaks at v*p + p - 1
    chunk-microbatches (p + (p-1)/v stages' worth) when m is a multiple of p.
    With v=1 this degenerates to 1F1B with 2(p-1-r) warm-up forwards.

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1); for v > 1 a multiple of
            max(1, m // p) (any m <= p, or a multiple of p, always works).
        n_virtual: stages per rank v (optional, default 2).

    Returns:
        A compute-only Schedule with loop placement and p*v stages.

    Raises:
        ValueError: non-positive sizes, or v > 1 and m not a multiple of the round count.
    """
    _check_sizes("interleaved_1f1b", n_ranks, n_microbatches, n_virtual)
    per_round = _rounds("interleaved_1f1b", n_ranks, n_microbatches, n_virtual)
    rows = [_interleaved_row(r, n_ranks, n_microbatches, n_virtual, per_round, False) for r in range(n_ranks)]
    return Schedule(actions=rows, n_stages=n_ranks * n_virtual, n_microbatches=n_microbatches, name="interleaved_1f1b")


def zero_bubble(n_ranks: int, n_microbatches: int, *, n_virtual: int = 1) -> Schedule:
    """Zero-bubble with split backward (Qi et al. 2024): ZB-H1, or interleaved ZB1P.

    Backward is split into I (input grad, on the critical path) and W (weight
    grad, deferred into the bubbles). With v=1 this is ZB-H1: idle per rank
    (p-1)(F+B-W), peak p microbatches like 1F1B. With v=2 it is torch's
    interleaved zero bubble (looped placement).

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1); for v > 1 a multiple of max(1, m // p).
        n_virtual: stages per rank v (optional, default 1).

    Returns:
        A compute-only Schedule with loop placement and p*v stages.

    Raises:
        ValueError: non-positive sizes, or v > 1 and m not a multiple of the round count.
    """
    _check_sizes("zero_bubble", n_ranks, n_microbatches, n_virtual)
    per_round = _rounds("zero_bubble", n_ranks, n_microbatches, n_virtual)
    rows = [_interleaved_row(r, n_ranks, n_microbatches, n_virtual, per_round, True) for r in range(n_ranks)]
    name = "zb_h1" if n_virtual == 1 else "interleaved_zb"
    return Schedule(actions=rows, n_stages=n_ranks * n_virtual, n_microbatches=n_microbatches, name=name)


class _Row:
    """Per-rank action list with per-(stage, kind) microbatch counters."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[int, Kind], int] = {}

    def next(self, kind: Kind, stage: int) -> Action:
        # B and I share a counter: both consume the next microbatch's gradient.
        key = (stage, I if kind is B else kind)
        mb = self.count.get(key, 0)
        self.count[key] = mb + 1
        return Action._trusted(kind, stage, mb)

    def add(self, kind: Kind, stage: int) -> Action:
        action = self.next(kind, stage)
        self.actions.append(action)
        return action


def zbv(n_ranks: int, n_microbatches: int, *, n_virtual: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024): V placement, split backward, exactly 2 stages per rank.

    Rank r holds stages r and 2p-1-r, so rank 0 runs the first and the last
    stage. Zero bubble per rank when F = I = W; rank 0 peaks at 2p
    chunk-microbatches (p stages' worth). The order is built for
    max(2p-1, m) microbatches and the ones >= m are dropped.

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1).
        n_virtual: stages per rank; only 2 (optional, default 2).

    Returns:
        A compute-only Schedule with "v" placement and 2p stages.

    Raises:
        ValueError: non-positive sizes or n_virtual != 2.
    """
    _check_sizes("zbv", n_ranks, n_microbatches, n_virtual, virtual=(2,))
    p, m = n_ranks, n_microbatches
    rows = [[a for a in _zbv_row(r, p, max(2 * p - 1, m)) if a.microbatch < m] for r in range(p)]
    return Schedule(actions=rows, n_stages=2 * p, n_microbatches=m, placement="v", name="zbv")


def _zbv_row(r: int, p: int, n: int) -> list[Action]:
    s0, s1 = r, 2 * p - 1 - r
    row = _Row()
    for _ in range(2 * (p - r) - 1):
        row.add(F, s0)
    for _ in range(r):
        row.add(F, s1)
        row.add(F, s0)
    for _ in range(p - r):
        row.add(F, s1)
        row.add(I, s1)
        row.add(W, s1)

    def done(kind: Kind, stage: int) -> int:
        return row.count.get((stage, kind), 0)

    while done(F, s1) < done(F, s0) or done(F, s0) < n:
        if done(F, s0) < n:
            row.add(F, s0)
        for kind in (I, W):
            row.add(kind, s0)
        for kind in (F, I, W):
            row.add(kind, s1)
    for _ in range(r):
        row.add(I, s0)
        row.add(I, s1)
    for _ in range(p - r):
        row.add(I, s0)
        row.add(W, s0)
    while done(W, s1) < done(I, s1):
        row.add(W, s1)
    while done(W, s0) < done(I, s0):
        row.add(W, s0)
    return row.actions


def dualpipev(n_ranks: int, n_microbatches: int, *, n_virtual: int = 2, overlap: bool = True) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half): V placement, 2 stages per rank.

    The steady state pairs the forward of one chunk with the full backward of
    the other as an OVERLAP_F_B action, meant to hide one pass's communication
    behind the other's compute; the tail switches to split I/W backward to fill
    the cool-down. Rank 0 peaks at 2p+1 chunk-microbatches. DualPipe proper
    (bidirectional, 2x parameters) on p ranks and m microbatches runs the same
    per-rank sequence as dualpipev(p // 2, m // 2).

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m; must be >= 2p (the stage count).
        n_virtual: stages per rank; only 2 (optional, default 2).
        overlap: emit OVERLAP_F_B pairs; False emits the same F and B as two
            plain actions (optional, default True).

    Returns:
        A compute-only Schedule with "v" placement and 2p stages.

    Raises:
        ValueError: non-positive sizes, n_virtual != 2 or m < 2p.
    """
    _check_sizes("dualpipev", n_ranks, n_microbatches, n_virtual, virtual=(2,))
    p, m = n_ranks, n_microbatches
    if m < 2 * p:
        raise ValueError(
            f"dualpipev(n_ranks={p}, n_microbatches={m}): needs n_microbatches >= n_stages = 2 * n_ranks = {2 * p}"
        )
    rows = [_dualpipev_row(r, p, m, overlap) for r in range(p)]
    return Schedule(actions=rows, n_stages=2 * p, n_microbatches=m, placement="v", name="dualpipev")


def _dualpipev_row(r: int, p: int, m: int, overlap: bool) -> list[Action]:
    s0, s1 = r, 2 * p - 1 - r
    row = _Row()
    weights: deque[Action] = deque()

    def backward(stage: int, split: bool) -> None:
        action = row.add(I if split else B, stage)
        if split:
            weights.append(Action(W, stage, action.microbatch))

    def pending_weight() -> None:
        if weights:
            row.actions.append(weights.popleft())

    def pair(fwd_stage: int, bwd_stage: int) -> None:
        fwd, bwd = row.next(F, fwd_stage), row.next(B, bwd_stage)
        row.actions.extend([Action(Kind.OVERLAP_F_B, -1, None, (fwd, bwd))] if overlap else [fwd, bwd])

    for _ in range(2 * (p - r - 1)):
        row.add(F, s0)
    for _ in range(r + 1):
        row.add(F, s0)
        row.add(F, s1)
    for _ in range(p - r - 1):
        backward(s1, split=True)
        pending_weight()
        row.add(F, s1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            # The last rank's first pair would wait on its own F; running them
            # apart lets the backward start right after the forward.
            row.add(F, s0)
            row.add(B, s1)
        else:
            pair(s0, s1)
        pair(s1, s0)
    for _ in range(p - r - 1):
        row.add(B, s1)
        pair(s1, s0)
    # The second half of the cool-down splits backward so W's fill the bubbles;
    # odd and even ranks switch one action apart, as DualPipe does.
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(s1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(p - r - 1):
        pending_weight()
        backward(s0, split)
    for _ in range(r + 1):
        pending_weight()
    return row.actions

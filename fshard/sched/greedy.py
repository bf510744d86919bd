"""ZB-H2: a zero-bubble order found by greedy list scheduling at unit costs."""

from __future__ import annotations

from collections import deque

from fshard.sched.generators import _check_sizes
from fshard.sched.ir import Action, Kind, Schedule

__all__ = ["zb_h2"]


def zb_h2(n_ranks: int, n_microbatches: int, *, n_virtual: int = 1, max_in_flight: int | None = None) -> Schedule:
    """ZB-H2 (Qi et al. 2024): split backward, more warm-up forwards, W's fill the tail.

    The order is what a greedy scheduler does at F = I = W = 1 when each rank,
    whenever it is free, runs the first ready action in priority I > F > W
    (I's and F's in microbatch order, W's oldest first), never letting more
    than ``max_in_flight`` microbatches hold activations (F started, W not
    done). With the default 2p-1 every rank is busy without a gap from its
    first action to its last (a parallelogram) and peaks at 2p-1 microbatches;
    an isolated step still takes as long as ZB-H1 unless the optimizer step
    lets the next step start early. The order is then fixed data: simulating
    it at other costs keeps the order and only moves the times.

    Args:
        n_ranks: pipeline ranks p (>= 1).
        n_microbatches: microbatches m (>= 1).
        n_virtual: stages per rank; only 1 (optional, default 1).
        max_in_flight: activation cap per rank, in microbatches (optional,
            default 2p - 1; p gives a ZB-H1-like memory budget).

    Returns:
        A compute-only Schedule with loop placement and p stages.

    Raises:
        ValueError: non-positive sizes, n_virtual != 1 or max_in_flight < 1.
    """
    _check_sizes("zb_h2", n_ranks, n_microbatches, n_virtual, virtual=(1,))
    cap = 2 * n_ranks - 1 if max_in_flight is None else max_in_flight
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(
            f"zb_h2(n_ranks={n_ranks}, n_microbatches={n_microbatches}): "
            f"max_in_flight must be an int >= 1, got {max_in_flight!r}"
        )
    rows = _greedy_rows(n_ranks, n_microbatches, cap)
    return Schedule(actions=rows, n_stages=n_ranks, n_microbatches=n_microbatches, name="zb_h2")


def _greedy_rows(p: int, m: int, cap: int) -> list[list[Action]]:
    # Unit costs and a common start make every decision fall on an integer time,
    # so stepping t by one visits every moment a rank can become free.
    f_end: dict[tuple[int, int], int] = {}
    i_end: dict[tuple[int, int], int] = {}
    next_f, next_i = [0] * p, [0] * p
    weights: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    w_ends: list[list[int]] = [[] for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    free = [0] * p
    left, t = 3 * m * p, 0
    while left:
        for r in range(p):
            if free[r] > t:
                continue
            action = _pick(r, t, p, m, cap, f_end, i_end, next_f, next_i, weights, w_ends)
            if action is None:
                continue
            mb = action.microbatch
            if action.kind is Kind.I:
                i_end[(r, mb)] = t + 1
                next_i[r] += 1
                weights[r].append((mb, t + 1))
            elif action.kind is Kind.F:
                f_end[(r, mb)] = t + 1
                next_f[r] += 1
            else:
                weights[r].popleft()
                w_ends[r].append(t + 1)
            rows[r].append(action)
            free[r] = t + 1
            left -= 1
        t += 1
    return rows


def _pick(
    r: int,
    t: int,
    p: int,
    m: int,
    cap: int,
    f_end: dict,
    i_end: dict,
    next_f: list[int],
    next_i: list[int],
    weights: list[deque],
    w_ends: list[list[int]],
) -> Action | None:
    i = next_i[r]
    if i < m and f_end.get((r, i), t + 1) <= t and (r == p - 1 or i_end.get((r + 1, i), t + 1) <= t):
        return Action(Kind.I, r, i)
    f = next_f[r]
    # A free rank's earlier W's all ended by now (each lasts one tick).
    in_flight = f - len(w_ends[r])
    if f < m and in_flight < cap and (r == 0 or f_end.get((r - 1, f), t + 1) <= t):
        return Action(Kind.F, r, f)
    if weights[r] and weights[r][0][1] <= t:
        return Action(Kind.W, r, weights[r][0][0])
    return None

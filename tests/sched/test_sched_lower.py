"""Lowering: matched SEND/RECV between ranks, none inside a rank; FSDP hook passes."""

from collections import defaultdict

import pytest

from fshard import sched
from fshard.sched import Action, Kind, ScheduleError

BUILDERS = [
    ("gpipe", lambda p, m: sched.gpipe(p, m)),
    ("1f1b", lambda p, m: sched.one_f_one_b(p, m)),
    ("looped_bfs", lambda p, m: sched.looped_bfs(p, m)),
    ("interleaved_1f1b", lambda p, m: sched.interleaved_1f1b(p, m)),
    ("zb_h1", lambda p, m: sched.zero_bubble(p, m)),
    ("interleaved_zb", lambda p, m: sched.zero_bubble(p, m, n_virtual=2)),
    ("zb_h2", lambda p, m: sched.zb_h2(p, m)),
    ("zbv", lambda p, m: sched.zbv(p, m)),
    ("dualpipev", lambda p, m: sched.dualpipev(p, max(m, 2 * p))),
]
GRID = [(2, 4), (4, 8), (4, 4), (2, 8), (3, 5)]


def _channels(schedule):
    """Per (src, dst) rank pair, the sends in src's order and the receives in dst's order."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sends[(rank, schedule.peer_rank(a))].append((a.kind, a.stage, a.microbatch))
            elif a.is_comm:
                send = Kind.SEND_F if a.kind is Kind.RECV_F else Kind.SEND_B
                recvs[(schedule.peer_rank(a), rank)].append((send, a.peer_stage, a.microbatch))
    return sends, recvs


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("name,build", BUILDERS, ids=[b[0] for b in BUILDERS])
def test_lowering_matches_every_cross_rank_boundary(name, build, p, m):
    s = build(p, m)
    low = sched.validate(sched.lower(s))
    assert low.compute_only() == s and low.is_lowered
    cross = [b for b in range(s.n_stages - 1) if s.rank_of(b) != s.rank_of(b + 1)]
    comms = [a for row in low.actions for a in row if a.is_comm]
    assert len(comms) == 4 * len(cross) * s.n_microbatches
    for rank, row in enumerate(low.actions):
        for a in row:
            if a.is_comm:
                assert s.rank_of(a.stage) == rank and low.peer_rank(a) != rank
    sends, recvs = _channels(low)
    assert sends == recvs  # same messages, same order, per rank pair


def test_v_placement_tip_has_no_transfer():
    low = sched.lower(sched.zbv(3, 6))
    # Stages 2 and 3 both live on rank 2 (the tip of the V): handed over locally.
    assert not any(a.is_comm and {a.stage, a.peer_stage} == {2, 3}
                   for row in low.actions for a in row)
    # Rank 0 holds stages 0 and 5: it receives stage 5's input from rank 1 and
    # sends stage 5's input gradient back there.
    assert {Action.parse("5RECV_F0"), Action.parse("5SEND_B0"),
            Action.parse("0SEND_F0"), Action.parse("0RECV_B0")} <= set(low.actions[0])
    assert low.peer_rank(Action.parse("5RECV_F0")) == 1


def test_recv_comes_before_its_consumer_and_send_after_its_producer():
    low = sched.lower(sched.interleaved_1f1b(2, 4))
    row = low.actions[1]
    assert row.index(Action.parse("1RECV_F0")) < row.index(Action.parse("1F0"))
    assert row.index(Action.parse("1SEND_F0")) == row.index(Action.parse("1F0")) + 1
    assert [str(a) for a in sched.lower(sched.one_f_one_b(2, 2)).actions[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]


def test_overlap_pairs_get_both_transfers():
    low = sched.lower(sched.dualpipev(2, 4))
    row = list(low.actions[0])
    i = row.index(Action.parse("(0F3;3B1)OVERLAP_F_B"))
    assert [str(a) for a in row[i + 1:i + 3]] == ["0SEND_F3", "3SEND_B1"]


def test_single_rank_needs_no_transfers():
    s = sched.zbv(1, 3)
    assert s.is_lowered and sched.lower(s) == s


def test_lower_rejects_lowered_and_deadlocked_input():
    with pytest.raises(ScheduleError, match="already has SEND/RECV"):
        sched.lower(sched.lower(sched.gpipe(2, 2)))
    bad = sched.Schedule(actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
                         n_stages=2, n_microbatches=2)
    stuck = r"rank 0: head action #1 0B0.*\n.*rank 1: head action #0 1F1"
    with pytest.raises(ScheduleError, match=stuck):
        sched.lower(bad)


@pytest.mark.parametrize("name,build", BUILDERS, ids=[b[0] for b in BUILDERS])
def test_reduce_grad_after_last_weight_gradient(name, build):
    s = sched.add_reduce_grad(sched.lower(build(2, 4)))
    sched.validate(s)
    for rank, row in enumerate(s.actions):
        reduces = [i for i, a in enumerate(row) if a.kind is Kind.REDUCE_GRAD]
        assert sorted(row[i].stage for i in reduces) == list(s.stages_of(rank))
        for i in reduces:
            stage = row[i].stage
            last = max(j for j, a in enumerate(row) for part in a.parts
                       if part.stage == stage and part.kind in (Kind.B, Kind.W))
            assert last < i


@pytest.mark.parametrize("max_active", [1, 2, 3])
@pytest.mark.parametrize("name,build", BUILDERS, ids=[b[0] for b in BUILDERS])
def test_unshard_reshard_wrap_every_compute(name, build, max_active):
    s = sched.add_unshard_reshard(sched.lower(build(2, 4)), max_active_stages=max_active)
    sched.validate(s)
    for row in s.actions:
        active = set()
        for a in row:
            if a.kind is Kind.UNSHARD:
                active.add(a.stage)
            elif a.kind is Kind.RESHARD:
                active.discard(a.stage)
            assert len(active) <= max(max_active, 2)  # an overlap pair needs both stages
        assert not active


def test_unshard_once_per_stage_for_single_stage_schedules():
    s = sched.add_unshard_reshard(sched.one_f_one_b(4, 8))
    for row in s.actions:
        assert [a.kind for a in row].count(Kind.UNSHARD) == 1
    with pytest.raises(ValueError, match="max_active_stages must be >= 1"):
        sched.add_unshard_reshard(s, max_active_stages=0)

"""The validator names the rank, the head action and the sizes for each broken schedule.

Broken schedules are made two ways: by editing a generator's output (one change at a
time), and written out by hand, action by action, so that what passes and what fails
does not depend on any generator.
"""

import attrs
import pytest

from fshard import sched
from fshard.sched import Action, Schedule, ScheduleError


def _edit(schedule, rank, fn):
    rows = [list(r) for r in schedule.actions]
    fn(rows[rank])
    return attrs.evolve(schedule, actions=rows)


def _swap(a, b):
    def fn(row):
        i, j = row.index(Action.parse(a)), row.index(Action.parse(b))
        row[i], row[j] = row[j], row[i]
    return fn


def _remove(a):
    return lambda row: row.remove(Action.parse(a))


def _raises(schedule, *fragments, **kwargs):
    with pytest.raises(ScheduleError) as err:
        sched.validate(schedule, **kwargs)
    text = str(err.value)
    for fragment in fragments:
        assert fragment in text, text
    return text


LOWERED = sched.lower(sched.one_f_one_b(2, 4))
COMPUTE = sched.one_f_one_b(2, 4)


def test_swapped_receives_break_send_order():
    bad = _edit(LOWERED, 1, _swap("1RECV_F1", "1RECV_F2"))
    _raises(bad, "rank 1: head action #2 1RECV_F2", "expects 0SEND_F2 from rank 0",
            "next message rank 0 sent to rank 1 is 0SEND_F1",
            "n_ranks=2, n_stages=2, n_microbatches=4")


def test_receive_after_its_consumer():
    bad = _edit(LOWERED, 0, _swap("0RECV_B0", "0B0"))
    _raises(bad, "rank 0: head action #4 0B0: runs before 0RECV_B0 (#5) on the same rank")


def test_send_before_its_producer():
    bad = _edit(LOWERED, 0, _swap("0F1", "0SEND_F1"))
    _raises(bad, "rank 0: head action #2 0SEND_F1: runs before 0F1 (#3) on the same rank")


def test_receive_moved_ahead_deadlocks_and_names_each_stuck_head():
    bad = _edit(LOWERED, 0, lambda row: row.insert(0, row.pop(row.index(Action.parse("0RECV_B0")))))
    _raises(bad, "deadlock: no rank can make progress",
            "rank 0: head action #0 0RECV_B0 waits for 1SEND_B0 from rank 1",
            "rank 1: head action #0 1RECV_F0 waits for 0SEND_F0 from rank 0")


def test_missing_microbatch():
    _raises(_edit(COMPUTE, 1, _remove("1F2")),
            "stage 1 microbatch 2 (rank 1): F runs 0 times, expected once")
    _raises(_edit(COMPUTE, 0, _remove("0B3")),
            "stage 0 microbatch 3 (rank 0): backward runs as B x0, I x0, W x0")


def test_repeated_microbatch_names_both_places():
    bad = _edit(COMPUTE, 0, lambda row: row.append(Action.parse("0F1")))
    _raises(bad, "stage 0 microbatch 1 (rank 0): F runs 2 times", "rank 0 #1, rank 0 #8")


def test_b_and_split_backward_mixed():
    bad = _edit(sched.zero_bubble(2, 2), 1, lambda row: row.append(Action.parse("1B0")))
    _raises(bad, "stage 1 microbatch 0 (rank 1): backward runs as B x1, I x1, W x1")


@pytest.mark.parametrize("schedule", [COMPUTE, LOWERED], ids=["compute", "lowered"])
def test_b_before_its_f(schedule):
    bad = _edit(schedule, 0, _swap("0F0", "0B0"))
    _raises(bad, "rank 0: head action #0 0B0: runs before 0F0")


def test_w_before_its_i():
    bad = _edit(sched.zero_bubble(2, 2), 0, _swap("0I0", "0W0"))
    _raises(bad, "rank 0: head action", "0W0: runs before 0I0")


def test_compute_only_deadlock_names_each_stuck_head():
    bad = Schedule(actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
                   n_stages=2, n_microbatches=2)
    _raises(bad, "rank 0: head action #1 0B0 waits for 1B0 on rank 1",
            "rank 1: head action #0 1F1 waits for 0F1 on rank 0")


def test_transfer_between_co_located_stages():
    low = sched.lower(sched.zbv(2, 4))
    bad = _edit(low, 1, lambda row: row.insert(row.index(Action.parse("1F0")) + 1,
                                               Action.parse("1SEND_F0")))
    _raises(bad, "rank 1 #", "1SEND_F0: stages 1 and 2 are both on rank 1")


def test_missing_and_unreceived_transfers():
    _raises(_edit(LOWERED, 1, _remove("1RECV_F3")), "rank 1: 1RECV_F3 appears 0 times")
    _raises(_edit(LOWERED, 0, _remove("0SEND_F3")), "rank 0: 0SEND_F3 appears 0 times")


# Both ranks send before they receive, in separate batches: fine when sends never
# block (gloo), a deadlock when each batch waits for its peer (NCCL).
SEND_FIRST = Schedule(actions=[
    "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2"
    .split(),
    "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2"
    .split()], n_stages=2, n_microbatches=3, name="send_first")


def test_batched_p2p_deadlock_is_caught_and_eager_passes():
    sched.validate(SEND_FIRST, p2p="eager")
    _raises(SEND_FIRST, "deadlock with batched sends/receives",
            "rank 0: head batch #3 [0SEND_F1] waits for rank 1 to post the match of 0SEND_F1",
            "rank 1: head batch #3 [1SEND_B0] waits for rank 0 to post the match of 1SEND_B0")
    with pytest.raises(ValueError, match="p2p must be"):
        sched.validate(SEND_FIRST, p2p="blocking")


def test_fsdp_hook_misuse():
    low = sched.add_unshard_reshard(sched.lower(sched.one_f_one_b(2, 2)))
    twice = _edit(low, 0, lambda row: row.insert(1, Action.parse("0UNSHARD")))
    _raises(twice, "rank 0: head action #1 0UNSHARD: stage 0 is already unsharded")
    no_unshard = _edit(low, 0, _remove("0UNSHARD"))
    _raises(no_unshard, "rank 0: head action", "0RESHARD: stage 0 is not unsharded")
    late = _edit(low, 1, lambda row: row.insert(row.index(Action.parse("1F1")),
                                                Action.parse("1RESHARD")))
    _raises(late, "rank 1: head action", "1F1: stage 1 is resharded here")
    early = _edit(sched.add_reduce_grad(LOWERED), 0,
                  lambda row: row.insert(0, row.pop(row.index(Action.parse("0REDUCE_GRAD")))))
    _raises(early, "rank 0: head action #0 0REDUCE_GRAD: only 0 of 4 weight gradients")


# --- schedules written out by hand, independent of the generators and of the validator ------

def _hand(rows, m=2, **kw):
    return Schedule(actions=[row.split() for row in rows], n_stages=kw.pop("n_stages", len(rows)),
                    n_microbatches=m, **kw)


# p=2, m=2. Rank 0 sends F1 and receives B0 in one batch, which rank 1 matches with its
# batch [1SEND_B0, 1RECV_F1]: fine for NCCL-style batches too.
HAND_1F1B = _hand(["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                   "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"])
HAND_VALID = {
    "gpipe_compute_only": _hand(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]),
    "1f1b_lowered": HAND_1F1B,
    # I/W split: rank 0's W0 may wait until after I1; a W only needs its own I
    "zb_split_backward": _hand(["0F0 0F1 0I0 0I1 0W1 0W0", "1F0 1I0 1W0 1F1 1I1 1W1"]),
    # V placement on 1 rank x 2 stages: stage 1 hands over to stage 0 locally, no transfer
    "v_one_rank": _hand(["0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1"], n_stages=2, placement="v"),
    # with the FSDP hooks: gather, run, free, then reduce each stage's gradients once
    "hooks": _hand(["0UNSHARD 0F0 0F1 0B0 0B1 0RESHARD 0REDUCE_GRAD",
                    "1UNSHARD 1F0 1F1 1B0 1B1 1RESHARD 1REDUCE_GRAD"]),
}


@pytest.mark.parametrize("name", sorted(HAND_VALID))
def test_hand_written_valid_schedules_pass_both_p2p_modes(name):
    s = HAND_VALID[name]
    assert sched.validate(s) is s  # returned unchanged, so calls chain
    assert sched.validate(s, p2p="eager") is s


def test_hand_written_deadlock():
    # Rank 0 waits for the gradient of microbatch 0 before sending its activation; rank 1
    # waits for that activation: a cycle, whatever the transport.
    bad = _hand(["0F0 0RECV_B0 0SEND_F0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
                 "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"])
    for p2p in ("eager", "batched"):
        text = _raises(bad, "deadlock: no rank can make progress",
                       "rank 0: head action #1 0RECV_B0 waits for 1SEND_B0 from rank 1",
                       "rank 1: head action #0 1RECV_F0 waits for 0SEND_F0 from rank 0", p2p=p2p)
        assert "n_ranks=2, n_stages=2, n_microbatches=2" in text


@pytest.mark.parametrize("rows, fragment", [
    # a backward before its own forward, on a compute-only schedule
    (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], "rank 1: head action #0 1B0: runs before 1F0 (#1)"),
    # W before its I
    (["0F0 0F1 0I0 0W1 0I1 0W0", "1F0 1I0 1W0 1F1 1I1 1W1"], "rank 0: head action #3 0W1: runs before 0I1 (#4)"),
    # a send of an activation not computed yet
    (["0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
      "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"], "rank 0: head action #0 0SEND_F0: runs before 0F0 (#1)"),
    # a forward on the receiving rank before the receive of its input
    (["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
      "1F0 1RECV_F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"], "rank 1: head action #0 1F0: runs before 1RECV_F0 (#1)"),
])
def test_hand_written_dependency_order_violations(rows, fragment):
    _raises(_hand(rows), "invalid order", fragment)


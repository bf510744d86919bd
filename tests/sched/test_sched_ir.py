"""Action strings, Schedule placement and sizes, the grid printout, CSV round trips."""

import io

import pytest

from fshard import sched
from fshard.sched import Action, Kind, Schedule, ScheduleError

ACTION_STRINGS = ["2F0", "0B3", "1I12", "3W0", "1SEND_F3", "2RECV_F3", "4SEND_B0", "3RECV_B0",
                  "0UNSHARD", "5RESHARD", "1REDUCE_GRAD", "(0F3;7B1)OVERLAP_F_B"]


@pytest.mark.parametrize("text", ACTION_STRINGS)
def test_action_str_round_trips(text):
    action = Action.parse(text)
    assert str(action) == text
    assert Action.parse(str(action)) == action
    assert eval(repr(action), {"Action": Action}) == action


def test_action_fields_and_string_kinds():
    a = Action("F", 2, 0)
    assert a == Action(Kind.F, 2, 0) == Action.parse("2F0")
    assert (a.kind, a.stage, a.microbatch, a.sub) == (Kind.F, 2, 0, ())
    assert a.is_compute and not a.is_comm and a.parts == (a,)
    overlap = Action.parse("(0F3;7B1)OVERLAP_F_B")
    assert overlap.parts == (Action(Kind.F, 0, 3), Action(Kind.B, 7, 1))
    assert overlap.is_compute and overlap.stage == -1 and overlap.microbatch is None


@pytest.mark.parametrize("text,peer", [("1SEND_F3", 2), ("2RECV_F3", 1), ("4SEND_B0", 3),
                                       ("3RECV_B0", 4), ("2F0", None)])
def test_peer_stage(text, peer):
    assert Action.parse(text).peer_stage == peer


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "1SEND_F", "a2F0", "(0F1)OVERLAP_F_B",
                                  "0UNSHARD3"])
def test_bad_action_strings_raise(text):
    with pytest.raises(ValueError):
        Action.parse(text)


@pytest.mark.parametrize("args", [("F", 0), ("F", -1, 0), ("UNSHARD", 0, 1), ("Q", 0, 0),
                                  ("B", 0, -2), ("OVERLAP_F_B", 0, None, ())])
def test_bad_action_fields_raise(args):
    with pytest.raises(ValueError):
        Action(*args)


def test_loop_and_v_placement():
    loop = sched.interleaved_1f1b(4, 8)
    assert [loop.stages_of(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert loop.rank_of(6) == 2 and loop.last_rank == 3 and loop.n_virtual == 2
    v = sched.zbv(4, 8)
    assert [v.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert v.rank_of(7) == 0 and v.last_rank == 0 and v.placement == "v"
    assert sched.stage_to_rank(2, 6, "v") == (0, 1, 1, 0, 0, 1)


def test_schedule_accepts_strings_and_dicts():
    s = Schedule(actions={1: ["1F0", "1B0"], 0: ["0F0", None, "0B0"]}, n_stages=2,
                 n_microbatches=1)
    assert s.actions == ((Action(Kind.F, 0, 0), Action(Kind.B, 0, 0)),
                         (Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)))
    assert s.n_ranks == 2 and s.name == "custom" and not s.is_lowered


@pytest.mark.parametrize("kwargs,match", [
    ({"actions": [["0F0"], ["0F1"]], "n_stages": 2, "n_microbatches": 2},
     r"rank 1 action #0 0F1: stage 0 lives on rank 0"),
    ({"actions": [["0F5"]], "n_stages": 1, "n_microbatches": 2},
     r"microbatch 5 >= n_microbatches=2"),
    ({"actions": [["3F0"]], "n_stages": 2, "n_microbatches": 1}, r"stage 3 >= n_stages=2"),
    ({"actions": [["0F0"], ["1F0"]], "n_stages": 3, "n_microbatches": 1}, r"n_stages=3, n_ranks=2"),
    ({"actions": [["0F0"]], "n_stages": 1, "n_microbatches": 1, "placement": "zigzag"},
     "placement"),
    ({"actions": [["0F0"]], "n_stages": 1, "n_microbatches": 0}, "n_microbatches must be >= 1"),
    ({"actions": [["0RECV_F0"]], "n_stages": 1, "n_microbatches": 1}, "peer stage -1"),
])
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule(**kwargs)


def test_peer_rank_and_compute_only():
    s = sched.lower(sched.one_f_one_b(2, 2))
    assert s.is_lowered
    send = next(a for a in s.actions[0] if a.kind is Kind.SEND_F)
    assert s.peer_rank(send) == 1
    with pytest.raises(ScheduleError, match="no peer"):
        s.peer_rank(Action.parse("0F0"))
    assert s.compute_only() == sched.one_f_one_b(2, 2)


def test_grid_printout():
    text = str(sched.lower(sched.one_f_one_b(2, 2)))
    lines = text.splitlines()
    assert lines[0] == ("Schedule '1f1b': 2 ranks, 2 stages (loop placement, 1 per rank), "
                        "2 microbatches")
    assert lines[1].split() == ["step", "|", "rank", "0", "|", "rank", "1"]
    assert lines[2].split() == ["0", "|", "0F0", "|", "1RECV_F0"]
    assert all(str(a) in text for row in sched.one_f_one_b(2, 2).actions for a in row)


SCHEDULES = [sched.gpipe(2, 3), sched.one_f_one_b(4, 8), sched.interleaved_1f1b(2, 4),
             sched.zero_bubble(4, 8, n_virtual=2), sched.zbv(3, 6), sched.dualpipev(2, 4),
             sched.zb_h2(3, 5), sched.zbv(1, 2)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.name}-{s.n_ranks}")
@pytest.mark.parametrize("lowered", [False, True])
def test_csv_round_trip(schedule, lowered, tmp_path):
    if lowered:
        schedule = sched.lower(schedule)
    path = tmp_path / "schedule.csv"
    text = schedule.to_csv(path)
    assert path.read_text() == text
    assert Schedule.from_csv(path) == schedule
    assert Schedule.from_csv(io.StringIO(text)) == schedule


def test_csv_without_header_is_torch_format_and_infers_sizes():
    s = sched.lower(sched.zbv(2, 4))
    text = s.to_csv(header=False)
    assert text.splitlines()[0].split(",")[:3] == ["0F0", "0SEND_F0", "0F1"]
    back = Schedule.from_csv(io.StringIO(text))
    assert (back.n_stages, back.n_microbatches, back.placement) == (4, 4, "v")
    assert back.actions == s.actions
    loop = Schedule.from_csv(io.StringIO(sched.interleaved_1f1b(2, 4).to_csv(header=False)))
    assert loop.placement == "loop"
    named = Schedule.from_csv(io.StringIO(text), name="mine", n_microbatches=6)
    assert (named.name, named.n_microbatches) == ("mine", 6)


def test_csv_reads_torch_written_rows_with_empty_cells():
    text = "0F0,,0F1,0B0,,0B1\n,1F0,1B0,1F1,1B1\n"
    s = Schedule.from_csv(io.StringIO(text))
    assert s.actions[0] == tuple(map(Action.parse, ["0F0", "0F1", "0B0", "0B1"]))
    assert (s.n_ranks, s.n_stages, s.n_microbatches) == (2, 2, 2)


def test_csv_errors():
    with pytest.raises(ScheduleError, match="no actions"):
        Schedule.from_csv(io.StringIO("\n\n"))
    with pytest.raises(ScheduleError, match="no stage placement fits"):
        Schedule.from_csv(io.StringIO("0F0,1F0\n2F0\n"))
    with pytest.raises(ValueError, match="cannot parse action 'oops'"):
        Schedule.from_csv(io.StringIO("0F0,oops\n"))


def test_non_string_cells_raise_type_error():
    with pytest.raises(TypeError, match="expected an Action or an action string, got 3"):
        Schedule(actions=[[3]], n_stages=1, n_microbatches=1)

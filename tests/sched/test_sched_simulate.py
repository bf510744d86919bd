"""The discrete-event simulator against pipeline_anchors.md section 2.3 and the 2.2 closed forms."""

from fractions import Fraction

import pytest

from fshard import sched
from fshard.sched import ScheduleError

H = Fraction(1, 2)


def _dualpipe(p, m):
    # DualPipe (bidirectional, 2x params) on p ranks runs DualPipeV(p/2, m/2)'s
    # per-rank sequence with each chunk costing one rank unit, i.e. f=b=w=2.
    return sched.dualpipev(p // 2, m // 2), {"f": 2, "b": 2, "w": 2}


# Section 2.3, F = I = W = 1 per rank, full B = 2, chunk cost / v, comm 0.
# (row, schedule builder, makespan T, T - ideal, bubble % of T (1 decimal),
#  bubble/ideal % (2 decimals), rank-0 peak in chunk-microbatches, in stage units;
#  the table gives DualPipe's peak only as a chunk count, PP + 1)
TABLE = [
    # p=4, m=8 (T_ideal = 24)
    ("gpipe", lambda: sched.gpipe(4, 8), 33, 9, "27.3", "37.50", 8, 8),
    ("1f1b", lambda: sched.one_f_one_b(4, 8), 33, 9, "27.3", "37.50", 4, 4),
    ("looped_bfs", lambda: sched.looped_bfs(4, 8), 28 + H, 4 + H, "15.8", "18.75", 16, 8),
    ("interleaved_1f1b", lambda: sched.interleaved_1f1b(4, 8), 28 + H, 4 + H, "15.8", "18.75",
     11, 5 + H),
    ("zb_h1", lambda: sched.zero_bubble(4, 8), 27, 3, "11.1", "12.50", 4, 4),
    ("zb_h2", lambda: sched.zb_h2(4, 8), 27, 3, "11.1", "12.50", 7, 7),
    ("interleaved_zb", lambda: sched.zero_bubble(4, 8, n_virtual=2), 25 + H, 1 + H, "5.9",
     "6.25", 8, 4),
    ("zbv", lambda: sched.zbv(4, 8), 25 + H, 1 + H, "5.9", "6.25", 8, 4),
    ("dualpipev", lambda: sched.dualpipev(4, 8), 27, 3, "11.1", "12.50", 9, 4 + H),
    ("dualpipev_relaxed", lambda: sched.dualpipev(4, 8, overlap=False), 25 + H, 1 + H, "5.9",
     "6.25", 9, 4 + H),
    ("dualpipe", lambda: _dualpipe(4, 8), 26, 2, "7.7", "8.33", 5, None),
    # p=2, m=4 (T_ideal = 12)
    ("gpipe", lambda: sched.gpipe(2, 4), 15, 3, "20.0", "25.00", 4, 4),
    ("1f1b", lambda: sched.one_f_one_b(2, 4), 15, 3, "20.0", "25.00", 2, 2),
    ("looped_bfs", lambda: sched.looped_bfs(2, 4), 13 + H, 1 + H, "11.1", "12.50", 8, 4),
    ("interleaved_1f1b", lambda: sched.interleaved_1f1b(2, 4), 13 + H, 1 + H, "11.1", "12.50",
     5, 2 + H),
    ("zb_h1", lambda: sched.zero_bubble(2, 4), 13, 1, "7.7", "8.33", 2, 2),
    ("zb_h2", lambda: sched.zb_h2(2, 4), 13, 1, "7.7", "8.33", 3, 3),
    ("interleaved_zb", lambda: sched.zero_bubble(2, 4, n_virtual=2), 12 + H, H, "4.0", "4.17",
     4, 2),
    ("zbv", lambda: sched.zbv(2, 4), 12 + H, H, "4.0", "4.17", 4, 2),
    ("dualpipev", lambda: sched.dualpipev(2, 4), 13, 1, "7.7", "8.33", 5, 2 + H),
    ("dualpipev_relaxed", lambda: sched.dualpipev(2, 4, overlap=False), 12 + H, H, "4.0",
     "4.17", 5, 2 + H),
    ("dualpipe", lambda: _dualpipe(2, 4), 12, 0, "0.0", "0.00", 3, None),
]


@pytest.mark.parametrize("row,build,makespan,bubble,frac,ratio,peak,peak_stages", TABLE,
                         ids=[f"{t[0]}-{'p4m8' if i < 11 else 'p2m4'}"
                              for i, t in enumerate(TABLE)])
@pytest.mark.parametrize("lowered", [False, True], ids=["compute", "lowered"])
def test_reference_table(row, build, makespan, bubble, frac, ratio, peak, peak_stages, lowered):
    built = build()
    schedule, costs = built if isinstance(built, tuple) else (built, {})
    if lowered:
        schedule = sched.lower(schedule)
    rep = sched.simulate(schedule, **costs)
    assert rep.makespan == makespan
    assert rep.bubble == bubble
    assert f"{float(rep.bubble_fraction) * 100:.1f}" == frac
    assert f"{float(rep.bubble_ratio) * 100:.2f}" == ratio
    assert rep.peak_activations[0] == peak
    if peak_stages is not None:
        assert rep.peak_stage_activations[0] == peak_stages
    assert all(busy == rep.ideal for busy in rep.busy)


@pytest.mark.parametrize("build,peaks", [
    (lambda: sched.one_f_one_b(4, 8), (4, 3, 2, 1)),
    (lambda: sched.interleaved_1f1b(4, 8), (11, 9, 7, 5)),
    (lambda: sched.zero_bubble(4, 8), (4, 4, 4, 4)),
])
def test_reference_table_per_rank_peaks(build, peaks):
    assert sched.simulate(build()).peak_activations == peaks


def _per_rank_gaps(rep):
    return [rep.last_end[r] - rep.first_start[r] - rep.busy[r] for r in range(len(rep.busy))]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (2, 8), (3, 9), (5, 10)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 2, 1), (2, 3, 1)])
def test_closed_forms(p, m, f, b, w):
    """Section 2.2, at the sizes where each form holds (m % p == 0 for interleaved)."""
    F, B, W = Fraction(f), Fraction(b), Fraction(w)
    flush = (p - 1) * (F + B + W)
    rep = sched.simulate(sched.gpipe(p, m), f, b, w)
    assert rep.bubble == flush and rep.peak_activations == (m,) * p
    rep = sched.simulate(sched.one_f_one_b(p, m), f, b, w)
    assert rep.bubble == flush and rep.peak_activations == tuple(p - r for r in range(p))
    for v in (2, 3):
        rep = sched.simulate(sched.looped_bfs(p, m, n_virtual=v), f, b, w)
        assert rep.bubble == flush / v and rep.peak_activations == (m * v,) * p
        rep = sched.simulate(sched.interleaved_1f1b(p, m, n_virtual=v), f, b, w)
        assert rep.bubble == flush / v
        assert rep.peak_activations[0] == min(v * p + p - 1, v * m)
    rep = sched.simulate(sched.zero_bubble(p, m), f, b, w)
    assert rep.bubble == (p - 1) * (F + B - W) and rep.peak_activations == (p,) * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (4, 7), (5, 12)])
def test_zero_bubble_per_rank_closed_forms(p, m):
    """ZB-V and ZB-H2 keep every rank busy from first to last action when F = I = W."""
    zbv = sched.simulate(sched.zbv(p, m))
    assert _per_rank_gaps(zbv) == [0] * p and zbv.peak_activations[0] == 2 * p
    h2 = sched.simulate(sched.zb_h2(p, m))
    assert _per_rank_gaps(h2) == [0] * p and h2.peak_activations == (2 * p - 1,) * p
    assert h2.makespan == sched.simulate(sched.zero_bubble(p, m)).makespan
    if m >= 2 * p:
        rep = sched.simulate(sched.dualpipev(p, m))
        # (PP/2 - 1)(F&B + B_full - 3W) chunk units with PP = 2p, halved to rank units.
        assert rep.bubble == (p - 1) * (3 + 2 - 3) / Fraction(2)
        assert rep.peak_activations[0] == 2 * p + 1


def test_report_fields_are_exact_and_consistent():
    rep = sched.simulate(sched.interleaved_1f1b(4, 8))
    assert isinstance(rep.makespan, Fraction) and rep.makespan == 28.5
    assert rep.ideal == 24 and rep.idle == tuple(rep.makespan - b for b in rep.busy)
    assert rep.first_start == (0, H / 1, 1, 1 + H)
    assert max(rep.last_end) == rep.makespan
    assert len(rep.spans) == 4 and sum(len(s) for s in rep.spans) == 4 * 2 * 8 * 2
    assert str(rep).startswith("makespan 28.5 (ideal 24), bubble 15.8% of T")


def test_comm_latency_on_cross_rank_edges_only():
    # GPipe p=2, m=1: F0 | c | F1, B1 | c | B0 -> 1 + 1 + 2 + 2 + 2c.
    assert sched.simulate(sched.gpipe(2, 1), comm=Fraction(1, 4)).makespan == 6 + H
    one_rank_v = sched.zbv(1, 3)
    assert sched.simulate(one_rank_v, comm=5).makespan == sched.simulate(one_rank_v).makespan
    # ZB-V's tip hand-off (stage p-1 -> p on one rank) is free, the other hops are not.
    zbv = sched.zbv(2, 4)
    assert sched.simulate(zbv, comm=1).makespan > sched.simulate(zbv).makespan


def test_costs_scale_linearly():
    s = sched.zbv(3, 6)
    assert sched.simulate(s, 2, 2, 2).makespan == 2 * sched.simulate(s).makespan
    assert sched.simulate(s, f=0.5, b=0.5, w=0.5).makespan == sched.simulate(s).makespan / 2


@pytest.mark.parametrize("costs", [{"f": 0}, {"b": -1}, {"comm": -0.5}, {"w": -1}])
def test_bad_costs_raise(costs):
    with pytest.raises(ValueError, match="must be > 0"):
        sched.simulate(sched.gpipe(2, 2), **costs)


def test_simulate_reports_deadlock_with_each_stuck_head():
    s = sched.Schedule(actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
                       n_stages=2, n_microbatches=2)
    with pytest.raises(ScheduleError) as err:
        sched.simulate(s)
    assert "rank 0: head action #1 0B0 waits for B or I of stage 1 microbatch 0" in str(err.value)
    assert "rank 1: head action #0 1F1 waits for F of stage 0 microbatch 1" in str(err.value)

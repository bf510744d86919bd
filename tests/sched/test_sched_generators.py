"""Generators: sizes, placement, exact orders where they are known, every output validates."""

import pytest

from fshard import sched
from fshard.sched import Action, Kind

# (id, factory, kwargs, stages per rank); zero_bubble at v=1 is ZB-H1.
GENERATORS = [
    ("gpipe", sched.gpipe, {}, 1),
    ("1f1b", sched.one_f_one_b, {}, 1),
    ("looped_bfs", sched.looped_bfs, {}, 2),
    ("looped_bfs_v1", sched.looped_bfs, {"n_virtual": 1}, 1),
    ("interleaved_1f1b", sched.interleaved_1f1b, {}, 2),
    ("interleaved_1f1b_v1", sched.interleaved_1f1b, {"n_virtual": 1}, 1),
    ("zb_h1", sched.zero_bubble, {}, 1),
    ("interleaved_zb", sched.zero_bubble, {"n_virtual": 2}, 2),
    ("zb_h2", sched.zb_h2, {}, 1),
    ("zbv", sched.zbv, {}, 2),
    ("dualpipev", sched.dualpipev, {}, 2),
]
GRID = [(1, 1), (1, 3), (2, 4), (4, 8), (4, 4), (2, 8), (3, 6), (4, 12)]


# dualpipev needs m >= 2p: those grid points are checked to raise, not generated.
_VALID = [pytest.param(name, factory, kwargs, v, p, m, id=f"{name}-{p}-{m}")
          for name, factory, kwargs, v in GENERATORS for p, m in GRID
          if not (factory is sched.dualpipev and m < 2 * p)]


def test_dualpipev_rejects_too_few_microbatches():
    for p, m in GRID:
        if m < 2 * p:
            with pytest.raises(ValueError, match="dualpipev"):
                sched.dualpipev(p, m)


@pytest.mark.parametrize("name,factory,kwargs,v,p,m", _VALID)
def test_generated_schedules_validate_before_and_after_lowering(name, factory, kwargs, v, p, m):
    s = factory(p, m, **kwargs)
    assert (s.n_ranks, s.n_stages, s.n_microbatches, s.n_virtual) == (p, p * v, m, v)
    assert s.placement == ("v" if name in ("zbv", "dualpipev") else "loop")
    assert all(a.is_compute for row in s.actions for a in row)
    sched.validate(s)
    lowered = sched.validate(sched.lower(s))
    assert lowered.compute_only() == s


@pytest.mark.parametrize("p", range(1, 9))
def test_every_generator_validates_on_the_acceptance_grid(p):
    # Issue 7's bar: p in 1..8, m in p..4p, v in {1, 2}, every generator.
    checked = 0
    for m in range(p, 4 * p + 1):
        for name, factory, kwargs, _ in GENERATORS:
            if name == "dualpipev" and m < 2 * p:
                continue
            if name in ("interleaved_1f1b", "interleaved_zb") and m % max(1, m // p):
                continue
            sched.validate(sched.lower(factory(p, m, **kwargs)))
            checked += 1
    assert checked > 10 * p


def _row(s, rank):
    return [str(a) for a in s.actions[rank]]


def test_gpipe_order():
    assert _row(sched.gpipe(2, 3), 1) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_1f1b_order_last_rank_starts_at_microbatch_0():
    # torch 2.13's 1F1B IR shows 3F1..3F8 on the last rank; ours must not.
    s = sched.one_f_one_b(4, 8)
    assert _row(s, 3)[:4] == ["3F0", "3B0", "3F1", "3B1"]
    assert _row(s, 0)[:6] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert _row(s, 0)[-3:] == ["0B5", "0B6", "0B7"]


def test_1f1b_allows_fewer_microbatches_than_ranks():
    assert _row(sched.one_f_one_b(4, 2), 0) == ["0F0", "0F1", "0B0", "0B1"]


def test_looped_bfs_order():
    assert _row(sched.looped_bfs(2, 2), 0) == [
        "0F0", "0F1", "2F0", "2F1", "2B1", "2B0", "0B1", "0B0"]


def test_interleaved_1f1b_order():
    assert _row(sched.interleaved_1f1b(2, 4), 0) == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
        "2B2", "2B3", "0B2", "0B3"]


def test_zb_h1_order():
    # Rank r defers its first W until r steady-state (F, I) pairs have run.
    s = sched.zero_bubble(2, 3)
    assert _row(s, 0) == ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"]
    assert _row(s, 1) == ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"]


def test_zbv_order_and_v_shape():
    s = sched.zbv(2, 4)
    assert _row(s, 0)[:8] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "3I1"]
    assert s.stages_of(0) == (0, 3)


def test_dualpipev_overlaps_and_plain_variant():
    s = sched.dualpipev(2, 4)
    overlaps = [a for row in s.actions for a in row if a.kind is Kind.OVERLAP_F_B]
    assert str(overlaps[0]) == "(0F3;3B1)OVERLAP_F_B"
    assert all(p.kind is Kind.F for p in (o.sub[0] for o in overlaps))
    plain = sched.dualpipev(2, 4, overlap=False)
    assert not any(a.kind is Kind.OVERLAP_F_B for row in plain.actions for a in row)
    assert [p for row in s.actions for a in row for p in a.parts] == \
        [a for row in plain.actions for a in row]


def test_zb_h2_order_is_greedy_and_capped():
    s = sched.zb_h2(2, 4)
    assert _row(s, 0)[:7] == ["0F0", "0F1", "0F2", "0I0", "0W0", "0I1", "0F3"]
    assert sched.simulate(sched.zb_h2(4, 8, max_in_flight=4)).peak_activations == (4, 4, 4, 4)


def test_split_backward_schedules_use_i_and_w_only():
    for s in (sched.zero_bubble(3, 6), sched.zbv(3, 6), sched.zb_h2(3, 6)):
        kinds = {a.kind for row in s.actions for a in row}
        assert kinds == {Kind.F, Kind.I, Kind.W}
    assert Action(Kind.B, 0, 0) in sched.interleaved_1f1b(2, 4).actions[0]


@pytest.mark.parametrize("call,match", [
    (lambda: sched.gpipe(0, 4), r"gpipe\(n_ranks=0, n_microbatches=4, n_virtual=1\): n_ranks"),
    (lambda: sched.one_f_one_b(2, 0), r"n_microbatches must be an int >= 1"),
    (lambda: sched.gpipe(2, 4, n_virtual=2), r"use looped_bfs"),
    (lambda: sched.one_f_one_b(2, 4, n_virtual=2), r"use interleaved_1f1b"),
    (lambda: sched.interleaved_1f1b(4, 9),
     r"n_microbatches=9.*multiple of the number of rounds.* = 2"),
    (lambda: sched.zero_bubble(4, 9, n_virtual=3), r"n_virtual=3.*= 2"),
    (lambda: sched.zbv(2, 4, n_virtual=3), r"zbv supports n_virtual in \(2,\)"),
    (lambda: sched.dualpipev(4, 7), r"dualpipev\(n_ranks=4, n_microbatches=7\).*>= .* = 8"),
    (lambda: sched.looped_bfs(2, 4, n_virtual=0), r"n_virtual must be an int >= 1"),
    (lambda: sched.zb_h2(2, 4, max_in_flight=0), r"max_in_flight must be an int >= 1"),
])
def test_bad_sizes_raise_value_error_naming_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_interleaved_relaxed_rounds_rule():
    # m % max(1, m // p) == 0 instead of m % p == 0, and v=1 takes any m.
    for p, m in [(4, 10), (4, 3), (3, 4)]:
        sched.validate(sched.lower(sched.interleaved_1f1b(p, m)))
    sched.validate(sched.lower(sched.zero_bubble(4, 9)))

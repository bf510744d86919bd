"""Timeline plots: the drawn blocks against the schedule, PNG and SVG files, and the
missing-matplotlib message.

The figure is caught as it is saved, and its artists are read back: one bar per
compute part (F, B, I, W; transfers are not drawn), on its rank's row, at the time a
hand-worked timeline gives, coloured as the legend says for its kind (lighter for a
rank's later stages), and labelled with its microbatch.
"""

import sys

import pytest

from fshard import sched


def _needs_matplotlib():
    pytest.importorskip("matplotlib", reason="plot() needs matplotlib (pip install fshard[viz])")


def _drawn(schedule, path, monkeypatch, render=False, **costs):
    """Plots ``schedule`` to ``path``; returns the bars as (rank, start, length, rgb, label), by
    rank then start, the legend as {label: rgb}, and the axes title. The file is written
    only with ``render`` (rasterizing is most of the time; the artists exist before it)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    figures = []
    save = Figure.savefig

    def spy(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs) if render else None

    monkeypatch.setattr(Figure, "savefig", spy)
    assert sched.plot(schedule, path, **costs) == str(path)
    (fig,) = figures
    (ax,) = fig.axes
    labels = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text() for t in ax.texts}
    bars = []
    for bar in ax.patches:
        assert isinstance(bar, Rectangle)
        rank = bar.get_y() + bar.get_height() / 2
        assert rank == int(rank), rank
        centre = (round(bar.get_x() + bar.get_width() / 2, 6), round(rank, 6))
        bars.append((int(rank), bar.get_x(), bar.get_width(), tuple(bar.get_facecolor()[:3]), labels.pop(centre)))
    assert not labels, f"labels without a bar: {labels}"
    legend = {t.get_text(): tuple(h.get_facecolor()[:3])
              for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    return sorted(bars), legend, ax.get_title()


def _kind_and_shade(rgb, legend):
    """The legend kind whose colour, mixed with white by some fraction, gives ``rgb``."""
    for label, base in legend.items():
        mixes = {round((c - b) / (1 - b), 4) for c, b in zip(rgb, base) if b < 1}
        if len(mixes) == 1 and 0 <= next(iter(mixes)) < 1:
            return label.split()[0], next(iter(mixes))
    raise AssertionError(f"colour {rgb} is no shade of a legend colour {legend}")


# Hand-worked timelines, (rank, kind, microbatch, start, length), f = b = w = 1 (a full B
# costs b + w = 2). gpipe(2, 2): rank 1 starts when rank 0's F0 ends; rank 0's B0 waits
# for rank 1's B0 (3..5).
GPIPE_2_2 = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 1), (0, "B", 0, 5, 2), (0, "B", 1, 7, 2),
             (1, "F", 0, 1, 1), (1, "F", 1, 2, 1), (1, "B", 0, 3, 2), (1, "B", 1, 5, 2)]
# zero_bubble(2, 2): rank 1 runs F0 I0 F1 I1 W0 W1; rank 0 F0 F1 I0 W0 I1 W1, its I0 after
# rank 1's I0 (2..3), its I1 after rank 1's I1 (4..5).
ZB_2_2 = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 1), (0, "I", 0, 3, 1), (0, "W", 0, 4, 1), (0, "I", 1, 5, 1),
          (0, "W", 1, 6, 1), (1, "F", 0, 1, 1), (1, "I", 0, 2, 1), (1, "F", 1, 3, 1), (1, "I", 1, 4, 1),
          (1, "W", 0, 5, 1), (1, "W", 1, 6, 1)]


@pytest.mark.parametrize("build, want, makespan", [
    (lambda: sched.gpipe(2, 2), GPIPE_2_2, 9),
    (lambda: sched.lower(sched.gpipe(2, 2)), GPIPE_2_2, 9),   # SEND/RECV are not drawn
    (lambda: sched.zero_bubble(2, 2), ZB_2_2, 7),
], ids=["gpipe", "gpipe_lowered", "zb_h1"])
def test_blocks_match_a_hand_worked_timeline(build, want, makespan, tmp_path, monkeypatch):
    _needs_matplotlib()
    bars, legend, title = _drawn(build(), tmp_path / "t.png", monkeypatch)
    got = []
    for rank, start, length, rgb, label in bars:
        kind, shade = _kind_and_shade(rgb, legend)
        assert shade == 0  # one stage per rank: the legend's own colour
        got.append((rank, kind, int(label), start, length))
    assert got == want
    kinds = {k for _, k, *_ in want}
    assert sorted(label.split()[0] for label in legend) == sorted(kinds)  # one entry per kind drawn
    assert len(set(legend.values())) == len(legend)  # distinct colours
    assert f"makespan {makespan}," in title


@pytest.mark.parametrize("build", [lambda: sched.interleaved_1f1b(2, 4), lambda: sched.zbv(2, 4),
                                   lambda: sched.dualpipev(2, 4), lambda: sched.lower(sched.looped_bfs(2, 4))],
                         ids=["interleaved", "zbv", "dualpipev", "looped_bfs_lowered"])
def test_blocks_follow_each_ranks_action_order_and_stage_shades(build, tmp_path, monkeypatch):
    # Several stages per rank (and F&B pairs in dualpipev): every compute part is one bar,
    # a rank's bars in time order are its action list's parts in order, and a later local
    # stage is drawn lighter than the rank's first stage, in the same kind's colour.
    _needs_matplotlib()
    schedule = build()
    bars, legend, _ = _drawn(schedule, tmp_path / "t.png", monkeypatch, b=2)
    for rank, row in enumerate(schedule.actions):
        want = [(p.kind.value, p.microbatch, schedule.stages_of(rank).index(p.stage))
                for a in row if a.is_compute for p in a.parts]
        mine = [b for b in bars if b[0] == rank]
        got = [(*_kind_and_shade(rgb, legend), int(label)) for _, _, _, rgb, label in mine]
        assert [(k, mb) for k, _, mb in got] == [(k, mb) for k, mb, _ in want]
        for (kind, shade, _), (_, _, chunk) in zip(got, want):
            assert (shade == 0) == (chunk == 0), (rank, kind, shade, chunk)
        # bars do not overlap on a row, and full backwards are drawn twice as long as forwards
        assert all(a[1] + a[2] <= b[1] + 1e-9 for a, b in zip(mine, mine[1:]))
        lengths = {k: {length for (_, _, length, _, _), (k2, _, _) in zip(mine, got) if k2 == k} for k in "FB"}
        v = schedule.n_virtual
        assert lengths["F"] <= {1 / v} and lengths["B"] <= {3 / v}, lengths  # b = 2 and w = 1
    assert len(bars) == sum(len(a.parts) for row in schedule.actions for a in row if a.is_compute)


def test_svg_with_costs_and_title(tmp_path, monkeypatch):
    _needs_matplotlib()
    path = tmp_path / "timeline.svg"
    bars, _, title = _drawn(sched.zero_bubble(2, 4), path, monkeypatch, render=True, f=1, b=2, w=1, title="zb")
    assert title == "zb" and len(bars) == 2 * 4 * 3  # F, I and W per stage and microbatch
    text = path.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_png_file(tmp_path):
    _needs_matplotlib()
    path = tmp_path / "timeline.png"
    sched.plot(sched.zbv(2, 4), path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_rejects_other_extensions(tmp_path):
    with pytest.raises(ValueError, match=r"must end in .png or .svg, got '.*\.jpg'"):
        sched.plot(sched.gpipe(2, 2), tmp_path / "timeline.jpg")


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install fshard\[viz\]"):
        sched.plot(sched.gpipe(2, 2), tmp_path / "timeline.png")

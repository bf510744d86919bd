"""Timeline plots: PNG and SVG files, overlap blocks, and the missing-matplotlib message."""

import sys

import pytest

from fshard import sched


def _needs_matplotlib():
    pytest.importorskip("matplotlib", reason="plot() needs matplotlib (pip install fshard[viz])")


@pytest.mark.parametrize("build", [lambda: sched.zbv(4, 8), lambda: sched.dualpipev(2, 4),
                                   lambda: sched.lower(sched.interleaved_1f1b(2, 4))],
                         ids=["zbv", "dualpipev", "interleaved_lowered"])
def test_plot_writes_png(build, tmp_path):
    _needs_matplotlib()
    path = tmp_path / "timeline.png"
    assert sched.plot(build(), path) == str(path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_plot_writes_svg_with_costs(tmp_path):
    _needs_matplotlib()
    path = tmp_path / "timeline.svg"
    sched.plot(sched.zero_bubble(2, 4), str(path), f=1, b=2, w=1, title="zb")
    text = path.read_text()
    assert "<svg" in text and len(text) > 5000


def test_plot_rejects_other_extensions(tmp_path):
    with pytest.raises(ValueError, match=r"must end in .png or .svg, got '.*\.jpg'"):
        sched.plot(sched.gpipe(2, 2), tmp_path / "timeline.jpg")


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install fshard\[viz\]"):
        sched.plot(sched.gpipe(2, 2), tmp_path / "timeline.png")

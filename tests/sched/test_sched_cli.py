"""``python -m fshard.sched``: every schedule name prints its grid and simulated numbers."""

import subprocess
import sys
from pathlib import Path

import pytest

from fshard import sched
from fshard.sched.__main__ import ALIASES, GENERATORS, build_schedule, main, resolve_name

ROOT = Path(__file__).resolve().parents[2]

# Sizes every generator accepts (dualpipev needs m >= 2p; the V schedules need v = 2).
CASES = {name: ["--ranks", "2", "--microbatches", "4"] for name in [*GENERATORS, *ALIASES]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_name_prints_grid_and_summary(name, capsys):
    assert main([name, *CASES[name]]) == 0
    out = capsys.readouterr().out
    expected = build_schedule(name, 2, 4)
    assert str(expected) in out  # the same grid that print(schedule) shows
    rep = sched.simulate(expected)
    assert f"makespan        {float(rep.makespan):g}" in out
    assert f"bubble          {float(rep.bubble_fraction):.1%}" in out
    assert f"peak memory     [{', '.join(map(str, rep.peak_activations))}]" in out


def test_aliases_resolve():
    assert resolve_name("1f1b") == "one_f_one_b"
    assert resolve_name("GPipe") == "gpipe"
    assert resolve_name("interleaved") == "interleaved_1f1b"
    assert resolve_name("zb") == "zero_bubble"
    assert resolve_name("ZB-V") == "zbv"
    assert resolve_name("dualpipe-v") == "dualpipev"
    assert build_schedule("interleaved_zb", 2, 4).n_virtual == 2
    assert build_schedule("zb", 2, 4).n_virtual == 1


def test_issue_example_numbers(capsys):
    # 1F1B, p=4, m=8 at unit costs: T = (m + p - 1)(f + b + w) = 33, bubble (p-1)/(m+p-1).
    assert main(["1f1b", "--ranks", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "Schedule '1f1b': 4 ranks, 4 stages" in out
    assert "makespan        33 (ideal 24" in out
    assert "bubble          27.3%" in out
    assert "peak memory     [4, 3, 2, 1]" in out


def test_virtual_lower_and_costs(capsys):
    assert main(["interleaved", "-p", "2", "-m", "4", "--virtual", "2", "--lower", "--b", "2"]) == 0
    out = capsys.readouterr().out
    assert "SEND_F" in out and "RECV_B" in out
    rep = sched.simulate(sched.interleaved_1f1b(2, 4, n_virtual=2), f=1, b=2, w=1)
    assert f"makespan        {float(rep.makespan):g}" in out
    assert "in units of a rank's whole layer set (2 stages)" in out


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "bfs", "zb", "zbh2", "zbv", "dualpipev"])
def test_plot(name, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / f"{name}.png"
    assert main([name, "-p", "2", "-m", "4", "--no-grid", "--plot", str(out_png)]) == 0
    assert out_png.read_bytes().startswith(b"\x89PNG")
    assert f"timeline written to {out_png}" in capsys.readouterr().out


def test_bad_requests_exit_2_with_reason(capsys):
    assert main(["nope"]) == 2
    assert "unknown schedule 'nope'; choose one of" in capsys.readouterr().err
    assert main(["gpipe", "--virtual", "2"]) == 2
    assert "use looped_bfs for several stages per rank" in capsys.readouterr().err
    assert main(["dualpipev", "-p", "4", "-m", "4"]) == 2
    assert "needs n_microbatches >= n_stages" in capsys.readouterr().err
    assert main([]) == 2


def test_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in GENERATORS)


def test_python_dash_m():
    run = subprocess.run([sys.executable, "-m", "fshard.sched", "zbv", "--ranks", "2", "--microbatches", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Schedule 'zbv': 2 ranks, 4 stages (v placement" in run.stdout
    assert "makespan" in run.stdout and "bubble" in run.stdout and "peak memory" in run.stdout

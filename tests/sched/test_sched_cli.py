"""``python -m fshard.sched``: every schedule name prints its grid and simulated numbers.

The numbers are checked against the reference table of pipeline_anchors.md (section
2.3: a discrete-event simulation of torch's own action orders, F = I = W = 1 per rank,
full B = 2, cross-checked there against the closed forms), copied below, not against
fshard's own simulator.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fshard.sched.__main__ import main
from fshard.sched.registry import ALIASES, GENERATORS, build_schedule, resolve_name

ROOT = Path(__file__).resolve().parents[2]

# Sizes every generator accepts (dualpipev needs m >= 2p; the V schedules need v = 2).
CASES = {name: ["--ranks", "2", "--microbatches", "4"] for name in [*GENERATORS, *ALIASES]}

# pipeline_anchors.md section 2.3: (CLI name, p, m) -> (makespan, bubble fraction of T in %,
# bubble / ideal, peak activations in chunk-microbatches: rank 0's, or every rank's where
# the table lists them). ZB-H2 and ZB-V: the isolated makespan; DualPipeV: the strict one.
ANCHORS = {
    ("gpipe", 4, 8): (33, 27.3, 0.375, 8),
    ("1f1b", 4, 8): (33, 27.3, 0.375, [4, 3, 2, 1]),
    ("looped_bfs", 4, 8): (28.5, 15.8, 0.188, 16),
    ("interleaved", 4, 8): (28.5, 15.8, 0.188, [11, 9, 7, 5]),
    ("zb_h1", 4, 8): (27, 11.1, 0.125, [4, 4, 4, 4]),
    ("zb_h2", 4, 8): (27, 11.1, 0.125, 7),
    ("interleaved_zb", 4, 8): (25.5, 5.9, 0.0625, 8),
    ("zbv", 4, 8): (25.5, 5.9, 0.0625, 8),
    ("dualpipev", 4, 8): (27, 11.1, 0.125, 9),
    ("gpipe", 2, 4): (15, 20.0, 0.25, 4),
    ("1f1b", 2, 4): (15, 20.0, 0.25, 2),
    ("looped_bfs", 2, 4): (13.5, 11.1, 0.125, 8),
    ("interleaved", 2, 4): (13.5, 11.1, 0.125, 5),
    ("zb_h1", 2, 4): (13, 7.7, 0.083, 2),
    ("zb_h2", 2, 4): (13, 7.7, 0.083, 3),
    ("interleaved_zb", 2, 4): (12.5, 4.0, 0.042, 4),
    ("zbv", 2, 4): (12.5, 4.0, 0.042, 4),
    ("dualpipev", 2, 4): (13, 7.7, 0.083, 5),
}


def _summary(out):
    """(makespan, ideal, bubble %, bubble ratio, peak per rank) parsed from the CLI's output."""
    makespan, ideal = re.search(r"^makespan +([\d.]+) \(ideal ([\d.]+) ", out, re.M).groups()
    frac, ratio = re.search(r"^bubble +([\d.]+)% of the step \(bubble ratio ([\d.]+) ", out, re.M).groups()
    peak = re.search(r"^peak memory +\[([\d, ]+)\]", out, re.M).group(1)
    return float(makespan), float(ideal), float(frac), float(ratio), [int(x) for x in peak.split(",")]


@pytest.mark.parametrize("name, p, m", sorted(ANCHORS))
def test_numbers_match_the_reference_table(name, p, m, capsys):
    assert main([name, "--ranks", str(p), "--microbatches", str(m), "--no-grid"]) == 0
    makespan, ideal, frac, ratio, peak = _summary(capsys.readouterr().out)
    want_t, want_frac, want_ratio, want_peak = ANCHORS[name, p, m]
    assert makespan == want_t and ideal == 3 * m  # T_ideal = m (F + B + W)
    assert frac == want_frac and abs(ratio - want_ratio) < 1e-3
    assert len(peak) == p
    assert (peak if isinstance(want_peak, list) else peak[0]) == want_peak, peak


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_name_prints_grid_and_summary(name, capsys):
    assert main([name, *CASES[name]]) == 0
    out = capsys.readouterr().out
    expected = build_schedule(name, 2, 4)
    assert str(expected) in out  # the same grid that print(schedule) shows
    makespan, ideal, frac, ratio, peak = _summary(out)
    # each name is one of the table's schedules: its p=2, m=4 row
    row = [k for k in ANCHORS if k[1:] == (2, 4) and resolve_name(k[0]) == resolve_name(name)
           and build_schedule(k[0], 2, 4).n_virtual == expected.n_virtual]
    assert len(row) == 1, (name, row)
    assert makespan == ANCHORS[row[0]][0]


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
    # The closed form of pipeline_anchors.md 2.2: idle (p - 1)(F + B + W) / v = 4 / 2 = 2
    # over the ideal m (F + B + W) = 16.
    assert _summary(out)[:2] == (18, 16)
    assert "in units of a rank's whole layer set (2 stages)" in out


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "bfs", "zb", "zbh2", "zbv", "dualpipev"])
def test_plot(name, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot command needs matplotlib (pip install fshard[viz])")
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

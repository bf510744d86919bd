"""Issue 36, row 15: the planner CLI (``python -m fshard.plan``) refuses bad input.

Before: ``--batch 0`` silently used the default (2 per device), ``--memory-limit -1`` and
``--top -3`` were accepted, ``--schedules foo,bar`` exited 0 (the unknown names only showed
up as "rejected" counts), and ``--layout tp=-1`` said "expected axis=size items", which
``tp=-1`` is. Now each exits 2 (argparse's usage error) naming the flag, the value and what
is allowed, before any estimate runs.
"""

import subprocess
import sys

import pytest

from fshard.plan.__main__ import main

# Small and fast where a run does go through (a search over 8 devices takes about a second).
BASE = ["--model", "llama3-8b", "--devices", "8", "--machine", "h100", "--seq", "2048", "--plain"]


def _refused(capsys, *argv: str) -> str:
    """Runs main(argv), expects argparse's exit 2, returns stderr."""
    with pytest.raises(SystemExit) as e:
        main([*BASE, *argv])
    assert e.value.code == 2, e.value.code
    captured = capsys.readouterr()
    assert "best:" not in captured.out  # nothing was searched
    return captured.err


@pytest.mark.parametrize("flag,value,says", [
    ("--batch", "0", "argument --batch: must be >= 1, got 0"),
    ("--batch", "-4", "argument --batch: must be >= 1, got -4"),
    ("--top", "-3", "argument --top: must be >= 1, got -3"),
    ("--devices", "0", "argument --devices: must be >= 1, got 0"),
    ("--seq", "0", "argument --seq: must be >= 1, got 0"),
    ("--microbatches", "0", "argument --microbatches: must be >= 1, got 0"),
    ("--memory-limit", "-1", "argument --memory-limit: must be a finite number > 0, got -1"),
    ("--memory-limit", "0", "argument --memory-limit: must be a finite number > 0, got 0"),
    ("--memory-limit", "nan", "argument --memory-limit: must be a finite number > 0, got nan"),
    ("--batch", "two", "argument --batch: expected an integer >= 1, got 'two'"),
])
def test_non_positive_numbers_are_refused_naming_flag_and_value(capsys, flag, value, says):
    assert says in _refused(capsys, flag, value)


def test_unknown_schedules_exit_nonzero_naming_them_and_the_known_ones(capsys):
    err = _refused(capsys, "--batch", "16", "--schedules", "foo,1f1b,bar")
    assert "argument --schedules: unknown schedule(s) 'foo', 'bar'; known:" in err
    assert "'1f1b'" not in err  # the known one is not reported as unknown
    for known in ("1f1b", "gpipe", "interleaved", "zb"):
        assert known in err.split("known:")[1]


def test_an_unknown_schedule_with_layout_is_refused(capsys):
    err = _refused(capsys, "--layout", "pp=2", "--schedule", "foo")
    assert "argument --schedule: unknown schedule 'foo'; choose one of" in err and "gpipe" in err


@pytest.mark.parametrize("layout,says", [
    ("tp=-1", "'tp=-1': axis 'tp' has size -1; a size is an integer >= 1"),
    ("fsdp=4,tp=0", "'fsdp=4,tp=0': axis 'tp' has size 0; a size is an integer >= 1"),
    ("tp=x", "'tp=x': axis 'tp' has size 'x'; a size is an integer >= 1"),
    ("tq=2", "'tq=2': unknown axis 'tq'; axes are pp, dp, fsdp, cp, ep, tp"),
    ("tp=2,tp=4", "'tp=2,tp=4': axis 'tp' is given twice"),
    ("tp", "'tp': expected axis=size items separated by commas (e.g. fsdp=4,tp=2), got 'tp'"),
])
def test_a_bad_layout_names_the_axis_the_value_and_what_is_allowed(capsys, layout, says):
    assert f"argument --layout: {says}" in _refused(capsys, "--batch", "16", "--layout", layout)


def test_valid_input_still_runs(capsys):
    assert main([*BASE, "--batch", "16", "--top", "2", "--schedules", "1f1b, gpipe",
                 "--memory-limit", "80"]) == 0
    assert "best:" in capsys.readouterr().out
    assert main([*BASE, "--batch", "16", "--layout", "fsdp=4, tp=2", "--memory-limit", "80"]) == 0
    assert "fsdp=4,tp=2" in capsys.readouterr().out


def test_the_module_exits_2_with_the_message_on_stderr():
    r = subprocess.run([sys.executable, "-m", "fshard.plan", *BASE, "--batch", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "argument --batch: must be >= 1, got 0" in r.stderr, (r.returncode, r.stderr)

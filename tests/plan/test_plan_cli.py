"""Issue 35, item 11: the planner CLI's output.

The table fits 100 columns (rich's and plain text, a search and ``--layout``), ``--wide``
has every column, ``--json`` parses; a layout above the memory limit is marked "does not
fit (needs X GiB of Y GiB)"; the first line names the machine file and its age, and
``--recalibrate`` measures again. Calibration is replaced by a fake that saves a machine
where the real one would (tests/plan/test_plan_measure.py checks what calibrate measures);
``FSHARD_MACHINE`` and ``HOME`` point into ``tmp_path``, so no test reads or writes $HOME's file.
"""

from __future__ import annotations

import importlib
import json
import os
import time

import pytest

import fshard.plan as plan
from fshard.plan.__main__ import main
from fshard.plan.machine import Link, Machine
from fshard.plan.report import COLUMNS, SHORT_COLUMNS, WIDTH, fit_note

SEARCH = ["--model", "llama3-8b", "--devices", "8", "--machine", "h100", "--batch", "16", "--seq", "2048",
          "--schedules", "1f1b", "--top", "5"]
# The longest label the CLI makes: five flags after a four-axis mesh.
LONG_LAYOUT = ["--model", "llama3-8b", "--machine", "h100", "--batch", "128", "--layout", "pp=2,dp=2,fsdp=2,tp=2",
               "--schedule", "interleaved", "--microbatches", "32", "--remat", "--sequence-parallel"]
TINY = ["--model", "llama3-8b", "--batch", "1", "--seq", "128", "--layout", "fsdp=1"]  # quick, on any machine


@pytest.fixture(autouse=True)
def machine_path(tmp_path, monkeypatch):
    """This host's machine file (``--machine local``) in tmp_path, and a HOME there too."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "machine-host.json"
    monkeypatch.setenv("FSHARD_MACHINE", str(path))
    return path


def _machine(name: str) -> Machine:
    return Machine(name=name, memory_bytes=2**40, flops={"float32": 2e9, "float64": 1e9, "bfloat16": 1e9},
                   mem_bandwidth=2e9, devices_per_node=1 << 20,
                   links={"intra": Link(5e8, 5e-5), "inter": Link(5e8, 5e-5)}, op_overhead_s=2e-5, cores_per_node=2,
                   calibrated_ranks=1)


@pytest.fixture
def fake_calibrate(monkeypatch):
    """``fs.plan.calibrate`` replaced: records its arguments, saves ``new-cpu`` at ``path``."""
    calls = []

    def fake(mesh, *, path=None, quick=False, name=None, block=None):
        calls.append({"ranks": mesh.size, "path": str(path), "quick": quick})
        m = _machine("new-cpu")
        plan.save_machine(m, path)
        return m

    # The module, not fs.plan.calibrate (the package's name for the function).
    monkeypatch.setattr(importlib.import_module("fshard.plan.calibrate"), "calibrate", fake)
    return calls


def _run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _flat(text: str) -> str:
    """The words of ``text`` on one line: a phrase is found wherever the output wrapped it."""
    return " ".join(text.split())


def _longest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_default_output_fits_100_columns(plain, capsys):
    flag = ["--plain"] if plain else []
    if not plain:
        pytest.importorskip("rich", reason="the rich table needs rich (pip install fshard[viz])")
    out = _run(SEARCH + flag, capsys)
    assert _longest(out) <= WIDTH, out
    for c in SHORT_COLUMNS:
        assert c in out
    assert "params+grads+opt" not in out and "best: fsdp=8" in out
    long = _run(LONG_LAYOUT + flag, capsys)
    assert _longest(long) <= WIDTH, long
    assert "pp=2,dp=2,fsdp=2,tp=2" in long and "interleaved" in long  # the layout column wraps, whole


def test_wide_has_every_column_on_lines_as_long_as_they_are(capsys):
    out = _run(SEARCH + ["--wide", "--plain"], capsys)
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split() == " ".join(COLUMNS).split()
    assert _longest(out) > WIDTH  # what the default leaves out does not fit in 100
    assert "fsdp=8 no-reshard bfloat16" in out  # the whole label, dtype included


def test_json_rows_parse(capsys):
    doc = json.loads(_run(SEARCH + ["--json"], capsys))
    assert doc["machine"] == {"name": "h100", "source": "shipped", "path": None, "age_s": None}
    assert (doc["devices"], doc["batch"], doc["seq"], doc["dtype"]) == (8, 16, 2048, "bfloat16")
    assert len(doc["rows"]) == 5 and [r["rank"] for r in doc["rows"]] == [1, 2, 3, 4, 5]
    steps = [r["step_s"] for r in doc["rows"]]
    assert steps == sorted(steps) and all(r["fits"] and r["note"] is None for r in doc["rows"])
    best = doc["rows"][0]
    assert best["mesh"] == {"fsdp": 8} and best["layout"] == "fsdp=8 no-reshard bfloat16"
    assert sum(best["breakdown_s"].values()) == pytest.approx(best["step_s"])
    assert best["peak_gib"] <= best["memory_limit_gib"] == doc["memory_limit_gib"] == 78.0
    assert doc["considered"] > 5 and doc["rejected"]["memory"] > 0 and doc["best_unfit"]["fits"] is False


def _needs(devices: int, batch: int, limit_gib: float | None = None) -> str:
    """The marking for fsdp=devices, from the estimate itself."""
    model = plan.get_model("llama3-8b", seq_len=8192)
    est = plan.estimate(model, plan.get_machine("h100"),
                        plan.Layout({"fsdp": devices}, batch=batch, dtype="bfloat16"),
                        memory_limit=None if limit_gib is None else limit_gib * 2**30)
    limit = f"{limit_gib:.1f}" if limit_gib is not None else "78.0"  # h100: 80 GiB less 2 reserved
    want = f"does not fit (needs {est.peak_bytes / 2**30:.1f} GiB of {limit} GiB)"
    assert fit_note(est) == want
    return want


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_a_layout_that_does_not_fit_is_marked(plain, capsys):
    flag = ["--plain"] if plain else []
    base = ["--model", "llama3-8b", "--machine", "h100"]
    # A search where nothing fits shows the smallest peak, marked.
    out = _flat(_run(base + ["--devices", "1", "--batch", "2"] + flag, capsys))
    assert f"* #1 fsdp=1 bfloat16: {_needs(1, 2)}" in out and "none of 4 layouts fits in 78.0 GiB" in out
    assert "209.4 *" in out and "nothing fits; the smallest peak: fsdp=1 bfloat16: step" in out
    # --layout: on 2 h100s, and under a tiny --memory-limit
    out = _run(base + ["--batch", "4", "--layout", "fsdp=2"] + flag, capsys)
    assert f"* #1 fsdp=2 bfloat16: {_needs(2, 4)}" in out
    doc = json.loads(_run(base + ["--batch", "4", "--layout", "fsdp=2", "--memory-limit", "0.5", "--json"], capsys))
    (row,) = doc["rows"]
    assert row["fits"] is False and row["note"] == _needs(2, 4, 0.5) and row["memory_limit_gib"] == 0.5
    out = _run(base + ["--batch", "4", "--layout", "fsdp=2"] + flag + ["--memory-limit", "1000"], capsys)
    assert "does not fit" not in out  # what fits is not marked


def test_the_machine_file_is_named_with_its_age(machine_path, tmp_path, capsys):
    plan.save_machine(_machine("old-cpu"), machine_path)
    three_hours_ago = time.time() - 3 * 3600
    os.utime(machine_path, (three_hours_ago, three_hours_ago))
    for machine in ("local", str(machine_path)):  # this host's file ($FSHARD_MACHINE), or a path
        out = _run(TINY + ["--machine", machine, "--plain"], capsys)
        first = _flat(out)  # the line may wrap at 100 columns
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(three_hours_ago))
        assert first.startswith(f"machine old-cpu: machine file {machine_path}, written {when} (3.0 h ago);")
        assert "--recalibrate measures again" in first and " x old-cpu" in out
        doc = json.loads(_run(TINY + ["--machine", machine, "--json"], capsys))
        assert doc["machine"]["source"] == "file" and doc["machine"]["path"] == str(machine_path)
        assert doc["machine"]["age_s"] == pytest.approx(3 * 3600, abs=60)
    assert "shipped figures" in _run(TINY + ["--machine", "a100"], capsys)  # a data sheet: no file, no age
    assert not (tmp_path / "home").exists()


def test_local_calibrates_once_when_there_is_no_file(machine_path, fake_calibrate, capsys):
    out = _run(TINY + ["--machine", "local", "--plain"], capsys)
    assert fake_calibrate == [{"ranks": 1, "path": str(machine_path), "quick": True}]
    assert "machine new-cpu: calibrated now (no calibration file yet" in _flat(out) and "x new-cpu" in out
    assert "saved to" in out and machine_path.exists()
    out = _run(TINY + ["--machine", "local", "--plain"], capsys)  # the next run reads it
    assert len(fake_calibrate) == 1 and f"machine file {machine_path}, written" in _flat(out)


def test_recalibrate_measures_again_and_saves(machine_path, fake_calibrate, capsys):
    plan.save_machine(_machine("old-cpu"), machine_path)
    old = time.time() - 5 * 86400
    os.utime(machine_path, (old, old))
    assert "(5 days ago)" in _run(TINY + ["--machine", "local"], capsys) and not fake_calibrate
    out = _run(TINY + ["--recalibrate", "--plain"], capsys)  # --recalibrate alone: this host's file
    assert fake_calibrate == [{"ranks": 1, "path": str(machine_path), "quick": True}]
    assert _flat(out).startswith("machine new-cpu: calibrated now (--recalibrate: a quick calibration")
    assert f"saved to {machine_path}" in _flat(out) and " x new-cpu" in out
    assert plan.load_machine(machine_path).name == "new-cpu"
    other = machine_path.parent / "other.json"  # a machine file path: measured into that file
    doc = json.loads(_run(TINY + ["--recalibrate", "--machine", str(other), "--json"], capsys))
    assert doc["machine"] == {"name": "new-cpu", "source": "calibrated", "path": str(other), "age_s": 0.0}
    assert fake_calibrate[-1]["path"] == str(other) and other.exists()


def test_recalibrate_refuses_a_shipped_machine(fake_calibrate, capsys):
    assert main(TINY + ["--recalibrate", "--machine", "h100"]) == 2
    err = capsys.readouterr().err
    assert "--recalibrate measures this host, but --machine h100 is a shipped data sheet" in err
    assert "--machine local" in err and not fake_calibrate

"""Issue 35, item 11: ``train_lm.py --mesh auto``'s line names the machine file the planner used
and its age (``fs.recipes.planning.machine`` / ``auto_layout``), and picks the same layout as
before. In one process; ``FSHARD_MACHINE`` points into ``tmp_path``."""

from __future__ import annotations

import os
import time

import pytest

import fshard.plan as plan
from fshard.models import TransformerConfig
from fshard.parallel.layout import Layout
from fshard.plan.machine import Link, Machine
from fshard.recipes import planning

CFG = TransformerConfig(vocab_size=64, dim=16, n_layers=2, n_heads=4, max_seq_len=16)
AXES = ("pp", "dp", "fsdp", "tp")


def _machine(name: str = "test-cpu") -> Machine:
    return Machine(name=name, memory_bytes=2**34, flops={"float32": 2e9, "float64": 1e9, "bfloat16": 1e9},
                   mem_bandwidth=2e9, devices_per_node=1 << 20,
                   links={"intra": Link(5e8, 5e-5), "inter": Link(5e8, 5e-5)}, op_overhead_s=2e-5, cores_per_node=2,
                   calibrated_ranks=1)


def _auto(on) -> tuple[Layout, str]:
    return planning.auto_layout(CFG, Layout({"fsdp": 1}, batch=8), 1, on, axes=AXES, seq_len=16)


def test_mesh_auto_names_the_machine_file_and_its_age(tmp_path, monkeypatch):
    path = tmp_path / "machine-host.json"
    plan.save_machine(_machine(), path)
    two_hours_ago = time.time() - 2 * 3600
    os.utime(path, (two_hours_ago, two_hours_ago))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(two_hours_ago))
    monkeypatch.setenv("FSHARD_MACHINE", str(path))
    bare_layout, bare_why = _auto(plan.load_machine(path))
    assert "machine file" not in bare_why
    for name in (None, str(path)):  # this host's file, or --machine PATH
        layout, why = _auto(planning.machine(name, 1, CFG))
        note = f", from machine file {path}, written {when} (2.0 h ago)"
        assert f"layouts on test-cpu{note}): " in why
        assert layout == bare_layout and why.replace(note, "") == bare_why  # the same choice, the same words
    _, why = _auto(planning.machine("h100", 1, CFG))  # a shipped data sheet: no file to name
    assert "on h100): " in why and "machine file" not in why


def test_mesh_auto_names_a_calibration_made_now(tmp_path, monkeypatch):
    path = tmp_path / "absent.json"
    monkeypatch.setenv("FSHARD_MACHINE", str(path))
    calls = []

    def fake(mesh, *, path=None, quick=False, name=None, block=None):
        calls.append((mesh.size, quick, block))
        return _machine("new-cpu")

    monkeypatch.setattr(plan, "calibrate", fake)  # as planning calls it: fs.plan.calibrate
    _, why = _auto(planning.machine(None, 1, CFG))
    assert calls == [(1, True, CFG)]
    assert f"layouts on new-cpu, from machine file {path}, calibrated now (none was there)): " in why


@pytest.fixture(autouse=True)
def _no_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

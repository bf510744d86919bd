"""Issue 37, items 1-3: fits that separate host time from compute and say how noisy they are,
machine files that know when they are stale (recorded conditions, monkeypatched load), and
estimates with an interval that train_lm's log carries and checks."""

from __future__ import annotations

import importlib
import logging
import os

import pytest
import torch

import fshard
import fshard.plan as plan
from fshard.models import TransformerConfig
from fshard.plan import freshness
from fshard.plan.machine import Link, Machine
from fshard.recipes import planning

cal = importlib.import_module("fshard.plan.calibrate")  # the module (fs.plan.calibrate is the function)
CFG = TransformerConfig(vocab_size=64, dim=16, n_layers=2, n_heads=4, max_seq_len=16)


def _now_conditions(**changes) -> dict:
    total = os.cpu_count()
    c = {"torch": torch.__version__, "fshard": fshard.__version__, "cpu_count": total,
         "affinity_cores": len(os.sched_getaffinity(0)), "load_before": 0.4, "load_after": 1.2,
         "others_per_core": 0.2, "under_load": False, "ranks": 1, "time": 1.0e9, "duration_s": 10.0}
    c.update(changes)
    return c


def _machine(name: str = "test-cpu", **kw) -> Machine:
    base = dict(memory_bytes=2**34, flops={"float32": 2e9, "float64": 1e9, "bfloat16": 1e9}, mem_bandwidth=2e9,
                devices_per_node=1 << 20, links={"intra": Link(5e8, 5e-5), "inter": Link(5e8, 5e-5)},
                op_overhead_s=2e-5, cores_per_node=2, calibrated_ranks=1)
    return Machine(name=name, **{**base, **kw})


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FSHARD_MACHINE", str(tmp_path / "machine-host.json"))


def _load(monkeypatch, per_core: float) -> None:
    """The 1-minute load average reads ``per_core`` per core, none of it this process's (and
    the busy-time sample, which stale() prefers, is off)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (per_core * os.cpu_count(), 0.0, 0.0))
    monkeypatch.setattr(freshness, "_sampled_per_core", lambda: None)
    monkeypatch.setattr(freshness, "_process_age_s", lambda: 0.0)


# -- item 1: the fits ----------------------------------------------------------------------

def test_rate_fit_separates_host_time_from_the_rate():
    """Times made as 6 ms of host time plus FLOPs at 30 GFLOP/s, over sizes spanning three
    decades: the fit gives both back, with a residual near 0 (one small size alone would give a
    rate 100x too low, as the host-bound block of issue 37 did)."""
    host, rate = 6e-3, 30e9
    host_f, rate_f, res = cal._rate_fit(lambda n: (2.0 * n**3, host + 2.0 * n**3 / rate), (32, 128, 384, 1024))
    assert rate_f == pytest.approx(rate, rel=1e-6) and host_f == pytest.approx(host, rel=1e-6)
    assert res < 1e-9
    _, _, noisy = cal._rate_fit(lambda n: (2.0 * n**3, (host + 2.0 * n**3 / rate) * (1.5 if n == 128 else 1)),
                                (32, 128, 384, 1024))
    assert noisy > 0.1


def test_a_noisy_fit_is_repeated_once_then_marked_uncertain():
    res, unc = {}, []
    calls = iter([("a", 0.4), ("b", 0.3)])
    assert cal._fit_twice("flops[float32]", lambda: next(calls), res, unc) == "b"  # the better of the two
    assert res == {"flops[float32]": 0.3} and unc == ["flops[float32]"]
    calls = iter([("a", 0.4), ("c", 0.05)])
    assert cal._fit_twice("mem_bandwidth", lambda: next(calls), res, unc) == "c"
    assert res["mem_bandwidth"] == 0.05 and unc == ["flops[float32]"]  # quiet the second time: not marked
    once = []
    cal._fit_twice("block", lambda: once.append(1) or ("d", 0.01), res, unc)
    assert once == [1]  # a quiet fit is not repeated


def test_old_machine_files_load_and_read_as_unknown(tmp_path):
    path = tmp_path / "old.json"
    d = _machine().to_dict()
    for k in ("fit_residuals", "uncertain", "conditions"):
        del d[k]
    path.write_text(__import__("json").dumps(d))
    m = plan.load_machine(path)
    assert m.conditions == {} and m.uncertain == () and m.fit_residuals == {}
    why = freshness.stale(m.conditions, path)
    assert f"machine file {path} records no calibration conditions" in why and "--recalibrate" in why


# -- item 2: staleness -----------------------------------------------------------------------

def test_stale_names_the_field_that_differs_and_the_fix(monkeypatch):
    _load(monkeypatch, 0.2)
    assert freshness.stale(_now_conditions(), "f.json") is None
    why = freshness.stale(_now_conditions(torch="2.0.0"), "f.json")
    assert "machine file f.json was calibrated with torch '2.0.0'" in why
    assert "--recalibrate" in why and "fs.plan.calibrate(mesh)" in why
    assert "cpu_count 64" in freshness.stale(_now_conditions(cpu_count=64), "f.json")
    assert "fshard '0.0.1'" in freshness.stale(_now_conditions(fshard="0.0.1"), "f.json")


def test_other_work_is_measured_from_cpu_time_not_the_lagging_load_average(monkeypatch):
    # Right after another job ended, the 1-minute load average still reads it (2 per core
    # here); the host's busy CPU time over the calibration, less its own ranks', says whether
    # anything else ran.
    import time

    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * os.cpu_count(), 0.0, 0.0))
    started = time.time() - 10.0
    quiet = freshness.conditions(ranks=4, load_before=2.0 * os.cpu_count(), started=started, others_cpu_s=0.5)
    assert not quiet["under_load"] and quiet["others_per_core"] == pytest.approx(0.05 / os.cpu_count(), rel=0.01)
    busy = freshness.conditions(ranks=4, load_before=0.0, started=started, others_cpu_s=10.0 * os.cpu_count())
    assert busy["under_load"] and busy["others_per_core"] == pytest.approx(1.0, rel=0.01)
    before = freshness.busy_seconds()
    sum(i * i for i in range(200_000))  # some CPU time of this process
    assert before is not None and freshness.busy_seconds() >= before  # Linux /proc/stat


def test_a_calibration_made_under_load_is_not_reused_on_a_quiet_machine(monkeypatch):
    """Recorded conditions of issue 37's case: calibrated while another 2-rank job ran (load 2
    on 2 cores, about 1 per core besides the calibration's own ranks), reused on a quiet one."""
    monkeypatch.setattr(os, "getloadavg", lambda: (2.2 * os.cpu_count(), 0.0, 0.0))
    c = freshness.conditions(ranks=1, load_before=1.1 * os.cpu_count(), started=__import__("time").time())
    assert c["under_load"] and c["others_per_core"] > freshness.LOADED_PER_CORE
    assert c["torch"] == torch.__version__ and c["cpu_count"] == os.cpu_count() and c["load_after"] > 0
    _load(monkeypatch, 0.2)  # quiet now
    why = freshness.stale(c, "m.json")
    assert why.startswith("machine file m.json was calibrated under load: others_per_core")
    _load(monkeypatch, c["others_per_core"] - 0.3)  # as loaded now, within the band: reused
    assert freshness.stale(c, "m.json") is None
    quiet = _now_conditions(others_per_core=0.1)
    _load(monkeypatch, 0.1 + freshness.LOAD_BAND + 0.2)  # a quiet calibration on a loaded machine
    assert "calibrated on a quieter machine" in freshness.stale(quiet, "m.json")


def test_own_ranks_are_left_out_of_the_load():
    assert freshness.own_load(4, 0.0) == 0.0
    assert freshness.own_load(4, 600.0) == pytest.approx(4.0, rel=1e-4)  # ten time constants
    assert 0 < freshness.own_load(4, 30.0) < 4


def test_train_lm_recalibrates_a_stale_file_and_reuses_a_fresh_one(tmp_path, monkeypatch, caplog):
    path = tmp_path / "machine-host.json"
    calls = []

    def fake(mesh, *, path=None, quick=False, name=None, block=None):
        calls.append(quick)
        return _machine("new-cpu", conditions=_now_conditions())

    monkeypatch.setattr(plan, "calibrate", fake)
    _load(monkeypatch, 0.2)
    plan.save_machine(_machine("loaded-cpu", conditions=_now_conditions(others_per_core=1.1, under_load=True)), path)
    with caplog.at_level(logging.WARNING):
        m = planning.machine(None, 1, CFG)
    assert m.name == "new-cpu" and calls == [True]
    assert f"machine file {path} was calibrated under load" in caplog.text and "calibrating again now" in caplog.text
    assert m.sources[-1].endswith("calibrated now (the file was stale)")
    plan.save_machine(_machine("quiet-cpu", conditions=_now_conditions()), path)
    assert planning.machine(None, 1, CFG).name == "quiet-cpu" and calls == [True]  # reused
    caplog.clear()
    plan.save_machine(_machine("old-cpu"), path)  # no conditions: used, and said so
    with caplog.at_level(logging.WARNING):
        assert planning.machine(None, 1, CFG).name == "old-cpu" and calls == [True]
    assert "records no calibration conditions" in caplog.text


def test_check_reports_ratios_against_a_quick_remeasure(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    plan.save_machine(_machine(conditions=_now_conditions()), path)
    again = _machine(mem_bandwidth=1e9, flops={"float32": 3e9, "float64": 1e9, "bfloat16": 1e9})
    seen = []
    monkeypatch.setattr(cal, "calibrate", lambda mesh, **kw: seen.append(kw) or again)
    ratios = cal._check(None, path, name=None, block=False)
    assert seen[0]["path"] == "" and seen[0]["quick"]  # a quick re-measure, nothing saved
    assert ratios["flops[float32]"] == pytest.approx(1.5) and ratios["mem_bandwidth"] == pytest.approx(0.5)
    assert ratios["op_overhead_s"] == pytest.approx(1.0)
    with pytest.raises(FileNotFoundError):
        cal._check(None, tmp_path / "absent.json", name=None, block=False)


# -- item 3: the interval --------------------------------------------------------------------

def _est(machine):
    return plan.estimate(plan.describe_transformer(CFG, seq_len=16), machine, plan.Layout({"fsdp": 1}, batch=8))


def test_estimate_carries_an_interval_from_the_model_error_and_the_fit_residuals():
    from fshard.plan.estimate import MODEL_ERROR

    bare = _est(_machine(op_overhead_s=0.0))
    assert bare.regime == "compute"
    assert bare.step_lo_s == pytest.approx(bare.step_s / (1 + MODEL_ERROR["compute"]))
    assert bare.step_hi_s == pytest.approx(bare.step_s / (1 - MODEL_ERROR["compute"]))
    host = _est(_machine(call_overhead_s=1.0, layer_overhead_s=0.1))
    assert host.regime == "host" and host.step_lo_s < host.step_s < host.step_hi_s
    # A fit the interval does not know ("x") counts whole; a known one by what its residual
    # moves this step (host-bound: the block's matrix products are a small part of it).
    noisy = _est(_machine(call_overhead_s=1.0, layer_overhead_s=0.1, fit_residuals={"block": 0.05, "x": 0.1}))
    r = 1 - noisy.step_s / noisy.step_hi_s
    assert MODEL_ERROR["host"] + 0.1 < r < MODEL_ERROR["host"] + 0.1 + 0.05
    unc = _est(_machine(call_overhead_s=1.0, layer_overhead_s=0.1, fit_residuals={"block": 0.15}, uncertain=["block"]))
    sure = _est(_machine(call_overhead_s=1.0, layer_overhead_s=0.1, fit_residuals={"block": 0.15}))
    assert unc.uncertain == ("block",) and unc.step_lo_s < sure.step_lo_s < host.step_lo_s  # doubled when uncertain
    # Compute-bound: the matrix products' rate sets the step, the copy bandwidth barely does;
    # a 150 % bandwidth residual (a fit across the caches) must not make the interval useless.
    flops = _est(_machine(op_overhead_s=0.0, fit_residuals={"flops[float32]": 0.2}))
    copies = _est(_machine(op_overhead_s=0.0, fit_residuals={"mem_bandwidth": 1.5}))
    assert 1 - flops.step_s / flops.step_hi_s > MODEL_ERROR["compute"] + 0.1
    assert 1 - copies.step_s / copies.step_hi_s < MODEL_ERROR["compute"] + 0.5


def test_prediction_line_flags_a_measured_step_outside_the_interval():
    r = {"predicted_step_s": 0.5, "predicted_step_lo_s": 0.4, "predicted_step_hi_s": 0.7, "measured_step_s": 0.07,
         "predicted_peak_mib": 10.0, "measured_peak_mib": 10.2, "plan_uncertain": ["block"],
         "prediction_off": 0.5 / 0.07 - 1}
    line = planning.prediction_line(r)
    assert "step predicted 0.5000 s (0.4000-0.7000 s), measured 0.0700 s" in line
    assert "calibration uncertain: block" in line
    assert "prediction off by +614%: calibration stale or model incomplete" in line
    r.update(measured_step_s=0.55, prediction_off=None, plan_uncertain=[])
    assert "off by" not in planning.prediction_line(r) and "uncertain" not in planning.prediction_line(r)


def test_cli_warns_under_the_machine_line_when_the_file_may_not_hold(tmp_path, monkeypatch, capsys):
    from fshard.plan.__main__ import main

    path = tmp_path / "m.json"
    plan.save_machine(_machine(conditions=_now_conditions(torch="2.0.0")), path)
    argv = ["--model", "llama3-8b", "--batch", "1", "--seq", "128", "--layout", "fsdp=1", "--machine", str(path)]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"warning: machine file {path} was calibrated with torch '2.0.0'" in out and "--recalibrate" in out
    assert main([*argv, "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert "torch '2.0.0'" in doc["machine"]["stale"]

"""examples/train_lm.py with the planner: the prediction next to the measurement in the log,
and --mesh auto."""

from __future__ import annotations

import statistics

import fshard.plan as plan
from fshard.plan.machine import Link, Machine
from fshard.recipes.sinks import read_log
from fshard.testing import run_on_ranks

import _plan_bodies as bodies

TINY = ["--steps", "5", "--dim", "16", "--layers", "4", "--heads", "4", "--seq-len", "16", "--batch-size", "8",
        "--quiet"]


def _machine_file(tmp_path) -> str:
    m = Machine(name="test-cpu", memory_bytes=2**30, flops={"float32": 2e9, "float64": 1e9, "bfloat16": 1e9},
                mem_bandwidth=2e9, devices_per_node=1 << 20, links={"intra": Link(5e8, 5e-5), "inter": Link(5e8, 5e-5)},
                op_overhead_s=2e-5, overlap=0.2, cores_per_node=2, calibrated_ranks=2)
    path = tmp_path / "machine.json"
    plan.save_machine(m, path)
    return str(path)


def test_log_carries_prediction_and_measurement(tmp_path):
    log = tmp_path / "log.json"
    argv = TINY + ["--mesh", "fsdp=2", "--log-json", str(log), "--machine", _machine_file(tmp_path)]
    records = run_on_ranks(bodies.train, argv, world_size=2, timeout_s=240)
    last = read_log(log, "summary")[-1]  # the log's last line
    for key in ("predicted_step_s", "measured_step_s", "predicted_peak_mib", "measured_peak_mib"):
        assert isinstance(last[key], float) and last[key] > 0, (key, last)
    # measured_step_s: the median of the steps after the warm-up (1 of 5 steps), the profiled
    # step (the first after the warm-up) left out
    assert last["measured_step_s"] == statistics.median(r["step_time_s"] for r in records[0][2:])
    assert last["plan_layout"] == "fsdp=2"
    # issue 37: the interval, whether the measurement fell outside it, and the file used
    assert last["predicted_step_lo_s"] < last["predicted_step_s"] < last["predicted_step_hi_s"]
    inside = last["predicted_step_lo_s"] <= last["measured_step_s"] <= last["predicted_step_hi_s"]
    assert (last["prediction_off"] is None) == inside
    assert last["plan_machine_file"].startswith(str(tmp_path / "machine.json") + ", written ")
    assert last["plan_calibration_age_s"] is None and last["plan_regime"] in ("host", "compute")
    # the same numbers on every rank
    assert records[0][-1]["predicted_step_s"] == records[1][-1]["predicted_step_s"]


def test_mesh_auto_runs_the_planners_best_layout(tmp_path):
    log = tmp_path / "log.json"
    argv = TINY + ["--mesh", "auto", "--log-json", str(log), "--machine", _machine_file(tmp_path)]
    records = run_on_ranks(bodies.train, argv, world_size=2, timeout_s=240)
    last = read_log(log, "summary")[-1]
    model = plan.describe_transformer(plan_cfg(records), seq_len=16)
    res = plan.search(model, plan.load_machine(tmp_path / "machine.json"), 2, 8,
                      config=plan.SearchConfig(axes=("pp", "dp", "fsdp", "tp")))
    assert last["plan_layout"] == res.best.layout.label()
    assert records[0][-1]["loss"] < records[0][0]["loss"] + 1.0


def plan_cfg(records):
    from fshard.models import TransformerConfig

    T = bodies.train_lm()
    corpus = T.CharCorpus.load(T.DATA)
    return TransformerConfig(vocab_size=T.padded_vocab(corpus.vocab_size), dim=16, n_layers=4, n_heads=4,
                             max_seq_len=16)


def test_mesh_auto_with_experts_searches_ep_and_predicts_with_them(tmp_path):
    import fshard as fs

    log = tmp_path / "log.json"
    argv = TINY + ["--moe", "4", "--mesh", "auto", "--log-json", str(log), "--machine", _machine_file(tmp_path)]
    run_on_ranks(bodies.train, argv, world_size=2, timeout_s=240)
    last = read_log(log, "summary")[-1]
    model = plan.describe_transformer(plan_cfg(None), seq_len=16, moe=fs.recipes.MoE(4))
    res = plan.search(model, plan.load_machine(tmp_path / "machine.json"), 2, 8,
                      config=plan.SearchConfig(axes=bodies.train_lm().AXES))
    assert any(e.layout.ep > 1 for e in res) and not any(e.layout.tp > 1 for e in res)
    assert last["plan_layout"] == res.best.layout.label()
    assert last["predicted_step_s"] == res.best.step_s and last["plan_skew"] == 1.0

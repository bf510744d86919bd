"""Model, machine and layout descriptions: bad ones are errors that name the field."""

from __future__ import annotations

import json

import attrs

import pytest

import fshard.plan as plan
from fshard.plan.model import DescriptionError


def _machine_dict(**changes):
    d = plan.get_machine("h100").to_dict()
    d.update(changes)
    return d


def test_shipped_machines_load_and_cite_sources():
    for name in ("h100", "a100"):
        m = plan.get_machine(name)
        assert m.flops["bfloat16"] > 1e14 and m.links["inter"].bandwidth < m.links["intra"].bandwidth
        assert any("datasheet" in s for s in m.sources), m.sources
    assert plan.get_machine("h100").flops["bfloat16"] == pytest.approx(989.4e12)


def test_machine_round_trips_through_json(tmp_path):
    m = plan.get_machine("a100")
    plan.save_machine(m, tmp_path / "m.json")
    assert plan.load_machine(tmp_path / "m.json") == m
    # the calibrated-only figures too (the shipped files leave them at their defaults)
    m = attrs.evolve(m, optimizer_mem_efficiency=0.5, sync_overhead_s=1e-3, call_overhead_s=2e-3,
                     optimizer_leaf_overhead_s=1e-4)
    plan.save_machine(m, tmp_path / "m2.json")
    assert plan.load_machine(tmp_path / "m2.json") == m


@pytest.mark.parametrize("change, field", [
    ({"flops": {}}, "flops"),
    ({"flops": {"bfloat16": -1.0}}, "flops['bfloat16']"),
    ({"mem_bandwidth": 0}, "mem_bandwidth"),
    ({"devices_per_node": 0}, "devices_per_node"),
    ({"links": {"intra": {"bandwidth": 1e9, "latency": 1e-6}}}, "links['inter']"),
    ({"links": {"intra": {"bandwidth": 1e9, "latency": 1e-6}, "inter": {"bandwidth": -5, "latency": 1e-6}}},
     "links['inter'].bandwidth"),
    ({"links": {"intra": {"bandwidth": 1e9}, "inter": {"bandwidth": 1e9, "latency": 0}}}, "links['intra']"),
    ({"overlap": 1.5}, "overlap"),
    ({"layer_overhead_s": -1e-3}, "layer_overhead_s"),
    ({"call_overhead_s": -1e-3}, "call_overhead_s"),
    ({"optimizer_leaf_overhead_s": -1e-3}, "optimizer_leaf_overhead_s"),
    ({"optimizer_mem_efficiency": 0.0}, "optimizer_mem_efficiency"),
    ({"optimizer_mem_efficiency": 1.5}, "optimizer_mem_efficiency"),
    ({"sync_overhead_s": -1e-3}, "sync_overhead_s"),
    ({"collectives": {"all_reduce": {}}}, "unknown kind 'all_reduce'"),
    ({"speed": 3}, "unknown field 'speed'"),
])
def test_bad_machine_names_the_field(change, field):
    with pytest.raises(DescriptionError, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        plan.machine_from_dict(_machine_dict(**change))


def test_machine_missing_field_is_named(tmp_path):
    d = _machine_dict()
    del d["memory_bytes"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(DescriptionError, match=r"missing field 'memory_bytes'"):
        plan.load_machine(path)
    path.write_text("{not json")
    with pytest.raises(DescriptionError, match="not valid JSON"):
        plan.load_machine(path)


def test_machine_without_the_dtype_says_which_it_has():
    m = plan.get_machine("a100")
    with pytest.raises(DescriptionError, match=r"no flops figure for dtype 'float8'.*bfloat16"):
        m.flops_rate("float8")


def _model_dict():
    return {
        "name": "toy", "seq_len": 8, "hidden": 4, "dtype": "float32",
        "layers": [
            {"name": "block", "count": 2, "params": [["w", [4, 4]]], "tp_plan": [["w", "colwise"]],
             "fwd": {"flops": 256.0, "bytes": 0.0, "ops": 1}, "bwd_input": {"flops": 256.0, "bytes": 0.0, "ops": 1},
             "bwd_weight": {"flops": 256.0, "bytes": 0.0, "ops": 1}, "act_bytes": 128.0, "out_bytes": 128.0},
        ],
    }


def test_model_from_dict_builds_a_model():
    m = plan.model_from_dict(_model_dict())
    assert m.numel == 32 and m.n_blocks == 2 and m.flops_per_sample() == 2 * 768


def _moe_dict():
    d = _model_dict()
    d["n_experts"] = 4
    d["layers"][0]["params"].append(["moe.experts.w1", [4, 8, 4]])
    d["layers"][0]["experts"] = {"n_experts": 4, "top_k": 2, "fwd": {"flops": 128.0, "bytes": 0.0, "ops": 1},
                                 "act_bytes": 64.0, "skew": 1.5}
    return d


def test_model_from_dict_with_experts():
    m = plan.model_from_dict(_moe_dict())
    e = m.layers[0].experts
    assert (m.n_experts, e.top_k, e.fwd.flops, e.skew) == (4, 2, 128.0, 1.5)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(n_experts=8), r"experts\.n_experts \(4\) must equal the model's n_experts \(8\)"),
    (lambda d: d["layers"][0]["experts"].update(skew=0.5), r"experts\.skew must be"),
    (lambda d: d["layers"][0]["experts"].update(act_bytes=1e9), r"experts\.act_bytes .* must not exceed"),
    (lambda d: d["layers"][0]["experts"].update(colour="red"), r"experts must be a mapping"),
    (lambda d: d["layers"][0]["experts"].update(fwd={"flops": 1e9}), r"experts\.fwd .* must not exceed"),
])
def test_bad_experts_name_the_field(edit, field):
    d = _moe_dict()
    edit(d)
    with pytest.raises(DescriptionError, match=field):
        plan.model_from_dict(d)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("seq_len"), "missing field 'seq_len'"),
    (lambda d: d.update(seq_len=0), "seq_len must be an integer >= 1"),
    (lambda d: d.update(dtype="float12"), "dtype must be one of"),
    (lambda d: d.update(layers=[]), "layers must not be empty"),
    (lambda d: d["layers"][0]["fwd"].update(flops=-1.0), r"layers\[0\] \(block\)\.fwd\.flops must be"),
    (lambda d: d["layers"][0].update(count=0), r"layers\[0\] \(block\)\.count"),
    (lambda d: d["layers"][0].update(tp_plan=[["w", "diagonal"]]), r"tp_plan\[0\] \('w'\)\.style"),
    (lambda d: d["layers"][0].update(params=[["w", [4, 0]]]), r"params\[0\] \(w\)\.shape"),
    (lambda d: d["layers"][0].update(params=[["w"]]), r"params\[0\] must be \[path, \[sizes"),
    (lambda d: d["layers"][0].update(act_split=1e9), r"act_split .* must not exceed act_bytes"),
    (lambda d: d["layers"][0].update(colour="red"), r"layers\[0\]: unknown field 'colour'"),
    (lambda d: d["layers"][0].pop("fwd"), r"layers\[0\]: missing field 'fwd'"),
    (lambda d: d["layers"][0].update(fwd={"flops": 1.0, "speed": 2}), r"layers\[0\]\.fwd must be a mapping"),
])
def test_bad_model_names_the_field(edit, field):
    d = _model_dict()
    edit(d)
    with pytest.raises(DescriptionError, match=field):
        plan.model_from_dict(d)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(DescriptionError, match="llama3-8b"):
        plan.get_model("gpt-17")
    with pytest.raises(DescriptionError, match="h100"):
        plan.get_machine("tpu-v9")


@pytest.mark.parametrize("layout, field", [
    (dict(mesh={"tp": 3}, batch=8), r"mesh\['tp'\]=3 must divide 32"),
    (dict(mesh={"fsdp": 4}, batch=6), r"batch 6 must be a multiple of microbatches 1 x data-parallel ranks 4"),
    (dict(mesh={"fsdp": 4}, batch=8, microbatches=0), r"microbatches must be an int >= 1"),
    (dict(mesh={"fsdp": 4, "ep": 2}, batch=8), r"mesh\['ep'\]=2 needs a model whose experts"),
    (dict(mesh={"fsdp": 4}, batch=8, sequence_parallel=True), "sequence_parallel needs tp > 1"),
    (dict(mesh={"pp": 4, "fsdp": 2}, batch=8, schedule="interleaved", microbatches=4, virtual=16),
     "stages but model"),
    (dict(mesh={"pp": 2}, batch=8, schedule="nonsense", microbatches=2), r"Layout\.schedule 'nonsense'"),
    (dict(mesh={"pp": 2}, batch=8, schedule="zb", microbatches=2, remat=True), r"Layout\.remat with schedule 'zb'"),
])
def test_bad_layout_names_the_field(layout, field):
    model = plan.get_model("llama3-8b", seq_len=1024)
    with pytest.raises(plan.LayoutError, match=field):
        plan.check_layout(plan.Layout(**layout), model)


def test_layout_mesh_errors():
    with pytest.raises(plan.LayoutError, match="unknown axis 'xp'"):
        plan.Layout({"xp": 2}, batch=8)
    with pytest.raises(plan.LayoutError, match=r"mesh\['dp'\] must be an int >= 1"):
        plan.Layout({"dp": 0}, batch=8)

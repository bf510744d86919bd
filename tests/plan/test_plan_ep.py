"""fs.plan with dropless experts: the description, what ep holds, skew, refusals, search.

The collectives themselves are checked against comm_log in test_plan_comm.py.
"""

from __future__ import annotations

import attrs
import pytest

import fshard as fs
import fshard.plan as plan
from fshard.models import TransformerConfig
from fshard.plan.estimate import _act_bytes
from fshard.plan.model import DescriptionError, Experts, Work

CFG = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
MOE = fs.recipes.MoE(8)


@pytest.fixture(scope="module")
def model():
    return plan.describe_transformer(CFG, dtype="float32", moe=MOE)


def _machine():
    return plan.get_machine("h100")


def _est(model, mesh, **kw):
    return plan.estimate(model, _machine(), plan.Layout(mesh, batch=16, dtype="float32", **kw))


def test_the_description_counts_every_expert_and_splits_out_their_work(model):
    assert model.n_experts == 8 and model.numel == fs.recipes.model.count_params(CFG, MOE)
    block = model.layers[model.repeated]
    e = block.experts
    assert e is not None and (e.n_experts, e.top_k, e.skew) == (8, 2, 1.0)
    # top-2 of T tokens: 2T rows through a D -> H -> D MLP, 2 FLOPs per multiply-add
    h = 4 * CFG.dim
    assert e.fwd.flops == pytest.approx(2 * 16 * 2 * (2 * CFG.dim * h), rel=0.01)
    for f in ("fwd", "bwd_input", "bwd_weight"):
        assert 0 < getattr(e, f).flops < getattr(block, f).flops
    assert 0 < e.act_bytes < block.act_bytes


def test_ep_holds_whole_experts_and_leaves_the_rest_to_fsdp(model):
    one, ep2, ep2f2 = (_est(model, m) for m in ({"dp": 4}, {"dp": 2, "ep": 2}, {"fsdp": 2, "ep": 2}))
    block = model.layers[model.repeated]
    expert = sum(n for p, s in block.params if ".experts." in p for n in [s[0] * s[1] * s[2]]) * block.count
    dense = model.numel - expert
    # params memory in float32: dense replicated over dp x ep, experts split over ep
    assert one.memory["params"] == pytest.approx(4 * model.numel)
    assert ep2.memory["params"] == pytest.approx(4 * (dense + expert / 2))
    # fsdp splits both, the flat buffers padded to whole rows per rank
    assert ep2f2.memory["params"] == pytest.approx(4 * (dense / 2 + expert / 4), rel=0.02)


def test_skew_slows_the_busiest_rank_and_grows_its_activations(model):
    skewed = attrs.evolve(model, layers=[
        attrs.evolve(la, experts=attrs.evolve(la.experts, skew=2.0)) if la.experts else la for la in model.layers])
    base, hot = _est(model, {"ep": 4}), _est(skewed, {"ep": 4})
    assert hot.breakdown["compute"] > base.breakdown["compute"]
    assert hot.breakdown["exposed_comm"] > base.breakdown["exposed_comm"]
    lay = plan.Layout({"ep": 4}, batch=16, dtype="float32")
    block, hot_block = model.layers[1], skewed.layers[1]
    assert _act_bytes(hot_block, lay, skewed) - _act_bytes(block, lay, model) == pytest.approx(block.experts.act_bytes)
    assert hot.peak_bytes > base.peak_bytes
    # without ep every expert is on the rank: skew cannot make it busier
    assert _est(skewed, {"dp": 4}).step_s == pytest.approx(_est(model, {"dp": 4}).step_s)
    ragged = [c for c in hot.comm if c.kind == "ragged_all_to_all"]
    assert len(ragged) == 4 and all(c.peak_nbytes == 2 * min(r.nbytes for r in ragged) for c in ragged)


@pytest.mark.parametrize("mesh, kw, words", [
    ({"ep": 2, "tp": 2}, {}, "tp=2"),
    ({"ep": 2, "cp": 2}, {}, "cp=2"),
    ({"ep": 4, "fsdp": 4}, {}, "ep x fsdp = 16"),
    ({"pp": 2, "dp": 2, "ep": 2}, {"microbatches": 2}, "no fsdp"),
    ({"ep": 3}, {}, "divides"),
])
def test_what_the_recipes_do_not_build_is_refused(model, mesh, kw, words):
    n = 1
    for v in mesh.values():
        n *= v
    with pytest.raises(plan.LayoutError, match=words):
        plan.estimate(model, _machine(), plan.Layout(mesh, batch=48 if n % 3 == 0 else 16, dtype="float32", **kw))


def test_bad_expert_descriptions_name_the_field(model):
    with pytest.raises(DescriptionError, match="experts.skew"):
        Experts(8, 2, skew=0.5).check("x.experts")
    with pytest.raises(DescriptionError, match="top_k"):
        Experts(2, 3).check("x.experts")
    block = model.layers[1]
    with pytest.raises(DescriptionError, match="n_experts"):
        attrs.evolve(model, n_experts=4)
    with pytest.raises(DescriptionError, match="experts.fwd"):
        attrs.evolve(block, experts=attrs.evolve(block.experts, fwd=Work(1e30, 0, 0))).check("b")
    with pytest.raises(DescriptionError, match="device='cpu'"):
        plan.describe_transformer(CFG, moe=MOE, device="meta")


def test_search_considers_ep_and_only_what_runs(model):
    res = plan.search(model, _machine(), 8, 16, config=plan.SearchConfig(max_microbatch_choices=1))
    meshes = [dict(e.layout.shape) for e in res]
    assert any(m.get("ep", 1) > 1 for m in meshes)
    assert not any(m.get("ep", 1) > 1 and (m.get("tp", 1) > 1 or m.get("cp", 1) > 1) for m in meshes)
    dense = plan.describe_transformer(CFG, dtype="float32")
    assert not any(dict(e.layout.shape).get("ep", 1) > 1 for e in plan.search(dense, _machine(), 8, 16))

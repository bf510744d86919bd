"""The cost model's pieces, single process: traced work, formulas, pipeline, memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fshard.plan as plan
from fshard.models import TransformerConfig, transformer_apply, transformer_init
from fshard.plan.comm import Collective
from fshard.plan.machine import Link, Machine
from fshard.plan import trace

CFG = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)


def _machine(**kw) -> Machine:
    base = dict(name="toy", memory_bytes=2**30, flops={"float32": 1e10, "float64": 5e9, "bfloat16": 1e10},
                mem_bandwidth=1e10, devices_per_node=8, links={"intra": Link(1e9, 1e-5), "inter": Link(1e8, 1e-4)},
                op_overhead_s=1e-6, overlap=0.5)
    base.update(kw)
    return Machine(**base)


@pytest.fixture(scope="module")
def model():
    return plan.describe_transformer(CFG)


def test_traced_flops_add_up_to_flop_counter_on_the_whole_model(model):
    """The per-layer traces, summed, equal torch's FlopCounterMode over a whole step at batch 3."""
    from torch.utils.flop_counter import FlopCounterMode

    params = transformer_init(CFG, 0)
    leaves = [p.requires_grad_(True) for p in __import__("fshard").tree.leaves(params)]
    tok = torch.randint(0, CFG.vocab_size, (3, 16))
    aten = torch.ops.aten
    extra = {aten._scaled_dot_product_flash_attention_for_cpu: trace._sdpa_cpu_flops,  # torch's registry
             aten._scaled_dot_product_flash_attention_for_cpu_backward: trace._sdpa_cpu_backward_flops}  # lacks them
    with FlopCounterMode(display=False, custom_mapping=extra) as counter:
        loss = F.cross_entropy(transformer_apply(params, tok, CFG).flatten(0, 1), tok.flatten())
        torch.autograd.grad(loss, leaves)
    traced = 3 * model.flops_per_sample()
    # The whole-model run computes no gradient for the token ids (neither do the traces).
    assert traced == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert traced > 0


def test_work_scales_with_the_batch_and_tp_split_is_the_matrix_work(model):
    block = model.layers[model.repeated]
    t = plan.trace_layer(lambda p, x: __import__("fshard").models.block(p, x, CFG),
                         transformer_init(CFG, 0)["layers"][0], [torch.randn(4, 16, 32)], batch=4)
    assert t.fwd.flops == pytest.approx(block.fwd.flops)
    assert t.fwd.ops == block.fwd.ops  # kernels per call do not depend on the batch
    # every matrix product of a Megatron block is split over tp
    assert block.fwd_split.flops == pytest.approx(block.fwd.flops)
    assert 0 < block.act_split < block.act_bytes


def test_collective_formulas():
    m = _machine()
    lay = plan.Layout({"fsdp": 4}, batch=4)
    a, B = 1e-5, 1e9
    x = 1_000_000
    assert plan.collective_time(m, lay, Collective("all_gather", ("fsdp",), x)) == pytest.approx(3 * (a + x / B))
    assert plan.collective_time(m, lay, Collective("psum_scatter", ("fsdp",), x)) == pytest.approx(3 * (a + x / 4 / B))
    ring = 2 * 3 * (a + x / 4 / B)
    assert plan.collective_time(m, lay, Collective("psum", ("fsdp",), x)) == pytest.approx(ring)
    tiny = 2 * math.ceil(math.log2(4)) * a + 2 * 4 / B
    assert plan.collective_time(m, lay, Collective("psum", ("fsdp",), 4)) == pytest.approx(tiny)  # tree wins
    assert plan.collective_time(m, plan.Layout({"fsdp": 1}, batch=1), Collective("psum", ("fsdp",), x)) == 0


def test_axes_inside_a_node_use_the_intra_link():
    m = _machine(devices_per_node=8)
    lay = plan.Layout({"fsdp": 4, "tp": 8}, batch=4)  # tp: ranks 0-7 (one node); fsdp: stride 8
    x = 1_000_000
    tp = plan.collective_time(m, lay, Collective("all_gather", ("tp",), x))
    fsdp = plan.collective_time(m, lay, Collective("all_gather", ("fsdp",), x))
    assert tp == pytest.approx(7 * (1e-5 + x / 1e9))
    assert fsdp == pytest.approx(3 * (1e-4 + x / 1e8))


def test_measured_collectives_replace_the_link():
    m = _machine(collectives={"all_gather": {"intra": Link(5e8, 2e-5)}})
    lay = plan.Layout({"fsdp": 2}, batch=2)
    assert plan.collective_time(m, lay, Collective("all_gather", ("fsdp",), 1000)) == pytest.approx(2e-5 + 1000 / 5e8)
    assert plan.collective_time(m, lay, Collective("psum_scatter", ("fsdp",), 1000)) == pytest.approx(1e-5 + 500 / 1e9)


def test_time_breakdown_adds_up(model):
    m = _machine()
    for mesh, kw in [({"fsdp": 4}, {}), ({"dp": 2, "fsdp": 2}, {"microbatches": 2}), ({"fsdp": 2, "tp": 2}, {}),
                     ({"pp": 2, "fsdp": 2}, {"microbatches": 4}), ({"pp": 2, "tp": 2}, {"microbatches": 4,
                                                                                          "schedule": "zb"})]:
        est = plan.estimate(model, m, plan.Layout(mesh, batch=16, **kw))
        assert sum(est.breakdown.values()) == pytest.approx(est.step_s)
        assert sum(est.memory.values()) == pytest.approx(est.peak_bytes)
        assert est.step_s > 0 and est.tokens_per_s == pytest.approx(16 * 16 / est.step_s)


def test_pipeline_goes_through_the_simulator(model):
    """With the stage costs the estimate derived, fs.sched.simulate gives its makespan."""
    m = _machine()
    lay = plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4, schedule="1f1b")
    est = plan.estimate(model, m, lay)
    f, i, w = (max(c[j] for c in est.stage_costs) for j in range(3))
    p2p = plan.collective_time(m, lay, Collective("send", ("pp",), plan.comm.pipeline_payload(model, lay)))
    rep = __import__("fshard").sched.simulate(plan.layout_schedule(lay), f=f, b=i, w=w, comm=p2p)
    makespan = est.breakdown["compute"] + est.breakdown["bubble"]
    assert makespan == pytest.approx(float(rep.makespan), rel=2e-3)
    assert 0 < est.bubble_fraction < 1


def test_more_microbatches_shrink_the_bubble(model):
    m = _machine()
    fr = [plan.estimate(model, m, plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=k)).bubble_fraction
          for k in (2, 4, 8)]
    assert fr[0] > fr[1] > fr[2]


def test_memory_by_kind(model):
    m = _machine()
    one = plan.estimate(model, m, plan.Layout({"fsdp": 1}, batch=4))
    four = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=16))
    # parameters and optimizer state are sharded; activations are per sample
    assert four.memory["params"] == pytest.approx(one.memory["params"] / 4, rel=0.02)
    assert four.memory["optimizer"] == pytest.approx(2 * four.memory["params"])
    base = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=16))
    big = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=64))
    assert big.memory["activations"] == pytest.approx(4 * base.memory["activations"])
    remat = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=64, remat=True))
    assert remat.peak_bytes < big.peak_bytes and remat.step_s > big.step_s
    accumulate = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=64, microbatches=4))
    assert accumulate.memory["activations"] == pytest.approx(big.memory["activations"] / 4)
    bf16 = plan.estimate(model, m, plan.Layout({"fsdp": 4}, batch=64, dtype="bfloat16"))
    assert bf16.memory["params"] == big.memory["params"]  # fp32 masters
    assert bf16.memory["activations"] == pytest.approx(big.memory["activations"] / 2)
    # Sequence parallelism over the rows keeps what plain TP keeps (over the sequence more:
    # test_sp_saved_bytes_follow_the_tp_block measures both).
    rows = plan.estimate(model, m, plan.Layout({"fsdp": 2, "tp": 2}, batch=64, sequence_parallel=True))
    nosp = plan.estimate(model, m, plan.Layout({"fsdp": 2, "tp": 2}, batch=64))
    assert rows.memory["activations"] == pytest.approx(nosp.memory["activations"])


def _saved_per_sample(mode):
    """Bytes autograd saves per sample in one forward of fshard's TP block on 2 ranks (the
    slope between 4 and 8 samples, so the saved weights drop out), in whole (1, T, D)
    activations: plain TP ("tp"), SP over the rows ("rows") or over the sequence ("seq")."""
    import fshard as fs
    from fshard import P
    from fshard.parallel import TRANSFORMER_TP_PLAN, tp_specs, tp_transformer_block

    mesh = fs.make_mesh({"tp": 2})
    layer = transformer_init(CFG, 0, dtype=torch.float64)["layers"][0]
    specs = tp_specs({"layers": [layer]}, TRANSFORMER_TP_PLAN, "tp")["layers"][0]
    sp, kw = mode != "tp", dict(seq_dim=1) if mode == "seq" else {}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def loss(p, x):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = tp_transformer_block(p, x, CFG, "tp", sp, **kw)
        return fs.lax.pmean(y.pow(2).mean(), "tp") if sp else y.pow(2).mean()

    x_spec = {"tp": P(), "rows": P("tp"), "seq": P(None, "tp")}[mode]
    step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=(specs, x_spec), out_specs=P(), check=False))
    sharded, total = fs.shard(layer, specs, mesh), {}
    for b in (4, 8):
        saved.clear()
        step(sharded, torch.randn(b, CFG.max_seq_len, CFG.dim, dtype=torch.float64))
        total[b] = sum(saved.values())
    return (total[8] - total[4]) / 4 / (CFG.max_seq_len * CFG.dim * 8)


def test_sp_saved_bytes_follow_the_tp_block():
    """The planner's saved bytes of a TP block per sample, against autograd's on 2 ranks: SP
    over the rows (what the recipes run) as plain TP's (measured 5 % below: the norms' inputs
    are split), over the sequence half an activation more per region entry (measured 4 %
    above the estimate: the non-contiguous gathers' copies)."""
    from fshard.plan.estimate import _act_bytes
    from fshard.testing import run_on_ranks

    desc = plan.describe_transformer(CFG, dtype="float64")
    block, act = desc.layers[desc.repeated], CFG.max_seq_len * CFG.dim * 8
    layouts = {"tp": dict(batch=8), "rows": dict(batch=8, sequence_parallel=True),
               "seq": dict(batch=1, sequence_parallel=True)}  # one-row microbatches: the sequence split
    for mode, kw in layouts.items():
        measured = run_on_ranks(_saved_per_sample, mode, world_size=2)
        assert measured[0] == measured[1], measured
        predicted = _act_bytes(block, plan.Layout({"tp": 2}, dtype="float64", **kw), desc) / act
        assert predicted == pytest.approx(measured[0], rel=0.1), (mode, predicted, measured[0])
        layouts[mode] = measured[0]
    assert layouts["rows"] <= layouts["tp"] < layouts["seq"], layouts


def test_sp_needs_tp_to_divide_the_rows_or_the_sequence(model):
    odd = plan.describe_transformer(CFG, seq_len=15)
    with pytest.raises(plan.LayoutError, match=r"divides neither the 3 rows .* nor seq_len 15"):
        plan.estimate(odd, _machine(), plan.Layout({"tp": 2}, batch=3, sequence_parallel=True))
    plan.estimate(odd, _machine(), plan.Layout({"tp": 2}, batch=4, sequence_parallel=True))  # the rows
    plan.estimate(model, _machine(), plan.Layout({"tp": 2}, batch=3, sequence_parallel=True))  # the sequence


def test_llama_at_scale_is_compute_bound_and_below_peak():
    model = plan.get_model("llama3-8b", seq_len=8192)
    h100 = plan.get_machine("h100")
    est = plan.estimate(model, h100, plan.Layout({"fsdp": 8}, batch=16, dtype="bfloat16", remat=True))
    assert 0.3 < est.mfu < h100.matmul_efficiency
    assert est.breakdown["compute"] > 0.8 * est.step_s
    # 8.03B parameters as Meta states
    assert model.numel == pytest.approx(8.03e9, rel=0.01)
    assert plan.model_flops(model) == pytest.approx((6 * (model.numel - 128256 * 4096) + 12 * 32 * 8192 * 4096)
                                                     * 8192)


def test_a_layout_that_does_not_fit_is_above_the_limit():
    model = plan.get_model("llama3-70b", seq_len=8192)
    est = plan.estimate(model, plan.get_machine("h100"), plan.Layout({"fsdp": 8}, batch=8, dtype="bfloat16"))
    assert not est.fits and est.peak_bytes > est.memory_limit
    small = plan.estimate(model, plan.get_machine("h100"), plan.Layout({"fsdp": 8}, batch=8, dtype="bfloat16"),
                          memory_limit=1e6)
    assert small.peak_bytes > 1e6 and not small.fits


def test_layer_overhead_costs_once_per_layer_forward_and_backward_call(model):
    """A flat layout with m microbatches runs each layer's forward and backward m times:
    the fixed host cost per call adds exactly 2 * layers * m of it to the compute."""
    lay = plan.Layout({"fsdp": 2}, batch=8, microbatches=2)
    base = plan.estimate(model, _machine(), lay).breakdown["compute"]
    more = plan.estimate(model, _machine(layer_overhead_s=1e-3), lay).breakdown["compute"]
    calls = 2 * sum(layer.count for layer in model.layers) * 2
    assert more - base == pytest.approx(calls * 1e-3)


def test_overlap_hides_its_share_of_the_shorter_of_collective_and_compute():
    """machine.overlap is what calibrate measures: the share of the shorter of a collective
    and the compute beside it that runs hidden. A collective shorter than its window keeps
    (1 - overlap) of its time exposed; one longer keeps the rest beyond overlap * window."""
    import sys

    from fshard.plan.comm import Collective

    E = sys.modules["fshard.plan.estimate"]
    m, lay = _machine(overlap=0.25), plan.Layout({"fsdp": 2}, batch=8)
    c = Collective("all_gather", ("fsdp",), 2**20, count=3, hide="fwd")
    t = E.collective_time(m, lay, c) * 3
    assert E._exposed(m, lay, c, {"fwd": 10 * t}) == pytest.approx(0.75 * t)  # short: 3/4 of it shows
    assert E._exposed(m, lay, c, {"fwd": t / 30}) == pytest.approx(t - 0.25 * t / 10)  # long: beyond the window
    assert E._exposed(_machine(overlap=0.0), lay, c, {"fwd": 10 * t}) == pytest.approx(t)
    assert E._exposed(_machine(overlap=1.0), lay, c, {"fwd": 10 * t}) == 0.0
    exposed = Collective("psum", ("fsdp",), 2**20, count=2, hide=None)
    assert E._exposed(m, lay, exposed, {"fwd": 10 * t}) == pytest.approx(E.collective_time(m, lay, exposed) * 2)


def test_optimizer_leaf_overhead_costs_once_per_leaf_a_rank_holds(model):
    """The optimizer's host time per parameter leaf (calibrated on DTensor leaves) is paid
    for every leaf this rank updates: all of them on a flat layout, a stage's on a pipeline
    rank (the slowest rank's optimizer is the step's)."""
    n_leaves = sum(len(layer.params) * layer.count for layer in model.layers)
    lay = plan.Layout({"fsdp": 2}, batch=8)
    base = plan.estimate(model, _machine(), lay).breakdown["optimizer"]
    more = plan.estimate(model, _machine(optimizer_leaf_overhead_s=1e-3), lay).breakdown["optimizer"]
    assert more - base == pytest.approx(n_leaves * 1e-3)
    pipe = plan.Layout({"pp": 2}, batch=8, microbatches=4, schedule="1f1b")
    base = plan.estimate(model, _machine(), pipe).breakdown["optimizer"]
    more = plan.estimate(model, _machine(optimizer_leaf_overhead_s=1e-3), pipe).breakdown["optimizer"]
    # the slowest pp rank's leaves: its stages' (the embedding's or the head's, and half the blocks)
    from fshard.plan.shards import stage_layers

    per_rank = [sum(len(model.layers[i].params) * k for i, k in stage) for stage in stage_layers(model, 2)]
    assert more - base == pytest.approx(max(per_rank) * 1e-3, rel=0.05)
    # 4 ranks calibrated on 2 cores, a layout of 2 ranks on the node: each has a core, the
    # host time runs at twice the calibrated speed (as every other host cost)
    shared = dict(cores_per_node=2, calibrated_ranks=4)
    base = plan.estimate(model, _machine(**shared), lay).breakdown["optimizer"]
    more = plan.estimate(model, _machine(optimizer_leaf_overhead_s=1e-3, **shared), lay).breakdown["optimizer"]
    assert more - base == pytest.approx(n_leaves * 1e-3 / 2)


def test_calibrate_subtracts_the_kernels_the_estimate_charges_per_optimizer_leaf():
    """calibrate's per-leaf host time is what is left of a leaf's time after the kernels
    the estimate charges for it: on a CPU every foreach kernel runs per leaf, on a GPU a
    foreach kernel covers ~32 leaves, so between 8 and 32 leaves it adds none."""
    import sys

    E = sys.modules["fshard.plan.estimate"]
    ow = E._optimizer_work("float32")
    cpu = (E.optimizer_kernels(ow, 32, True) - E.optimizer_kernels(ow, 8, True)) / 24
    gpu = (E.optimizer_kernels(ow, 32, False) - E.optimizer_kernels(ow, 8, False)) / 24
    assert cpu == pytest.approx(ow.ops_per_leaf + ow.foreach_ops) and gpu == pytest.approx(ow.ops_per_leaf)
    # and _optimizer_time charges exactly these counts
    lay = plan.Layout({"fsdp": 2}, batch=8)
    for cores, per_leaf in ((2, cpu), (0, gpu)):
        m = _machine(cores_per_node=cores, calibrated_ranks=cores, mem_bandwidth=1e30)
        t = [E._optimizer_time(m, lay, 0, n) for n in (8, 32)]
        assert (t[1] - t[0]) / 24 == pytest.approx(per_leaf * m.overhead(2))


def test_sync_overhead_costs_once_per_blocking_collective_call_on_oversubscribed_cores(model):
    """Each blocking collective call (hide None) of a flat step costs the machine's sync
    overhead on top of its link time; an overlappable one (FSDP prefetch) not; nothing when
    a node's ranks have a core each, nor in pipelines."""
    import sys

    from fshard.plan.comm import step_collectives

    E = sys.modules["fshard.plan.estimate"]
    shared = dict(cores_per_node=2, calibrated_ranks=4, devices_per_node=1 << 20)
    lay = plan.Layout({"fsdp": 2, "tp": 2}, batch=8)
    blocking = sum(c.count for c in step_collectives(model, lay) if c.hide is None)
    hidden = sum(c.count for c in step_collectives(model, lay) if c.hide is not None)
    assert blocking > 0 and hidden > 0
    base = plan.estimate(model, _machine(**shared), lay).breakdown["exposed_comm"]
    more = plan.estimate(model, _machine(sync_overhead_s=1e-3, **shared), lay).breakdown["exposed_comm"]
    assert more - base == pytest.approx(blocking * 1e-3)
    # 4 ranks on 4 cores: nobody waits for a preempted peer
    own = dict(cores_per_node=4, calibrated_ranks=4, devices_per_node=1 << 20)
    assert plan.estimate(model, _machine(sync_overhead_s=1e-3, **own), lay).step_s == \
        pytest.approx(plan.estimate(model, _machine(**own), lay).step_s)
    assert _machine(sync_overhead_s=1e-3, **shared).sync_overhead(4) == 1e-3
    assert _machine(sync_overhead_s=1e-3, **shared).sync_overhead(2) == 0.0
    # calibrated with a core per rank: the figure measured no preemption, charged nowhere
    assert _machine(sync_overhead_s=1e-3, cores_per_node=4, calibrated_ranks=4).sync_overhead(8) == 0.0
    assert _machine(sync_overhead_s=1e-3).sync_overhead(8) == 1e-3  # a device
    # not in pipelines (measured: their TP layouts ran at the link time, docs/plan.md)
    pipe = plan.Layout({"pp": 2, "tp": 2}, batch=8, microbatches=4, schedule="1f1b")
    assert plan.estimate(model, _machine(sync_overhead_s=1e-3, **shared), pipe).step_s == \
        pytest.approx(plan.estimate(model, _machine(**shared), pipe).step_s)
    c = next(c for c in step_collectives(model, lay) if c.hide is None)
    assert E._blocking(_machine(sync_overhead_s=1e-3, **shared), lay, c) == pytest.approx(
        c.count * (E.collective_time(_machine(**shared), lay, c) + 1e-3))


def test_optimizer_kernels_run_at_the_calibrated_share_of_the_bandwidth(model):
    """optimizer_mem_efficiency divides the rate of the update's traced bytes only."""
    lay = plan.Layout({"fsdp": 2}, batch=8)
    full = plan.estimate(model, _machine(op_overhead_s=0.0), lay)
    half = plan.estimate(model, _machine(op_overhead_s=0.0, optimizer_mem_efficiency=0.5), lay)
    assert half.breakdown["optimizer"] == pytest.approx(2 * full.breakdown["optimizer"])
    assert half.breakdown["compute"] == full.breakdown["compute"]


def test_call_overhead_costs_once_per_flat_microbatch_and_half_per_pipeline_action(model):
    """The step body's fixed host cost (value_and_grad(shard_map) entry and exit) is paid
    once per microbatch of a flat step, whatever the layer count; a pipeline's stage forward
    and its backward are calls of their own, half of it each (issue 37)."""
    for k in (1, 2):
        lay = plan.Layout({"fsdp": 2}, batch=8, microbatches=k)
        base = plan.estimate(model, _machine(), lay).breakdown["compute"]
        more = plan.estimate(model, _machine(call_overhead_s=5e-3), lay).breakdown["compute"]
        assert more - base == pytest.approx(k * 5e-3)
    for schedule, m in (("1f1b", 4), ("gpipe", 2)):
        pipe = plan.Layout({"pp": 2}, batch=8, microbatches=m, schedule=schedule)
        base = plan.estimate(model, _machine(), pipe)
        more = plan.estimate(model, _machine(call_overhead_s=5e-3), pipe)
        # every rank runs m forwards and m backwards of its stage: m calls' worth more busy
        assert more.breakdown["compute"] - base.breakdown["compute"] == pytest.approx(m * 5e-3)
        assert more.step_s - base.step_s >= m * 5e-3 - 1e-9


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_pipeline_ranks_idle_in_the_bubble_leave_their_cores_to_the_others(model, schedule):
    """4 ranks on 2 CPU cores, calibrated with all 4 computing: a pipeline rank waiting in
    the bubble is blocked, so the ranks that compute share the cores with fewer others. The
    stage costs are the all-busy ones sped up by pipeline_speedup at the busy share the
    simulated schedule itself gives (a fixed point); with a core per rank nothing changes.
    Before, the pipeline's stage costs were the all-busy ones: measured 1F1B stages ran 1.5-1.7
    times as fast as predicted here (docs/plan.md)."""
    links = {"intra": Link(1e9, 0.0), "inter": Link(1e8, 0.0)}  # no host time per transfer (tested below)
    m = _machine(cores_per_node=2, calibrated_ranks=4, devices_per_node=1 << 20, links=links)
    assert plan.pipeline_speedup(m, 4, 0.75) == pytest.approx(4 / 3)
    assert plan.pipeline_speedup(m, 4, 0.4) == pytest.approx(2.0)  # at most a core per rank
    assert plan.pipeline_speedup(_machine(), 4, 0.5) == 1.0  # devices: no sharing
    lay = plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4, schedule=schedule)
    shared = plan.estimate(model, m, lay)
    own = plan.estimate(model, _machine(cores_per_node=4, calibrated_ranks=4, devices_per_node=1 << 20,
                                        links=links), lay)
    assert own.stage_costs == plan.estimate(model, _machine(devices_per_node=1 << 20, links=links), lay).stage_costs
    speed = plan.pipeline_speedup(m, 4, 1 - shared.bubble_fraction)
    assert speed > 1.15
    for cs, co in zip(shared.stage_costs, own.stage_costs):
        assert cs == pytest.approx(tuple(c / speed for c in co), rel=2e-3)
    assert shared.breakdown["compute"] == pytest.approx(own.breakdown["compute"] / speed, rel=2e-3)


def test_shared_core_speed_is_the_fixed_point_when_fixed_costs_nearly_match_the_compute(model, monkeypatch):
    """8 ranks on 1 core and a schedule whose idle time X is fixed: the busy share at speed s
    is b = 1 / (1 + r s) with r = X / compute = 0.85, so the speed-up 1 / b has its fixed
    point at s = 1 / (1 - r) = 6.67. Iterating s = g(s) converges as r^n: after the 30
    iterations the estimate took before it was still 0.6 % short; bisection finds it."""
    est = __import__("importlib").import_module("fshard.plan.estimate")
    m = _machine(cores_per_node=1, calibrated_ranks=8, devices_per_node=1 << 20)
    lay = plan.Layout({"pp": 2, "fsdp": 4}, batch=16, microbatches=4, schedule="1f1b")
    c, r = 0.01, 0.85
    idle = r * 4 * 2 * c  # X = r * (m * (F + I)) at speed 1

    def fake(layout, costs, p2p):  # the makespan: the busy time plus the fixed idle time
        return 4 * sum(costs[0]) + idle, (1, 1)

    monkeypatch.setattr(est, "simulate_pipeline", fake)
    costs, _ = est._shared_core_pipeline(m, lay, [(c, c, 0.0)] * 2, [(0.0, 0.0, 0.0)] * 2, [0.0, 0.0], 0.0, 0.0)
    assert c / costs[0][0] == pytest.approx(1 / (1 - r), rel=3e-4)


def test_pipeline_speedup_rejects_bad_arguments():
    m = _machine(cores_per_node=2, calibrated_ranks=4)
    for kw, name in (({"ranks_per_node": 0, "busy_share": 0.5}, "ranks_per_node"),
                     ({"ranks_per_node": 2.0, "busy_share": 0.5}, "ranks_per_node"),
                     ({"ranks_per_node": 4, "busy_share": -0.1}, "busy_share"),
                     ({"ranks_per_node": 4, "busy_share": 1.5}, "busy_share"),
                     ({"ranks_per_node": 4, "busy_share": float("nan")}, "busy_share")):
        with pytest.raises(ValueError, match=f"{name} must .*got {kw[name]!r}"):
            plan.pipeline_speedup(m, **kw)
    assert plan.pipeline_speedup(m, 4, 0.0) == pytest.approx(2.0)
    assert plan.pipeline_speedup(m, 4, 1) == 1.0


def test_gpu_pipeline_estimates_do_not_charge_host_time_per_posted_transfer(model, monkeypatch):
    """NCCL posts transfers asynchronously: on a device machine (the shipped h100 / a100
    files) a transfer's latency is on the dependency edge only, and the estimate does not
    depend on how many transfers a rank posts. Before, every machine charged it on the rank
    too, counting the latency twice."""
    est = __import__("importlib").import_module("fshard.plan.estimate")
    for name in ("h100", "a100"):
        gpu = plan.get_machine(name)
        for schedule in ("1f1b", "interleaved"):
            lay = plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4, schedule=schedule)
            with monkeypatch.context() as mp:
                mp.setattr(est, "p2p_counts", lambda sch: [(100, 100)] * 2)
                many = plan.estimate(model, gpu, lay)
            assert many.stage_costs == plan.estimate(model, gpu, lay).stage_costs
            assert many.step_s == plan.estimate(model, gpu, lay).step_s
    # a CPU node's ranks post them on their own thread: there the count matters
    cpu = _machine(cores_per_node=4, calibrated_ranks=4, devices_per_node=1 << 20)
    lay = plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4, schedule="1f1b")
    with monkeypatch.context() as mp:
        mp.setattr(est, "p2p_counts", lambda sch: [(100, 100)] * 2)
        many = plan.estimate(model, cpu, lay)
    assert many.step_s > plan.estimate(model, cpu, lay).step_s


def test_the_pipeline_is_simulated_at_its_slowest_ranks_costs_not_each_kinds_largest():
    """simulate_pipeline takes the slowest rank's forward and backward (by their sum), its
    backward split at the largest I over the ranks: the first stage of a split-backward
    schedule does its whole backward in W (its I is empty), and the kind-wise largest over
    the ranks made a rank slower than any (docs/plan.md); the slowest rank's own split would
    drop the chain of input gradients between the stages when that rank is the first."""
    import sys

    from fshard.sched.simulate import simulate

    E = sys.modules["fshard.plan.estimate"]

    def sim(lay, f, i, w, comm=0.0):
        unit = f / E.RESOLUTION
        return float(simulate(plan.layout_schedule(lay), E.RESOLUTION, max(1, round(i / unit)), round(w / unit),
                              round(comm / unit)).makespan) * unit

    lay = plan.Layout({"pp": 2}, batch=16, microbatches=8, schedule="zb")
    measured = [(35.9, 0.1, 46.8), (41.3, 31.1, 17.2)]  # ms per microbatch, v3 (docs/plan.md)
    makespan, _ = E.simulate_pipeline(lay, measured, 0.0)
    assert makespan == pytest.approx(sim(lay, 41.3, 31.1, 17.2))
    assert makespan < sim(lay, 41.3, 31.1, 46.8)  # the kind-wise largest
    # the first stage the slowest: its forward and backward, split at the others' I (with
    # 4 stages and transfers between them, the chain of I's lengthens the step)
    lay = plan.Layout({"pp": 4}, batch=16, microbatches=4, schedule="zb")
    first_slow = [(50.0, 0.1, 60.0)] + [(42.0, 31.0, 17.0)] * 3
    makespan, _ = E.simulate_pipeline(lay, first_slow, 10.0)
    assert makespan == pytest.approx(sim(lay, 50.0, 31.0, 29.1, 10.0))
    assert makespan > sim(lay, 50.0, 0.1, 60.0, 10.0) + 10  # the first stage's own split: no I chain


def test_a_cpu_transfer_charges_its_latency_once_on_the_posting_rank_not_again_on_the_edge(model):
    """pipeline_transfer: on a CPU node the point-to-point latency is the posting rank's host
    time, and the dependency edge carries the bytes' time only; on devices the edge carries
    both and posting is free. Charging the latency on both put it twice per microbatch on a
    1F1B step's critical path (docs/plan.md: 6-7 points of bubble too many at m=8)."""
    import sys

    from fshard.plan.comm import Collective, pipeline_payload

    E = sys.modules["fshard.plan.estimate"]
    lat, bw = 3e-3, 1e9
    links = {"intra": Link(bw, lat), "inter": Link(bw, lat)}
    lay = plan.Layout({"pp": 2, "tp": 2}, batch=16, microbatches=8, schedule="1f1b")
    payload = pipeline_payload(model, lay)
    full = E.collective_time(_machine(links=links), lay, Collective("send", ("pp",), payload))
    assert full == pytest.approx(lat + payload / bw)
    cpu = _machine(links=links, cores_per_node=4, calibrated_ranks=4, devices_per_node=1 << 20)
    assert E.pipeline_transfer(cpu, lay, model) == pytest.approx((payload / bw, lat))
    assert E.pipeline_transfer(_machine(links=links), lay, model) == pytest.approx((full, 0.0))
    # with no bytes' time the CPU edge is free: the bubble is the schedule's with the posts'
    # host time on the ranks only, below what the latency on the edges as well gives
    fast = dict(links={"intra": Link(1e15, lat), "inter": Link(1e15, lat)}, cores_per_node=4, calibrated_ranks=4,
                devices_per_node=1 << 20)
    e = plan.estimate(model, _machine(**fast), lay)
    costs = [tuple(c) for c in e.stage_costs]
    makespan_edge_free, _ = E.simulate_pipeline(lay, costs, 0.0)
    makespan_edge_lat, _ = E.simulate_pipeline(lay, costs, lat)
    assert e.breakdown["compute"] + e.breakdown["bubble"] == pytest.approx(makespan_edge_free, rel=1e-6)
    assert makespan_edge_lat > makespan_edge_free


def test_each_posted_transfer_costs_its_rank_host_time_outside_the_busy_time(model):
    """On a CPU node the runtime posts every send and receive from the rank's thread (gloo), outside its compute
    spans (StepStats.busy_s leaves them out): each costs the point-to-point latency on the
    rank's timeline, so the schedule with more transfers per microbatch (interleaved: 3 stage
    boundaries cross ranks each way, 1F1B: 1) has the larger bubble. Before, transfers cost
    only a latency on the dependency edge, and interleaved 1F1B's bubble was predicted 9-10
    points below the measured at pp=2, m=4 (docs/plan.md)."""
    from fshard.plan.comm import p2p_counts

    lat = 2e-4
    cpu = dict(cores_per_node=4, calibrated_ranks=4, devices_per_node=1 << 20)  # a core per rank: no speed-up
    slow = _machine(links={"intra": Link(1e9, lat), "inter": Link(1e8, lat)}, **cpu)
    free = _machine(links={"intra": Link(1e9, 0.0), "inter": Link(1e8, 0.0)}, **cpu)
    gap = {}
    for schedule in ("1f1b", "interleaved"):
        lay = plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4, schedule=schedule)
        a, b = plan.estimate(model, slow, lay), plan.estimate(model, free, lay)
        ops = p2p_counts(plan.layout_schedule(lay))
        for r in range(2):
            host = (ops[r][0] + ops[r][1]) * lat / 4
            assert a.stage_costs[r][0] == pytest.approx(b.stage_costs[r][0] + host / 2)
            assert a.stage_costs[r][1] == pytest.approx(b.stage_costs[r][1] + host / 2)
            assert a.stage_costs[r][2] == pytest.approx(b.stage_costs[r][2])
        assert a.breakdown["compute"] == pytest.approx(b.breakdown["compute"])  # busy leaves it out
        gap[schedule] = a.bubble_fraction - b.bubble_fraction
    assert sum(p2p_counts(plan.layout_schedule(plan.Layout({"pp": 2, "fsdp": 2}, batch=16, microbatches=4,
                                                           schedule="interleaved")))[0]) == 24
    assert gap["interleaved"] > gap["1f1b"] > 0

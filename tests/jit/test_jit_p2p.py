"""fs.jit of point-to-point transfers: ``fs.lax.ppermute`` (an ``all_to_all_single`` in the
graph) and ``fs.sched.pipeline_step`` (``fshard.p2p_batch`` nodes; under Inductor the graph is
cut at the transfers and the compute between them compiled region by region,
``fshard/jit/p2p.py``), against eager and a single-process reference.

Moved from tests/jit/test_jit.py. Inductor pipeline steps (cold cache, 2026-11-27, load 5-7):
1F1B 35-61 s and ZB-H1 2-6 s of wall time, the ZB-H1 one reusing most of 1F1B's compiled
regions; both together 30-35 s of CPU, about 9 s of it in the ranks and the rest in
Inductor's C++ compiler processes (which FSHARD_TEST_CPU_PROFILE's ``live`` column does not
see); about 3 s and under 1 s warm. The first call's mechanics (compile ahead, the ranks'
agreement, a failure on one rank, AdamW's in-place regions) are tested with regions compiled
by AOTAutograd or run as they are: seconds, no code generation.
"""

import contextlib
import logging
import math
import os
import re
import warnings

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

F64 = torch.float64


# --- fs.lax.ppermute under fs.jit ----------------------------------------------------------
# (mesh, axis the perm runs over, perm over that axis); the batch is sharded over every mesh
# axis (block k of rank k), the weight over the perm's axis only.
_PERMS = {
    "ring2": ({"x": 2}, "x", [(0, 1), (1, 0)]),
    "ring4": ({"x": 4}, "x", [(0, 1), (1, 2), (2, 3), (3, 0)]),
    # rank 0 sends only, rank 1 receives only (zeros in forward, nothing sent in backward)
    "partial2": ({"x": 2}, "x", [(0, 1)]),
    # 0 -> 2 -> 3, 1 keeps its own value, 0 receives zeros, 3 sends nothing
    "partial4": ({"x": 4}, "x", [(0, 2), (2, 3), (1, 1)]),
    # a 2-D mesh, the ring over its minor axis only: a sub-group per value of "a"
    "mesh2d": ({"a": 2, "b": 2}, "b", [(0, 1), (1, 0)]),
}


def _ppermute_reference(mesh_shape, axis, perm, W, X, T):
    """The global computation (one process): the loss and its gradient in W."""
    axes = list(mesh_shape)
    sizes = [mesh_shape[a] for a in axes]
    k = axes.index(axis)
    coords = [tuple(int(c) for c in torch.unravel_index(torch.tensor(r), sizes)) for r in range(len(X) // 2)]
    W = W.clone().requires_grad_()
    H = [torch.tanh(X[2 * r:2 * r + 2] @ W[4 * c[k]:4 * c[k] + 4]) for r, c in enumerate(coords)]
    loss = 0
    for r, c in enumerate(coords):
        srcs = [s for s, d in perm if d == c[k]]
        y = H[coords.index(c[:k] + (srcs[0],) + c[k + 1:])] if srcs else torch.zeros_like(H[r])
        loss = loss + ((y - T[2 * r:2 * r + 2]) ** 2).sum()
    (g,) = torch.autograd.grad(loss, W)
    return loss.detach(), g


def _jit_ppermute_body(case, order, check, backend):
    mesh_shape, axis, perm = _PERMS[case]
    mesh = fs.make_mesh(mesh_shape)
    every = tuple(mesh_shape)
    others = tuple(a for a in every if a != axis)
    n_ax, world = mesh_shape[axis], torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(4 * n_ax, 3, generator=gen, dtype=F64)
    X, T = torch.randn(2 * world, 4, generator=gen, dtype=F64), torch.randn(2 * world, 3, generator=gen, dtype=F64)
    specs = (P(axis), P(every), P(every))

    def body(w, x, t):
        y = fs.lax.ppermute(torch.tanh(x @ w), axis, perm)
        return fs.lax.psum(((y - t) ** 2).sum(), every)

    if order == "inside":
        def body_vg(w, x, t):
            loss, g = fs.value_and_grad(body)(w, x, t)
            if others and not check:  # w is replicated over the other axes: sum its grads there
                g = fs.lax.psum(g, others)
            return loss, g
        f = fs.shard_map(body_vg, mesh=mesh, in_specs=specs, out_specs=(P(), P(axis)), check=check)
    else:
        f = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check=check))
    jf = fs.jit(f, backend=backend)
    args = (fs.shard(W, P(axis), mesh), fs.shard(X, P(every), mesh), fs.shard(T, P(every), mesh))
    with fs.comm_log() as elog:
        el, eg = f(*args)
    with fs.comm_log() as jlog:
        jl, jg = jf(*args)
    with fs.comm_log() as jlog2:  # a second call runs the cached graph
        jl2, jg2 = jf(*args)
    rl, rg = _ppermute_reference(mesh_shape, axis, perm, W, X, T)
    graph = jf.graph(*args).code
    return {
        "jit_vs_eager": max((jl.full_tensor() - el.full_tensor()).abs().item(),
                            (jg.full_tensor() - eg.full_tensor()).abs().max().item(),
                            (jl2.full_tensor() - el.full_tensor()).abs().item(),
                            (jg2.full_tensor() - eg.full_tensor()).abs().max().item()),
        "eager_vs_reference": max((el.full_tensor() - rl).abs().item(), (eg.full_tensor() - rg).abs().max().item()),
        "zero_grad_rows": int((rg.abs().sum(1) == 0).sum()),
        "logs": [(dict(log.counts), dict(log.wire_by_axis), dict(log.bytes_by_axis)) for log in (elog, jlog, jlog2)],
        "timelines": [[(e.what, e.kind) for e in log.timeline if e.kind == "ppermute"] for log in (elog, jlog)],
        "all_to_all_in_graph": graph.count("_c10d_functional.all_to_all_single"),
        "cache_size": jf.cache_size,
        "me": mesh.axis_index(axis),
    }


@pytest.mark.parametrize("case, order, check", [
    ("ring2", "inside", True), ("ring4", "outside", False), ("partial2", "outside", True),
    ("partial4", "inside", False), ("partial4", "outside", True), ("mesh2d", "inside", False),
    ("mesh2d", "outside", True)])
def test_jit_ppermute_values_grads_and_comm_log_equal_eager_float64(case, order, check):
    # ppermute runs as an all_to_all_single with per-rank split sizes (one peer gets the
    # whole tensor, the others nothing), so fs.jit captures it, forward and backward (the
    # inverse perm), in both orders of shard_map and value_and_grad.
    mesh_shape, axis, perm = _PERMS[case]
    world = math.prod(mesh_shape.values())
    for r in run_on_ranks(_jit_ppermute_body, case, order, check, "aot_eager", world_size=world):
        assert r["jit_vs_eager"] <= 1e-12 and r["eager_vs_reference"] <= 1e-12, r
        assert r["cache_size"] == 1, r
        # Forward and backward exchange, both in the graph, both logged as in eager; this rank's
        # bytes on the wire: its (2, 3) float64 block once per direction in which it has a peer.
        assert r["all_to_all_in_graph"] == 2, r
        me = r["me"]
        sends = sum(1 for s, d in perm if s == me != d) + sum(1 for s, d in perm if d == me != s)
        elog, jlog, jlog2 = r["logs"]
        assert elog == jlog == jlog2, r
        assert elog[0]["ppermute"] == 2 and elog[1][("ppermute", (axis,))] == 48 * sends, r
        assert r["timelines"][0] == r["timelines"][1] == [("issue", "ppermute"), ("wait", "ppermute")] * 2, r
    if case.startswith("partial"):
        # Some rank's weight block gets no gradient (its block is sent nowhere, or to zeros):
        # the reference really has the zero rows the jitted partial perm must reproduce.
        assert r["zero_grad_rows"] > 0


def test_jit_ppermute_inductor_equals_eager_float64():
    # Inductor lowers the all_to_all_single with zero splits (rank 0 sends its whole block
    # and receives nothing, rank 1 the reverse) and the zeros of the rank that receives nothing.
    for r in run_on_ranks(_jit_ppermute_body, "partial2", "inside", True, "inductor", world_size=2,
                          timeout_s=600):
        assert r["jit_vs_eager"] <= 1e-12 and r["eager_vs_reference"] <= 1e-12, r
        assert r["logs"][0] == r["logs"][1] == r["logs"][2] and r["all_to_all_in_graph"] == 2, r


# --- pipeline parallelism: fs.sched.pipeline_step ----------------------------------------
# The model of tests/sched/test_sched_runtime.py, smaller: a float64 MLP whose parameter tree
# keeps each layer's global index as its key; stage s of n holds layers {4/n*s, ...}. (Built
# here: the test directories are no packages, so the ranks could not import that module.)
_PP_D, _PP_LAYERS = 6, 4

_PP_OPTIMIZERS = {"adamw": lambda: fs.optim.adamw(1e-2, weight_decay=0.1), "sgd": lambda: fs.optim.sgd(0.5)}


def _pp_params():
    g = torch.Generator().manual_seed(0)
    return {str(i): {"weight": torch.randn(_PP_D, _PP_D, generator=g, dtype=F64) / _PP_D ** 0.5,
                     "bias": torch.randn(_PP_D, generator=g, dtype=F64) * 0.1} for i in range(_PP_LAYERS)}


def _pp_layers(params, x):
    for key in sorted(params, key=int):
        x = torch.tanh(x @ params[key]["weight"].T + params[key]["bias"])
    return x


def _pp_stage_fn(params, x, stage):
    return _pp_layers(params, x)


def _pp_loss_fn(y, t):
    return ((y - t) ** 2).mean()


def _pp_data(rows, step):
    g = torch.Generator().manual_seed(1 + step)
    return torch.randn(rows, _PP_D, generator=g, dtype=F64), torch.randn(rows, _PP_D, generator=g, dtype=F64)


def _pp_held(schedule, rank, params):
    per = _PP_LAYERS // schedule.n_stages
    return {s: {str(i): params[str(i)] for i in range(s * per, (s + 1) * per)} for s in schedule.stages_of(rank)}


def _pp_diff(a, b):
    return max((u - v).abs().max().item() for u, v in zip(fs.tree.leaves(a), fs.tree.leaves(b)))


def _jit_pipeline_body(schedule, m, backend, optimizer, steps):
    """A pipeline train step (pipeline_step, then an optimizer update of this rank's stages),
    ``steps`` times eagerly and jitted from the same start."""
    mesh = fs.make_mesh({"pp": 2})
    rank = mesh.axis_index("pp")
    sch = getattr(fs.sched, schedule)(2, m)
    opt = _PP_OPTIMIZERS[optimizer]()
    params = _pp_params()

    def train(p, state, x, y):
        stage_params = [p.get(s) for s in range(sch.n_stages)]
        loss, grads = fs.sched.pipeline_step(_pp_stage_fn, _pp_loss_fn, stage_params, (x, y), schedule=sch,
                                             mesh=mesh)
        grads = {s: grads[s] for s in p}
        updates, state = opt.update(grads, state, p)
        return loss, grads, fs.optim.apply_updates(p, updates), state

    jtrain = fs.jit(train, backend=backend)
    ep = jp = _pp_held(sch, rank, params)
    es = js = opt.init(ep)
    out = {"err": 0.0, "losses": [], "logs_equal": True}
    for s in range(steps):
        x, y = _pp_data(2 * m, s)
        with fs.comm_log() as elog:
            el, eg, ep2, es = train(ep, es, x, y)
        with fs.comm_log() as jlog, _jit_info_log() as records:
            jl, jg, jp, js = jtrain(jp, js, x, y)
        if s == 0:
            out["regions"] = _regions_logged(records)
        out["err"] = max(out["err"], (jl - el).abs().item(), _pp_diff(jg, eg), _pp_diff(jp, ep2))
        out["logs_equal"] &= (dict(elog.counts), dict(elog.bytes_by_axis), dict(elog.wire_by_axis)) == \
            (dict(jlog.counts), dict(jlog.bytes_by_axis), dict(jlog.wire_by_axis))
        if s == 0:
            out["log"] = dict(elog.counts)
            # The unpipelined model on one process: eager (and so jit) computes the right step 0.
            rl, rg = fs.value_and_grad(lambda p: _pp_loss_fn(_pp_layers(p, x), y))(params)
            out["ref_err"] = max(abs(el.item() - rl.item()),
                                 max(_pp_diff(eg[st][k], rg[k]) for st in eg for k in eg[st]))
            x0, y0, p0, s0 = x, y, jp, js
        out["losses"].append(jl.item())
        ep = ep2
    # torch.ops.fshard.p2p_batch.default([True, False], [peer, peer], [tensors], group): True sends.
    batches = re.findall(r"fshard\.p2p_batch\.default\(\[([^\]]*)\]", jtrain.graph(p0, s0, x0, y0).code)
    kinds = ",".join(batches)
    out["graph_batches"] = len(batches)
    out["graph_sends"], out["graph_recvs"] = kinds.count("True"), kinds.count("False")
    out["cache_size"] = jtrain.cache_size
    return out


@contextlib.contextmanager
def _jit_info_log():
    """fshard.jit's INFO messages while the block runs (a list, filled in)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    jlog = logging.getLogger("fshard.jit")
    level = jlog.level
    jlog.addHandler(handler)
    jlog.setLevel(logging.INFO)
    try:
        yield records
    finally:
        jlog.removeHandler(handler)
        jlog.setLevel(level)


def _regions_logged(records: list[str]):
    """(transfer nodes run eagerly, compiled regions, distinct compiles) from fs.jit's log of an
    Inductor compile of a graph with point-to-point transfers; None if there was none."""
    for msg in records:
        m = re.search(r"(\d+) transfer nodes and \d+ others run eagerly between (\d+) compiled regions "
                      r"\((\d+) distinct", msg)
        if m:
            return tuple(int(g) for g in m.groups())
    return None


@pytest.mark.parametrize("schedule, m, backend, optimizer", [
    ("one_f_one_b", 4, "aot_eager", "adamw"), ("gpipe", 2, "aot_eager", "sgd"), ("one_f_one_b", 2, None, "sgd"),
    ("gpipe", 4, None, "adamw"), ("interleaved_1f1b", 4, None, "sgd"), ("zero_bubble", 2, None, "sgd"),
    ("one_f_one_b", 4, "inductor", "sgd"), ("zero_bubble", 2, "inductor", "sgd")])
def test_jit_pipeline_train_step_equals_eager_float64(schedule, m, backend, optimizer):
    # Each run of SEND/RECV actions is one functional fshard.p2p_batch in the graph, each wait a
    # wait_tensor; the activation headers were exchanged while tracing, so the graph has one
    # isend/irecv per payload transfer of the schedule, as eager logs them. Under Inductor the
    # compute between the transfers is compiled region by region and the transfers run eagerly
    # in program order (compiled whole, 1F1B m=4 deadlocked: the timeout catches a regression).
    steps = 3
    for r in run_on_ranks(_jit_pipeline_body, schedule, m, backend, optimizer, steps, world_size=2, timeout_s=300):
        if backend == "inductor":
            # Every p2p_batch, its getitem and its wait run eagerly; the compute is compiled,
            # equal regions (the microbatches' forwards, later backwards) compiled once.
            transfers = r["graph_sends"] + r["graph_recvs"]
            n_eager, n_regions, n_distinct = r["regions"]
            assert n_eager == r["graph_batches"] + 2 * transfers and 2 <= n_distinct <= n_regions, r
            assert m < 4 or n_distinct < n_regions, r  # steady state: repeated forwards and backwards
        else:
            assert r["regions"] is None, r
        assert r["err"] <= 1e-12 and r["ref_err"] <= 1e-12, r
        assert r["logs_equal"] and r["cache_size"] == 1, r
        assert len(set(r["losses"])) == steps, r  # the parameters really change from step to step
        assert r["graph_sends"] == r["log"]["send"] > 0 and r["graph_recvs"] == r["log"]["recv"] > 0, r
        assert r["log"]["broadcast"] == 1, r  # the loss, from the last stage's rank


def _jit_pipeline_dp_body(stage_fsdp, backend="aot_eager"):
    """pp=2 x dp=2 (the pipeline groups' ranks are not their global ranks): the data-parallel
    gradient sum (or, with stage-level FSDP, the gathers and reduce-scatters) and the loss
    broadcast and mean are functional collectives of the graph."""
    mesh = fs.make_mesh({"dp": 2, "pp": 2})
    rank = mesh.axis_index("pp")
    sch = fs.sched.one_f_one_b(2, 2)
    held = _pp_held(sch, rank, _pp_params())
    if stage_fsdp:
        held = {s: fs.shard(e, fs.parallel.fsdp_specs(e, axis="dp"), mesh) for s, e in held.items()}
    stage_params = [held.get(s) for s in range(sch.n_stages)]
    x, y = _pp_data(8, 0)

    def step(sp, x, y):
        return fs.sched.pipeline_step(_pp_stage_fn, _pp_loss_fn, sp, (x, y), schedule=sch, mesh=mesh,
                                      data_axes="dp", fsdp="dp" if stage_fsdp else None)

    with fs.comm_log() as elog:
        el, eg = step(stage_params, x, y)
    jstep = fs.jit(step, backend=backend)
    with fs.comm_log() as jlog:
        jl, jg = jstep(stage_params, x, y)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in fs.tree.leaves(jg)]
    elocal = [t.to_local() if hasattr(t, "to_local") else t for t in fs.tree.leaves(eg)]
    rl, rg = fs.value_and_grad(lambda p: _pp_loss_fn(_pp_layers(p, x), y))(_pp_params())
    ref_err = abs(el.item() - rl.item())
    for s in held:
        for k in held[s]:
            ref_err = max(ref_err, _pp_diff(fs.gather(eg[s][k]) if stage_fsdp else eg[s][k], rg[k]))
    return {"err": max((jl - el).abs().item(), max((a - b).abs().max().item() for a, b in zip(local, elocal))),
            "ref_err": ref_err, "logs": (dict(elog.counts), dict(jlog.counts)),
            "wire": (dict(elog.wire_by_axis), dict(jlog.wire_by_axis))}


@pytest.mark.parametrize("stage_fsdp, backend", [(False, "aot_eager"), (True, "aot_eager"), pytest.param(
    False, "inductor", marks=pytest.mark.skipif(not os.environ.get("FSHARD_TEST_INDUCTOR_STEP"), reason=(
        "Inductor compiles of the dp=2 x pp=2 step's regions (4 ranks; none shared with the pp=2 tests): "
        "18 s cold at load 6 on the shared 2-core CI machine, on top of the pp=2 Inductor tests (54 s cold); "
        "set FSHARD_TEST_INDUCTOR_STEP=1 to run it. The pp=2 tests check the split under Inductor, the "
        "aot_eager cases the same captured dp x pp graph.")))])
def test_jit_pipeline_with_data_parallel_axis_equals_eager_float64(stage_fsdp, backend):
    # Under Inductor the data-parallel all-reduces are compiled in the regions between the
    # pipeline's transfers; the two ranks of a stage compile its regions once (fs.jit's
    # once-per-host compile: their graphs are equal once the batch slices are hoisted).
    for r in run_on_ranks(_jit_pipeline_dp_body, stage_fsdp, backend, world_size=4, timeout_s=300):
        assert r["err"] <= 1e-12 and r["ref_err"] <= 1e-12, r
        assert r["logs"][0] == r["logs"][1] and r["wire"][0] == r["wire"][1], r
        assert r["logs"][0]["psum_scatter" if stage_fsdp else "psum"] >= 1, r


def _jit_pipeline_refusals_body():
    mesh = fs.make_mesh({"pp": 2})
    sch = fs.sched.one_f_one_b(2, 2)
    held = _pp_held(sch, mesh.axis_index("pp"), _pp_params())
    sp = [held.get(s) for s in range(sch.n_stages)]
    x, y = _pp_data(4, 0)

    def step(sp, x, y, stats=False):
        return fs.sched.pipeline_step(_pp_stage_fn, _pp_loss_fn, sp, (x, y), schedule=sch, mesh=mesh,
                                      return_stats=stats)[:2]

    out = {}
    with pytest.raises(fs.JitCaptureError) as e:
        fs.jit(step, backend=None)(sp, x, y, True)
    out["stats"] = str(e.value)
    def whole_graph(gm, example_inputs):  # a backend that would compile the graph as one
        return gm

    with pytest.raises(Exception) as e:
        fs.jit(step, backend=whole_graph)(sp, x, y)
    out["reordering"] = (type(e.value).__name__, str(e.value))
    el, eg = step(sp, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jl, jg = fs.jit(step, backend=whole_graph, on_capture_error="eager")(sp, x, y)
    out["fallback"] = ([str(w.message) for w in caught], max((jl - el).abs().item(), _pp_diff(jg, eg)))
    return out


def test_jit_pipeline_refuses_stats_and_whole_graph_backends_clearly():
    # StepStats (wall-clock timings, the trace's fake losses) cannot be a captured result; the
    # error comes before any transfer, so no peer waits for it. A backend that would compile the
    # whole graph may reorder and fuse kernels across the transfers (Inductor did: a deadlock):
    # refused before compiling, or run eagerly with a warning; the message names the backends
    # that run such graphs.
    for r in run_on_ranks(_jit_pipeline_refusals_body, world_size=2, timeout_s=300):
        assert "pipeline_step(return_stats=True) cannot be captured" in r["stats"], r
        assert "test_jit_p2p.py" in r["stats"], r
        name, msg = r["reordering"]
        assert name == "JitCaptureError" and "point-to-point" in msg and "whole_graph" in msg, r
        assert "backend='inductor'" in msg and "aot_eager" in msg, r
        warned, err = r["fallback"]
        assert err == 0.0 and any("point-to-point" in w and "eagerly" in w for w in warned), r


def test_jit_p2p_split_keeps_transfers_in_order_and_collectives_whole():
    # fs.jit's Inductor path for graphs with transfers (fshard/jit/p2p.py), on a hand-built
    # graph (nothing runs): each transfer node is a segment of its own, in program order; the
    # compute between is one region; an all-reduce whose wait lies beyond a transfer runs
    # eagerly with its wait (a region returns no collective in flight); a receive's buffer
    # template and the detach of an input run on their own (so equal compute makes equal regions).
    import operator

    from fshard.jit import p2p as _jit_p2p

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.sin.default, (x,))
    ar = g.call_function(c10d.all_reduce.default, (a, "sum", "0"))
    tmpl = g.call_function(aten.empty.memory_format, ([3],), {"dtype": torch.float64})
    p = g.call_function(torch.ops.fshard.p2p_batch.default, ([True, False], [1, 1], [a, tmpl], "0"))
    sent, got = g.call_function(operator.getitem, (p, 0)), g.call_function(operator.getitem, (p, 1))
    d = g.call_function(aten.detach.default, (x,))
    b = g.call_function(aten.cos.default, (d,))
    w = g.call_function(c10d.wait_tensor.default, (ar,))
    wg = g.call_function(c10d.wait_tensor.default, (got,))
    c = g.call_function(aten.add.Tensor, (w, b))
    c2 = g.call_function(aten.mul.Tensor, (c, wg))
    ws = g.call_function(c10d.wait_tensor.default, (sent,))
    g.output([c2, ws])
    segs = _jit_p2p.split_at_transfers(torch.fx.GraphModule(torch.nn.Module(), g))
    shape = [(kind, what.target.__name__ if kind != "region" else
              tuple(n.target.__name__ for n in what.graph.nodes if n.op == "call_function")) for kind, what, _, _ in segs]
    assert shape == [("eager", "detach.default"), ("region", ("sin.default",)), ("eager", "all_reduce.default"),
                     ("eager", "empty.memory_format"), ("transfer", "p2p_batch.default"), ("transfer", "getitem"),
                     ("transfer", "getitem"), ("region", ("cos.default",)), ("eager", "wait_tensor.default"),
                     ("transfer", "wait_tensor.default"), ("region", ("add.Tensor", "mul.Tensor")),
                     ("transfer", "wait_tensor.default")], shape


# --- the first call of a pipeline under Inductor: compile ahead, agree, then transfer -----
def _interpreted(gm, args, options=None, bucketing=True):
    """A stand-in for fs.jit's Inductor compile of a region: the region run as it is (no
    codegen: these tests are about when and where regions compile, not what Inductor makes)."""
    return gm


def _jit_pipeline_first_call_body(mode):
    """A 1F1B pp=2 step with AdamW (gradients accumulate in place over the microbatches)
    under fs.jit(backend="inductor"), with fs.jit's region compile replaced on this rank:
    ``"fail"``/``"fallback"``: rank 1's compile raises (``on_capture_error`` "raise" /
    "eager"); ``"ahead"``: no failure; records how many regions had compiled when the ranks
    agreed (before the first transfer) and how many in all."""
    import sys
    import time

    from fshard.jit import p2p as _jit_p2p

    fjit = sys.modules["fshard.jit.compile"]  # the compiled region looks _inductor_compile up here

    mesh = fs.make_mesh({"pp": 2})
    rank = mesh.axis_index("pp")
    sch = fs.sched.one_f_one_b(2, 4)
    opt = _PP_OPTIMIZERS["adamw"]()
    p = _pp_held(sch, rank, _pp_params())
    state = opt.init(p)
    x, y = _pp_data(8, 0)

    def train(p, state, x, y):
        loss, grads = fs.sched.pipeline_step(_pp_stage_fn, _pp_loss_fn, [p.get(s) for s in range(sch.n_stages)],
                                             (x, y), schedule=sch, mesh=mesh)
        updates, state = opt.update({s: grads[s] for s in p}, state, p)
        return loss, fs.optim.apply_updates(p, updates), state

    compiled, at_agreement = [], []

    def compile_region(gm, args, options=None, bucketing=True):
        if mode in ("fail", "fallback") and rank == 1:
            raise RuntimeError("injected region compile failure")
        compiled.append(_jit_p2p._mutates(gm))
        if mode == "ahead":  # AOTAutograd without codegen: its functionalization of the in-place ops
            from torch._functorch.aot_autograd import aot_module_simplified

            return aot_module_simplified(gm, list(args), fw_compiler=lambda g, _: g)
        return _interpreted(gm, args)

    real_compile, real_agree = fjit._inductor_compile, _jit_p2p.agree

    def agree(error):
        at_agreement.append(len(compiled))
        return real_agree(error)

    fjit._inductor_compile, _jit_p2p.agree = compile_region, agree
    out = {}
    try:
        el, ep, es = train(p, state, x, y)
        jtrain = fs.jit(train, on_capture_error="eager" if mode == "fallback" else "raise")
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                jl, jp, js = jtrain(p, state, x, y)
                out["err"] = max((jl - el).abs().item(), _pp_diff(jp, ep))
                # A second step (from the updated state): the compiled regions again, or (fallback)
                # eager from now on, without a second warning.
                x, y = _pp_data(8, 1)
                el, ep, _ = train(ep, es, x, y)
                jl, jp, _ = jtrain(jp, js, x, y)
                out["err"] = max(out["err"], (jl - el).abs().item(), _pp_diff(jp, ep))
            except fs.JitCaptureError as e:
                out["error"] = str(e)
        out["seconds"] = time.perf_counter() - t0
        out["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    finally:
        fjit._inductor_compile, _jit_p2p.agree = real_compile, real_agree
    out["compiled"], out["at_agreement"], out["rank"] = compiled, at_agreement, rank
    return out


def test_jit_pipeline_compile_failure_on_one_rank_stops_every_rank_at_once():
    # Rank 1's region compile fails: before, rank 0 ran on into its first receive and waited
    # there for the process group's timeout (then reported its gloo error as a compile
    # failure). The ranks now agree on the outcome after compiling, before any transfer:
    # both raise within seconds, naming rank 1 and its error.
    for r in run_on_ranks(_jit_pipeline_first_call_body, "fail", world_size=2, timeout_s=120, grace_s=2):
        assert "error" in r and r["seconds"] < 20, r
        assert "rank 1: RuntimeError: injected region compile failure" in r["error"], r
        if r["rank"] == 0:
            assert "on another rank of the pipeline" in r["error"] and "stops too" in r["error"], r
            assert len(r["compiled"]) == r["at_agreement"][0] > 0, r  # its own regions compiled
        else:
            assert "could not compile (backend='inductor')" in r["error"], r
            assert "Every rank stops before its first transfer" in r["error"], r


def test_jit_pipeline_compile_failure_falls_back_to_eager_on_every_rank():
    # With on_capture_error="eager", every rank sees the failure before any transfer, so every
    # rank warns and runs the step eagerly (the same transfers on both: no rank waits).
    for r in run_on_ranks(_jit_pipeline_first_call_body, "fallback", world_size=2, timeout_s=120, grace_s=2):
        assert "error" not in r and r["err"] == 0.0 and r["seconds"] < 20, r
        assert len(r["warned"]) == 1, r
        assert "rank 1: RuntimeError: injected region compile failure" in r["warned"][0], r
        assert "runs this signature eagerly" in r["warned"][0], r


def test_jit_pipeline_compiles_every_region_before_the_first_transfer_float64():
    # Regions with in-place ops (AdamW's step's gradient accumulation over the microbatches)
    # compiled when the call reached them, after transfers were posted: a slow compile on a
    # loaded host could approach a peer's receive timeout. Every region now compiles before
    # the ranks agree, which is before the first transfer. The regions go through
    # AOTAutograd (as under Inductor, without its code generation: seconds instead of a
    # minute cold), so this is also the split path's AdamW test: two steps equal eager.
    for r in run_on_ranks(_jit_pipeline_first_call_body, "ahead", world_size=2, timeout_s=120):
        assert r["err"] <= 1e-12 and r["warned"] == [], r
        assert r["at_agreement"] == [len(r["compiled"])], r
        assert any(r["compiled"]), r  # some region mutates an input


def _mutate_first_read_second(x, y):
    x.add_(1)
    return [y * 2]


def test_jit_p2p_region_recompiles_when_its_inputs_overlap_differently_float64():
    # A region that writes into one input and reads another is compiled by AOTAutograd for
    # the overlaps of its example inputs: compiled for disjoint inputs and called with the
    # same tensor twice, it returned 2 * y from before the write (eager: after). Overlaps
    # are part of a region's key: each call gets code compiled for its own, and equals eager.
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch.fx.experimental.proxy_tensor import make_fx

    from fshard.jit import p2p as _jit_p2p

    gm = make_fx(_mutate_first_read_second, tracing_mode="fake")(torch.zeros(4, dtype=F64),
                                                                 torch.zeros(4, dtype=F64))
    seg = _jit_p2p.Segmented(gm, lambda g, a: aot_module_simplified(g, list(a), fw_compiler=lambda g2, _: g2),
                             key=lambda g, a: repr([(t.shape, t.stride(), t.dtype) for t in a]))
    seg.compile_ahead()
    assert seg.n_compiled == 1
    for same in (False, True, False, True):
        x, y = torch.arange(4, dtype=F64), torch.arange(4, dtype=F64) * 3
        args = (x, x) if same else (x, y)
        ex, ey = x.clone(), y.clone()
        want = _mutate_first_read_second(*((ex, ex) if same else (ex, ey)))[0]
        got = seg(*args)[0]
        assert torch.equal(got, want) and torch.equal(x, ex), (same, got, want)
    assert seg.n_compiled == 2  # one compile per overlap pattern, reused
    assert _jit_p2p.overlaps((x, x[1:], x[:1], y, x.view(2, 2)[:, 0])) == ((0, 1), (0, 2), (0, 4), (1, 4), (2, 4))
    # Views of one storage in two dtypes compare in bytes: the int32 view's elements 4.. are
    # bytes 16-31, x's last two float64 elements (in elements of their own dtypes, 4.. and 0..4
    # would look disjoint).
    assert _jit_p2p.overlaps((x[2:], x.view(torch.int32)[4:], x[:1])) == ((0, 1),)


def test_jit_p2p_agrees_over_the_world_only_when_the_step_spans_it():
    # The compile agreement is an all_gather over the default group: a step whose groups (or
    # input meshes) do not cover the world would leave the other ranks out of it.
    assert run_on_ranks(_spans_world_body, world_size=2) == [(True, False, True)] * 2


def _spans_world_body():
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_reduce
    from torch.fx.experimental.proxy_tensor import make_fx

    from fshard.jit import p2p as _jit_p2p

    world = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    x = torch.ones(2)
    on_world = make_fx(lambda t: all_reduce(t, "sum", world))(x).graph
    on_own = make_fx(lambda t: all_reduce(t, "sum", alone))(x).graph
    mesh = fs.make_mesh({"x": dist.get_world_size()})
    return (_jit_p2p.spans_world(on_world, []), _jit_p2p.spans_world(on_own, []),
            _jit_p2p.spans_world(on_own, [mesh.device_mesh]))

"""pipeline_step on real gloo ranks: every generator's loss and gradients against the
unpipelined model (float64, 1e-10), executor peak activations against the simulator,
I/W split without recomputation, p2p counts in comm_log, dp x pp and pp x tp
compositions, and bad input.

The model is an 8-layer float64 MLP whose parameter tree keeps each layer's global
index as its key (seed scenario 29): stage s of n holds layers
``{8/n*s, ..., 8/n*(s+1)-1}`` under their own names.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

D, H, N_LAYERS = 6, 8, 8
TOL = 1e-10


class _Count(torch.autograd.Function):
    """Identity that counts its backward calls (one per stage output per microbatch)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Count.calls += 1
        return g


def _init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {str(i): {"weight": torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5,
                     "bias": torch.randn(D, generator=g, dtype=torch.float64) * 0.1}
            for i in range(N_LAYERS)}


def _layers(params, x):
    for key in sorted(params, key=int):
        x = torch.tanh(x @ params[key]["weight"].T + params[key]["bias"])
    return x


def _stage_fn(params, x, stage):
    return _Count.apply(_layers(params, x))


def _loss_fn(y, t):
    return ((y - t) ** 2).mean()


def _data(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, D, generator=g, dtype=torch.float64),
            torch.randn(rows, D, generator=g, dtype=torch.float64))


def _stage_params(params, schedule, rank, as_dtensor_mesh=None):
    per = N_LAYERS // schedule.n_stages
    held = schedule.stages_of(rank)
    out = []
    for s in range(schedule.n_stages):
        if s not in held:
            out.append(None)
            continue
        entry = {str(i): params[str(i)] for i in range(s * per, (s + 1) * per)}
        if as_dtensor_mesh is not None:
            entry = fs.shard(entry, P(), as_dtensor_mesh)
        out.append(entry)
    return out


def _reference(params, x, y):
    return fs.value_and_grad(lambda p: _loss_fn(_layers(p, x), y))(params)


def _max_err(grads, ref_grads):
    err = 0.0
    for entry in grads:
        if entry is None:
            continue
        for key, leaves in entry.items():
            for name, g in leaves.items():
                g = g.to_local() if isinstance(g, DTensor) else g
                err = max(err, (g - ref_grads[key][name]).abs().max().item())
    return err


def _make(name, n, m, kw):
    kw = dict(kw)
    lowered, hooks = kw.pop("lowered", False), kw.pop("hooks", False)
    sch = getattr(fs.sched, name)(n, m, **kw)
    if hooks:  # FSDP hook actions are accepted (no-ops without data axes or hooks)
        sch = fs.sched.add_unshard_reshard(fs.sched.add_reduce_grad(sch))
    return fs.sched.lower(sch) if lowered else sch


# --- every generator against the unpipelined model --------------------------------------

def _parity_body(cases):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"pp": n})
    rank = mesh.axis_index("pp")
    params = _init()
    out = []
    for name, kw, m in cases:
        sch = _make(name, n, m, kw)
        x, y = _data(2 * m)
        ref_loss, ref_grads = _reference(params, x, y)
        sp = _stage_params(params, sch, rank)
        _Count.calls = 0
        with fs.comm_log() as log:
            loss, grads, stats = fs.sched.pipeline_step(
                _stage_fn, _loss_fn, sp, (x, y), schedule=sch, mesh=mesh, return_stats=True)
        lowered = sch if sch.is_lowered else fs.sched.lower(sch)
        mb_losses = None
        if stats.losses is not None:
            rows = [slice(2 * i, 2 * i + 2) for i in range(m)]
            mb_losses = max(abs(stats.losses[i].item()
                                - _loss_fn(_layers(params, x[r]), y[r]).item())
                            for i, r in enumerate(rows))
        out.append({
            "case": f"{name}{kw} m={m}",
            "loss_err": abs(loss.item() - ref_loss.item()),
            "grad_err": _max_err(grads, ref_grads),
            "held_only": all((g is None) == (s not in sch.stages_of(rank))
                             for s, g in enumerate(grads)),
            "peak": stats.peak_activations,
            "sim_peak": fs.sched.simulate(sch).peak_activations[rank],
            # One backward of each stage output per microbatch: W never re-runs I's chain.
            "backward_calls": _Count.calls,
            "expected_calls": m * len(sch.stages_of(rank)),
            "sends": (log.counts["send"], sum(a.kind.value in ("SEND_F", "SEND_B")
                                              for a in lowered.actions[rank])),
            "recvs": (log.counts["recv"], sum(a.kind.value in ("RECV_F", "RECV_B")
                                              for a in lowered.actions[rank])),
            "mb_losses": mb_losses,
            "last": rank == sch.last_rank,
        })
    return out


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
            assert r["held_only"], r
            assert r["peak"] == r["sim_peak"], r
            assert r["backward_calls"] == r["expected_calls"], r
            assert r["sends"][0] == r["sends"][1] and r["recvs"][0] == r["recvs"][1], r
            assert (r["mb_losses"] is not None) == r["last"], r
            if r["last"]:
                assert r["mb_losses"] < TOL, r


PP2_CASES = [
    ("gpipe", {}, 4), ("one_f_one_b", {}, 4), ("interleaved_1f1b", {}, 4),
    ("looped_bfs", {}, 4), ("zero_bubble", {}, 4), ("zero_bubble", {"n_virtual": 2}, 4),
    ("zbv", {}, 4), ("dualpipev", {}, 4), ("zb_h2", {}, 4),
    ("one_f_one_b", {}, 1), ("interleaved_1f1b", {}, 6), ("zbv", {}, 2),
    ("dualpipev", {"overlap": False}, 4), ("one_f_one_b", {"lowered": True}, 4),
    ("zero_bubble", {"n_virtual": 2, "hooks": True}, 4),
]


def test_every_generator_pp2_matches_unpipelined_model_and_simulated_peaks():
    _check(run_on_ranks(_parity_body, PP2_CASES, world_size=2))


def test_pp4_matches_unpipelined_model():
    cases = [("one_f_one_b", {}, 8), ("interleaved_1f1b", {}, 8), ("zbv", {}, 4),
             ("dualpipev", {}, 8)]
    _check(run_on_ranks(_parity_body, cases, world_size=4))


# --- data parallel x pipeline (seed scenarios 27/28, functional) --------------------------

def _fsdp_stage_fn(params, x, stage):
    # FSDP by hand: every leaf is a dim-0 shard over dp, gathered for use; the gather's
    # transpose (psum_scatter) sums the shards' gradients over dp.
    full = fs.tree.tree_map(lambda t: fs.lax.all_gather(t, "dp", tiled=True), params)
    return _layers(full, x)


def _scan_stage_fn(params, x, stage):
    # FSDP through the layer loop: one flat gather per layer, reshard after forward,
    # regather in backward, one reduce-scatter per layer per microbatch.
    keys = sorted(params, key=int)
    return fs.parallel.scan_layers(lambda lp, h: torch.tanh(h @ lp["weight"].T + lp["bias"]),
                                   [params[k] for k in keys], x, axis="dp")


def _dp_pp_body(cases):
    mesh = fs.make_mesh({"dp": 2, "pp": 2})
    rank, dp = mesh.axis_index("pp"), mesh.axis_index("dp")
    params = _init()
    x, y = _data(16)  # global batch; dp rank d takes rows 8d..8d+7
    # The references, once for all cases: the global batch's and this dp rank's half's.
    full_loss, full_grads = _reference(params, x, y)
    half = slice(8 * dp, 8 * dp + 8)
    _, full_half_grads = _reference(params, x[half], y[half])
    out = []
    for name, kw, mode in cases:
        sch = _make(name, 2, 4, kw)
        ref_loss, ref_grads, half_grads = full_loss, full_grads, full_half_grads
        if mode in ("fsdp", "scan"):  # compare this rank's shard of every gradient
            shard = lambda t: t.chunk(2)[dp]  # noqa: E731
            ref_grads = fs.tree.tree_map(shard, ref_grads)
            half_grads = fs.tree.tree_map(shard, half_grads)
            sp = [None if e is None else fs.shard(e, P("dp"), mesh)
                  for e in _stage_params(params, sch, rank)]
        else:
            sp = _stage_params(params, sch, rank, mesh if mode == "dtensor" else None)
        with fs.comm_log() as log:
            loss, grads = fs.sched.pipeline_step(
                {"fsdp": _fsdp_stage_fn, "scan": _scan_stage_fn}.get(mode, _stage_fn), _loss_fn, sp, (x, y),
                schedule=sch, mesh=mesh, data_axes="dp")
        kinds = {type(leaf).__name__ for e in grads if e is not None for lv in e.values()
                 for leaf in lv.values()}
        out.append({
            "case": f"{name}{kw} {mode}",
            "mode": mode,
            "loss_err": abs(loss.item() - ref_loss.item()),
            "grad_err": _max_err(grads, ref_grads),
            # Each rank saw only its half: without the sum over dp the test would fail.
            "half_differs": _max_err(grads, half_grads) > 1e-3,
            "kinds": kinds,
            "dp_psums": log.by_axis[("psum", ("dp",))],
            "dp_scatters": log.by_axis[("psum_scatter", ("dp",))],
            "dp_gathers": log.by_axis[("all_gather", ("dp",))],
            "n_held": len(sch.stages_of(rank)),
            "n_leaves": 2 * N_LAYERS // 2,
        })
    return out


def test_dp_x_pp_grads_averaged_over_dp_equal_global_batch_reference():
    cases = [("gpipe", {}, "plain"), ("one_f_one_b", {}, "dtensor"),
             ("interleaved_1f1b", {}, "plain"), ("looped_bfs", {}, "dtensor"),
             ("zero_bubble", {"n_virtual": 2}, "plain"), ("zbv", {}, "dtensor"),
             ("one_f_one_b", {}, "fsdp"), ("interleaved_1f1b", {}, "fsdp"),
             ("zero_bubble", {"n_virtual": 2}, "fsdp"), ("zbv", {}, "fsdp"),
             ("one_f_one_b", {}, "scan"), ("zero_bubble", {"n_virtual": 2}, "scan")]
    for rank_results in run_on_ranks(_dp_pp_body, cases, world_size=4):
        for r in rank_results:
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
            assert r["half_differs"], r
            assert r["kinds"] == ({"Tensor"} if r["mode"] == "plain" else {"DTensor"}), r
            if r["mode"] == "fsdp":
                # Sharded leaves are reduced by the body's own psum_scatter (one per leaf per
                # microbatch); only the loss is summed over dp.
                assert r["dp_psums"] == 1 and r["dp_scatters"] == 4 * r["n_leaves"], r
            elif r["mode"] == "scan":
                # scan_layers: per layer and microbatch one flat reduce-scatter, and one gather
                # in forward plus one regather in backward (reshard after forward).
                n_layers = N_LAYERS // 2
                assert r["dp_psums"] == 1 and r["dp_scatters"] == 4 * n_layers, r
                assert r["dp_gathers"] == 2 * 4 * n_layers, r
            else:
                # One all-reduce per held stage (launched at its REDUCE_GRAD) + the loss.
                assert r["dp_psums"] == r["n_held"] + 1 and r["dp_scatters"] == 0, r


# Seed scenario 31 takes torch's replicate, which is FSDP2's machinery with a Replicate
# placement and an mp_policy. Its functional form: StageFSDP over an fsdp axis of size 1
# (nothing to shard) with fs.Policy(param_dtype=bf16, reduce_dtype=fp32), replicated over
# dp (gradients all-reduced there, in the reduce dtype).
POLICY31 = fs.Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
_SEEN = []  # dtypes the stage body was handed, on this rank


def _policy_stage_fn(params, x, stage):
    # No cast of the parameters here: the executor hands them over in the policy's
    # param_dtype. The activation follows them (FSDP2's cast_forward_inputs).
    dtype = params[min(params, key=int)]["weight"].dtype
    _SEEN.extend({t.dtype for lv in params.values() for t in lv.values()})
    return _layers(params, x.to(dtype))


def _fp32_loss_fn(y, t):
    return ((y.float() - t) ** 2).mean()


def _scenario31_body(names):
    # pp x replicate with Policy(bf16, fp32): per-microbatch losses of 5 AdamW steps against
    # the same policy applied on one process (fp32 masters, Policy.cast_params for compute)
    # over the global batch, and the masters after the 5 steps.
    mesh = fs.make_mesh({"dp": 2, "fsdp": 1, "pp": 2})
    rank, dp = mesh.axis_index("pp"), mesh.axis_index("dp")
    params = fs.tree.tree_map(lambda t: t.float(), _init())
    opt = fs.optim.adamw(0.01, b1=0.9, b2=0.95, weight_decay=0.1)
    g = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(5, 16, D, generator=g), torch.randn(5, 16, D, generator=g)

    def ref_forward(p, x):
        return _layers(POLICY31.cast_params(p), x.to(POLICY31.param_dtype))

    ref, ref_state, ref_mb = params, opt.init(params), []
    for step in range(5):
        rows = [slice(8 * dp + 2 * i, 8 * dp + 2 * i + 2) for i in range(4)]  # this dp rank's mbs
        ref_mb.append([_fp32_loss_fn(ref_forward(ref, xs[step][r]), ys[step][r]).item() for r in rows])
        _, grads = fs.value_and_grad(lambda p: _fp32_loss_fn(ref_forward(p, xs[step]), ys[step]))(ref)
        updates, ref_state = opt.update(grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, updates)
    out = []
    for name in names:
        sch = _make(name, 2, 4, {"n_virtual": 2} if name == "zero_bubble" else {})
        sp = [None if e is None else fs.shard(e, fs.parallel.fsdp_specs(e, "fsdp"), mesh)
              for e in _stage_params(params, sch, rank)]
        state = [None if e is None else opt.init(e) for e in sp]
        worst, first = 0.0, None
        _SEEN.clear()
        with fs.comm_log() as log:
            for step in range(5):
                _, grads, stats = fs.sched.pipeline_step(
                    _policy_stage_fn, _fp32_loss_fn, sp, (xs[step], ys[step]), schedule=sch, mesh=mesh,
                    data_axes=("dp", "fsdp"), fsdp=fs.sched.StageFSDP("fsdp", policy=POLICY31),
                    return_stats=True)
                if stats.losses is not None:
                    got = [v.item() for v in stats.losses]
                    first = got == ref_mb[0] if step == 0 else first
                    worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(got, ref_mb[step])))
                for s, e in enumerate(sp):
                    if e is not None:
                        updates, state[s] = opt.update(grads[s], state[s], e)
                        sp[s] = fs.optim.apply_updates(e, updates)
        err = max((fs.gather(leaf) - ref[k][n]).abs().max().item()
                  for e in sp if e is not None for k, lv in e.items() for n, leaf in lv.items())
        held = sum(p.numel() for e in sp if e is not None for p in fs.tree.leaves(e))
        out.append({"name": name, "last": stats.losses is not None, "worst": worst, "first_exact": first,
                    "err": err, "seen": set(_SEEN), "grad_dtypes": {t.dtype for e in grads if e is not None
                                                                      for t in fs.tree.leaves(e)},
                    # per step: the held stages' gradients, all-reduced over dp in fp32 (4
                    # bytes; bf16 would be 2); the loss is summed over both data axes at once
                    "dp_bytes": log.bytes_by_axis[("psum", ("dp",))] / 5, "expected_dp_bytes": 4 * held})
    return out


def test_scenario31_pp_x_replicate_policy_bf16_losses_match_single_process_policy():
    names = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "zero_bubble"]
    for rank_results in run_on_ranks(_scenario31_body, names, world_size=4):
        for r in rank_results:
            assert r["seen"] == {torch.bfloat16}, r  # the policy, not the body, cast the params
            assert r["grad_dtypes"] == {torch.float32}, r  # gradients land in the masters' dtype
            assert r["dp_bytes"] == r["expected_dp_bytes"], r  # reduced over dp in fp32
            if r["last"]:
                # Step 0 starts from the same masters and runs the same bf16 ops on the same
                # rows as the reference: equal to the bit.
                assert r["first_exact"], r
                # Later steps differ because the gradients are summed differently: the
                # reference's bf16 backward sums the 16 rows inside one bf16 matmul, the
                # pipeline sums 4 microbatches x 2 dp ranks in fp32. Adam turns that into
                # masters a few fp32 ulps apart, and a master that lands on the other side
                # of a bf16 rounding boundary moves by one bf16 ulp (2**-8 relative). The
                # bound is torch's bf16 rtol 1.6e-2 = 2**-6, four such ulps, which the seed
                # also uses; measured up to about 3e-3.
                assert r["worst"] < 1.6e-2, r
            # fp32 masters after 5 steps (measured up to 2e-3): AdamW moves each entry by
            # about lr = 0.01 per step, so bf16 rounding may flip a step's sign on a near-zero
            # gradient; the float64 dp x pp test above pins the reduction itself exactly.
            assert r["err"] < 2e-2, r


def _pp1_body():
    # A pipeline axis of size 1 (no transfers) next to dp=2.
    mesh = fs.make_mesh({"dp": 2, "pp": 1})
    params = _init()
    x, y = _data(16)
    ref_loss, ref_grads = _reference(params, x, y)
    out = []
    for sch in (fs.sched.one_f_one_b(1, 4), fs.sched.zero_bubble(1, 4)):
        with fs.comm_log() as log:
            loss, grads = fs.sched.pipeline_step(_stage_fn, _loss_fn, [params], (x, y),
                                                 schedule=sch, mesh=mesh, data_axes="dp")
        out.append((abs(loss.item() - ref_loss.item()), _max_err(grads, ref_grads),
                    log.counts["send"] + log.counts["recv"]))
    return out


def test_pp1_x_dp2_has_no_transfers_and_matches_reference():
    for rank_results in run_on_ranks(_pp1_body, world_size=2):
        for loss_err, grad_err, n_p2p in rank_results:
            assert loss_err < TOL and grad_err < TOL and n_p2p == 0


# --- tensor parallel inside the stage body (fs.lax over the tp axis) ---------------------

def _tp_init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {str(i): {"w1": torch.randn(H, D, generator=g, dtype=torch.float64) / D ** 0.5,
                     "w2": torch.randn(D, H, generator=g, dtype=torch.float64) / H ** 0.5}
            for i in range(N_LAYERS)}


def _tp_layers(params, x, tp):
    for key in sorted(params, key=int):
        p = params[key]
        if tp:
            x = fs.lax.pvary(x, "tp")  # Megatron "f": the input's gradient is summed over tp
        h = torch.tanh(x @ p["w1"].T) @ p["w2"].T
        x = torch.tanh(fs.lax.psum(h, "tp") if tp else h)  # Megatron "g"
    return x


def _tp_stage_fn(params, x, stage):
    return _tp_layers(params, x, True)


def _pp_tp_body(names):
    mesh = fs.make_mesh({"pp": 2, "tp": 2})
    rank, t = mesh.axis_index("pp"), mesh.axis_index("tp")
    params = _tp_init()
    x, y = _data(8)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: _loss_fn(_tp_layers(p, x, False), y))(params)
    local = {k: {"w1": v["w1"][t * H // 2:(t + 1) * H // 2],
                 "w2": v["w2"][:, t * H // 2:(t + 1) * H // 2]} for k, v in params.items()}
    ref_local = {k: {"w1": v["w1"][t * H // 2:(t + 1) * H // 2],
                     "w2": v["w2"][:, t * H // 2:(t + 1) * H // 2]} for k, v in ref_grads.items()}
    out = []
    for name in names:
        sch = _make(name, 2, 4, {})
        sp = _stage_params(local, sch, rank)
        loss, grads = fs.sched.pipeline_step(_tp_stage_fn, _loss_fn, sp, (x, y), schedule=sch,
                                             mesh=mesh)
        out.append((name, abs(loss.item() - ref_loss.item()), _max_err(grads, ref_local)))
    # The same stage body, unpipelined, as a shard_map loss over the whole mesh in both
    # compositions and both modes: the gradients must be the pipeline's (and the reference's).
    specs = {k: {"w1": P("tp", None), "w2": P(None, "tp")} for k in params}
    sharded = fs.shard(params, specs, mesh)

    def loss(p, a, b):
        return _loss_fn(_tp_stage_fn(p, a, 0), b)

    for check in (True, False):
        for order, step in (
                ("outside", fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=(specs, P(), P()),
                                                           out_specs=P(), check=check))),
                ("inside", fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(specs, P(), P()),
                                        out_specs=(P(), specs), check=check))):
            value, g = step(sharded, x, y)
            g = fs.gather(g)
            err = max((g[k][w] - ref_grads[k][w]).abs().max().item() for k in g for w in g[k])
            out.append((f"shard_map {order} check={check}", abs(value.item() - ref_loss.item()), err))
    return out


def test_pp_x_tp_collectives_inside_stage_fn_match_reference():
    for rank_results in run_on_ranks(_pp_tp_body, ["one_f_one_b", "zero_bubble", "zbv"],
                                     world_size=4):
        assert len(rank_results) == 3 + 4
        for name, loss_err, grad_err in rank_results:
            assert loss_err < TOL and grad_err < TOL, (name, loss_err, grad_err)


# --- bad input ----------------------------------------------------------------------------

def _bad_input_body():
    mesh = fs.make_mesh({"pp": 2})
    rank = mesh.axis_index("pp")
    params = _init()
    sch = fs.sched.one_f_one_b(2, 4)
    x, y = _data(8)
    sp = _stage_params(params, sch, rank)

    def run(**over):
        args = {"stage_params": sp, "batch": (x, y), "schedule": sch}
        args.update(over)
        try:
            fs.sched.pipeline_step(_stage_fn, _loss_fn, args["stage_params"], args["batch"],
                                   schedule=args["schedule"], mesh=mesh,
                                   **{k: v for k, v in over.items()
                                      if k not in ("stage_params", "batch", "schedule")})
        except (ValueError, TypeError) as e:
            return type(e).__name__, str(e)
        return None

    deadlock = fs.sched.Schedule(
        actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
        n_stages=2, n_microbatches=2, name="hand_deadlock")
    twice = fs.sched.Schedule(
        actions=[["0F0", "0F0", "0F1", "0B1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]],
        n_stages=2, n_microbatches=2, name="hand_twice")
    held_none = list(sp)
    held_none[rank] = None
    return {
        "length": run(stage_params=sp[:1]),
        "rows": run(batch=(x[:6], y[:6])),
        "held_none": run(stage_params=held_none),
        "n_ranks": run(schedule=fs.sched.one_f_one_b(4, 4), stage_params=[None] * 4),
        "deadlock": run(schedule=deadlock, stage_params=[params, params]),
        "twice": run(schedule=twice, stage_params=[params, params]),
        "not_schedule": run(schedule="1f1b"),
        "axis_in_data": run(data_axes="pp"),
        "not_pair": run(batch=(x,)),
    }


def test_bad_input_names_schedule_and_rule_before_anything_runs():
    r = run_on_ranks(_bad_input_body, world_size=2)[0]
    assert r["length"][0] == "ValueError" and "'1f1b'" in r["length"][1] \
        and "n_stages = n_ranks * n_virtual = 2 * 1 = 2, got 1" in r["length"][1]
    assert "'1f1b'" in r["rows"][1] and "n_microbatches=4" in r["rows"][1] \
        and "6 rows" in r["rows"][1] and "divisible by 4" in r["rows"][1]
    assert "stage_params[0] is None, but pipeline rank 0 holds stage 0" in r["held_none"][1]
    assert "axis 'pp' of size n_ranks=4" in r["n_ranks"][1]
    assert r["deadlock"][0] == "ScheduleError" and "deadlock" in r["deadlock"][1]
    assert "hand_deadlock" in r["deadlock"][1] and "rank 0" in r["deadlock"][1]
    assert r["twice"][0] == "ScheduleError" and "hand_twice" in r["twice"][1]
    assert "F runs 2 times" in r["twice"][1]
    assert r["not_schedule"][0] == "TypeError"
    assert "contains the pipeline axis" in r["axis_in_data"][1]
    assert r["not_pair"][0] == "TypeError"


def test_generators_reject_microbatch_counts_naming_schedule_and_rule():
    with pytest.raises(ValueError, match=r"one_f_one_b\(n_ranks=2, n_microbatches=0.*>= 1"):
        fs.sched.one_f_one_b(2, 0)
    with pytest.raises(ValueError, match=r"dualpipev\(n_ranks=2, n_microbatches=3\).*>= "):
        fs.sched.dualpipev(2, 3)
    with pytest.raises(ValueError, match=r"interleaved_1f1b.*multiple of the number of rounds"):
        fs.sched.interleaved_1f1b(4, 10 + 1)


def test_split_backward_matches_full_backward_with_shared_weights():
    from fshard.sched.split import SplitBackward

    g = torch.Generator().manual_seed(0)
    w = [torch.randn(4, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    x = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    seed = torch.randn(3, 4, generator=g, dtype=torch.float64)

    def f():  # w[1] is used twice (two frontier nodes share it), w[2] only off the input path
        h = torch.tanh(x @ w[0].T)
        h = torch.tanh(_Count.apply(h) @ w[1].T)
        return torch.tanh(h @ w[1].T) * w[2].sum()

    ref = torch.autograd.grad(f(), [x, *w], seed)
    _Count.calls = 0
    split = SplitBackward(f(), seed, x, w)
    idx, grads = split.weight_grads()
    assert _Count.calls == 1
    torch.testing.assert_close(split.input_grad, ref[0], rtol=0, atol=1e-14)
    assert sorted(idx) == [0, 1, 2]
    for i, gr in zip(idx, grads):
        torch.testing.assert_close(gr, ref[1 + i], rtol=0, atol=1e-14)


# --- a stage whose output shape changes: the other rank is left blocked in a receive, so
# it runs on ranks of its own (fs.run_local: forked for this call, killed after it), not on
# the shared pool, which every later 2-rank test would have to start again ------------------

def _shape_change_body():
    mesh = fs.make_mesh({"pp": 2})
    rank = mesh.axis_index("pp")
    sch = fs.sched.gpipe(2, 2)
    x, y = _data(4)
    calls = []

    def stage_fn(p, a, s):
        calls.append(s)
        out = _layers(p, a)
        return out if len(calls) == 1 or s != 0 else torch.cat([out, out])

    fs.sched.pipeline_step(stage_fn, _loss_fn, _stage_params(_init(), sch, rank), (x, y),
                           schedule=sch, mesh=mesh)


def test_stage_output_shape_change_names_stage_and_both_shapes():
    with pytest.raises(ValueError, match=r"stage 0 output changed between microbatches: "
                                         r"microbatch 0 gave shape \(2, 6\).*microbatch 1 "
                                         r"gives shape \(4, 6\)"):
        # Rank 1 stays blocked in its receive by design: no grace period to wait out.
        fs.run_local(_shape_change_body, world_size=2, timeout_s=60, grace_s=0.5)

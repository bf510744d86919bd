"""seed_tests.md scenarios in functional form, and the map of where each one is tested.

Every scenario of seed_tests.md section 5, by number (files under tests/; "here" is this file):

  1  uneven dim-0 MLP shards, 4 Adam steps     here: test_scenario1_uneven_mlp_shards
  2  shard the largest dim, contiguous shards  here: test_scenario2_shard_largest_dim_keeps_shards_contiguous
  3  Transformer, one group per block, counts  parallel/test_parallel_fsdp.py: test_fsdp_transformer_loss_params_and_comm_counts,
                                               test_fsdp_2x2_reshard_to_inner_axis_regathers_over_it_only
  4  delays before collectives change nothing  here: test_scenario4_delays_change_nothing_bitwise
  5  host offload                              parallel/test_parallel_fsdp.py: test_offload_parity_and_everything_stays_on_the_host
  6  explicit forward prefetch lists           here: test_scenario6_34_forward_and_backward_prefetch_order
  7  float64 cast after sharding               here: test_scenario7_float64_cast_after_sharding_trains_in_float64
  8  registration semantics (what outlives     here: test_scenario8_gathered_params_alive_after_forward_only_without_reshard
     forward: weak references)
  9  a step over a sub-stack between full ones here: test_scenario9_sub_stack_step_between_full_steps
 10  a layer used twice                        here: test_scenario10_layer_used_twice_gets_both_gradients,
                                               test_scenario10_layer_used_twice_reshard_to_inner_axis
 11  remat                                     parallel/test_parallel_fsdp.py: test_fsdp_remat_and_tied_weights;
                                               parallel/test_parallel_tp.py: test_fsdp_tp_reshard_and_remat
 12  tied weights; a tied leaf in two groups   parallel/test_parallel_fsdp.py: test_fsdp_remat_and_tied_weights;
                                               here: test_scenario12_tied_leaf_in_two_groups_is_an_error
 13  uneven tied embedding, grad parity        here: test_scenario13_uneven_tied_embedding_every_row_trains_with_gradient_parity
 14  accumulation without sync, counts         here: test_scenario14_fsdp_accumulation_reduces_once,
                                               test_scenario14_accumulation_with_reshard_to_inner_axis
 15  partial sync (root only; MLPs 1-2), counts here: test_scenario15_partial_sync_exact_counts
 16  HSDP accumulation counts                  here: test_scenario16_hsdp_accumulation_counts
 17  HSDP training                             parallel/test_parallel_fsdp.py: test_hsdp_2x2,
                                               test_offload_parity_and_everything_stays_on_the_host[hsdp];
                                               here: test_scenario16_hsdp_accumulation_counts (3 microbatches, parity)
 18  1F1B emulation                            sched/test_sched_stage_fsdp.py: test_scenario18_one_gather_and_one_reduce_scatter_over_three_microbatches
 19  FSDP x TP                                 parallel/test_parallel_tp.py: test_mlp_stack_parity_and_megatron_counts,
                                               test_fsdp_tp_reshard_and_remat, test_mlp_stack_uneven_dims
 20  HSDP x TP, 3-D mesh (2x2x2, 8 ranks)      parallel/test_parallel_tp.py: test_scenario20_hsdp_x_tp_on_a_2x2x2_mesh
                                               (and hsdp_tp / hsdp_tp1 cases of test_mlp_stack_parity_and_megatron_counts)
 21  EP x TP x FSDP                            parallel/test_parallel_ep.py: test_moe_transformer_parity_and_counts
 22  world size 1 issues nothing               parallel/test_parallel_fsdp.py: test_fsdp_world_one_issues_nothing
 23  a step through part of the model          here: test_scenario23_step_through_part_of_the_model
 24  replicate (DDP)                           parallel/test_parallel_fsdp.py: test_replicate_is_ddp
 25  replicate accumulation, counts 4/10/8     here: test_scenario25_replicate_accumulation_exact_all_reduce_counts
 26  replicate x TP                            parallel/test_parallel_tp.py: test_mlp_stack_parity_and_megatron_counts[dp_tp-*],
                                               test_mlp_stack_uneven_dims
 27  PP x FSDP gradients (fp32, bf16/fp32)     sched/test_sched_stage_fsdp.py: test_every_generator_pp2_x_fsdp2_matches_reference_with_one_reduction_per_stage,
                                               test_bf16_params_fp32_reduce_as_close_as_single_process_bf16
 28  PP x DDP gradients, per-rank data         sched/test_sched_runtime.py: test_dp_x_pp_grads_averaged_over_dp_equal_global_batch_reference
 29  stage placement keeps global layer names  sched/test_sched_runtime.py (every pipeline test: stage params keyed by layer index);
                                               test_checkpoint.py: test_pipeline_stages_keep_global_layer_indices
 30  PP x TP x FSDP against one process        sched/test_sched_stage_fsdp.py: test_scenario30_pp_x_tp_x_fsdp_on_a_2x2x2_mesh (8 ranks),
                                               test_scenario30_pp_x_tp_x_fsdp_adamw_steps_match_one_process
 31  PP x replicate, Policy(bf16, fp32)        sched/test_sched_runtime.py: test_scenario31_pp_x_replicate_policy_bf16_losses_match_single_process_policy
 32  UNSHARD/RESHARD actions                   sched/test_sched_stage_fsdp.py: test_scenario32_unshard_reshard_actions_set_the_gather_count
 33  8 pipeline chunks, params + Adam state    test_checkpoint.py: test_scenario33_eight_pipeline_chunks_keep_global_keys_with_adam_state
 34  backward prefetch order                   here: test_scenario6_34_forward_and_backward_prefetch_order
 35  one gather and one reduce-scatter queue   here: test_scenario35_one_gather_queue_one_reduce_scatter_queue_nothing_left_in_flight
 36  graph capture                             not ported: CUDA graphs need a GPU, and CI has none

Also here: the layer-loop bad inputs, reshard_after_forward's bad values, and the flat
layout of parameters sharded over two axes (uneven, or not in mesh order).
"""

import time
import warnings

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import P, comm
from fshard.testing import local_block_diff, run_on_ranks


def _mlp_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    (a, b), (c, d) = shapes
    return [{"w1": torch.randn(a, b, generator=g, dtype=torch.float64) * 0.3,
             "w2": torch.randn(c, d, generator=g, dtype=torch.float64) * 0.3}]


def _block(p, x):
    return torch.relu(x @ p["w1"]) @ p["w2"]  # (B, a) -> (B, b) -> (B, d)


def _train_mlp(shapes, steps, placement, delay, twice):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"fsdp": n})
    params = _mlp_params(shapes)
    argmax = (lambda path, x: int(torch.tensor(x.shape).argmax())) if placement else None
    specs = fs.parallel.fsdp_specs(params, "fsdp", placement_fn=argmax)
    sharded = fs.shard(params, specs, mesh, uneven=True)

    def body(p, x, y):
        def f(lp, h):
            h = _block(lp, h)
            return _block(lp, h) if twice else h
        out = fs.parallel.scan_layers(f, p, x, axis="fsdp")
        return fs.lax.pmean(((out - y) ** 2).mean(), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P()))
    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    out_dim = shapes[1][1]
    losses, worst, contiguous = [], 0.0, True
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(2 * n, shapes[0][0], generator=g, dtype=torch.float64)
        y = torch.randn(2 * n, out_dim if not twice else shapes[1][1], generator=g, dtype=torch.float64)
        loss, grads = step(sharded, x, y)
        contiguous &= all(t.to_local().is_contiguous() for t in fs.tree.leaves(grads))
        up, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, up)

        def ref_loss(p):
            h = _block(p[0], x)
            h = _block(p[0], h) if twice else h
            return ((h - y) ** 2).mean()

        rl, rg = fs.value_and_grad(ref_loss)(ref)
        up, ref_state = ref_opt.update(rg, ref_state, ref)
        ref = fs.optim.apply_updates(ref, up)
        losses.append((loss.item(), rl.item()))
        # Each rank's blocks every step (no gather per step); the last params also through
        # DTensor's own gather.
        worst = max(worst, local_block_diff(sharded, ref, specs, mesh, uneven=True))
    worst = max(worst, max((a - b).abs().max().item()
                           for a, b in zip(fs.tree.leaves(fs.gather(sharded)), fs.tree.leaves(ref))))
    contiguous &= all(t.to_local().is_contiguous() for t in fs.tree.leaves(sharded))
    return losses, worst, contiguous


def _with_and_without_delays(shapes, steps):
    # Scenario 4: a delay before every gather and reduce-scatter must not change any bit.
    fast = _train_mlp(shapes, steps, False, False, False)
    originals = {name: getattr(comm, name) for name in ("all_gather_async", "reduce_scatter_async")}
    try:
        for name, f in originals.items():
            def slow(*a, _f=f, **k):
                time.sleep(0.02)
                return _f(*a, **k)
            setattr(comm, name, slow)
        slow_run = _train_mlp(shapes, steps, False, True, False)
    finally:
        for name, f in originals.items():
            setattr(comm, name, f)
    return fast[0], slow_run[0]


@pytest.mark.parametrize("shapes", [((16, 15), (15, 8)), ((7, 15), (15, 3)), ((16, 17), (17, 8))])
@pytest.mark.parametrize("n", [2, 4])
def test_scenario1_uneven_mlp_shards(shapes, n):
    # 4 Adam steps (the seed runs 10): every step's loss and each rank's blocks are compared,
    # and steps 1-3 read Adam's moments.
    for losses, worst, _ in run_on_ranks(_train_mlp, shapes, 4, False, False, False, world_size=n):
        assert all(abs(a - b) < 1e-10 for a, b in losses) and worst < 1e-10


def test_scenario2_shard_largest_dim_keeps_shards_contiguous():
    for losses, worst, contiguous in run_on_ranks(_train_mlp, ((32, 16), (16, 8)), 5, True, False, False, world_size=2):
        assert all(abs(a - b) < 1e-10 for a, b in losses) and worst < 1e-10 and contiguous


def test_scenario4_delays_change_nothing_bitwise():
    for fast, slow in run_on_ranks(_with_and_without_delays, ((16, 17), (17, 8)), 3, world_size=2):
        assert fast == slow


def test_scenario10_layer_used_twice_gets_both_gradients():
    for losses, worst, _ in run_on_ranks(_train_mlp, ((8, 8), (8, 8)), 5, False, False, True, world_size=2):
        assert all(abs(a - b) < 1e-10 for a, b in losses) and worst < 1e-10


def _tied_uneven_embedding():
    # 10 AdamW steps on a tied embedding whose vocab (4n + 1) does not divide over n ranks:
    # every step's loss and gathered gradient, and the params after it, against one process.
    n = dist.get_world_size()
    mesh = fs.make_mesh({"fsdp": n})
    vocab, dim = 4 * n + 1, 16
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(vocab, dim, generator=g, dtype=torch.float64)}
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    before = fs.gather(sharded)["emb"].clone()

    def loss_of(emb, tok):
        x = emb[tok]                                                # (B, D): embedding
        logits = x @ emb.T                                          # (B, V): tied output
        return torch.nn.functional.cross_entropy(logits, (tok + 1) % vocab)

    def body(p, tok):
        full = fs.parallel.gather_params(p, axis="fsdp")
        return fs.lax.pmean(loss_of(full["emb"], tok), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=P()))
    opt, ref_opt = fs.optim.adamw(1e-2), fs.optim.adamw(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    tok = torch.arange(vocab * n) % vocab  # every row is used; vocab * n rows split evenly over n ranks
    loss_err = grad_err = param_err = 0.0
    for _ in range(10):
        loss, grads = step(sharded, tok)
        up, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, up)
        ref_loss, ref_grads = fs.value_and_grad(lambda p: loss_of(p["emb"], tok))(ref)
        up, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, up)
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
        grad_err = max(grad_err, (fs.gather(grads)["emb"] - ref_grads["emb"]).abs().max().item())
        param_err = max(param_err, (fs.gather(sharded)["emb"] - ref["emb"]).abs().max().item())
    after = fs.gather(sharded)["emb"]
    return [bool((after[r] != before[r]).any()) for r in range(vocab)], loss_err, grad_err, param_err


def test_scenario13_uneven_tied_embedding_every_row_trains_with_gradient_parity():
    for changed, loss_err, grad_err, param_err in run_on_ranks(_tied_uneven_embedding, world_size=4):
        assert all(changed)
        # Both uses of the tied leaf (lookup and output) reach every shard, the padded last
        # one included, exactly once: doubled or dropped gradients fail here.
        assert loss_err < 1e-10 and grad_err < 1e-10 and param_err < 1e-10, (loss_err, grad_err, param_err)


# --- scenario 7: parameters cast to float64 after sharding ------------------------------------

def _float64_after_sharding():
    # MLP(4) in 3 groups (in_proj, out_proj and the root, which holds no leaves of its own):
    # initialized and sharded in float32, then cast to float64 as sharded arrays. Every
    # param, local shard, shard metadata and gradient must be float64, and 10 Adam steps
    # must match a float64 single-process reference.
    n = dist.get_world_size()
    mesh = fs.make_mesh({"fsdp": n})
    g = torch.Generator().manual_seed(42)
    params = {"in_proj": {"w": torch.randn(16, 4, generator=g) * 0.5, "b": torch.randn(16, generator=g) * 0.1},
              "out_proj": {"w": torch.randn(4, 16, generator=g) * 0.25, "b": torch.randn(4, generator=g) * 0.1}}
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh)
    cast = fs.tree.tree_map(lambda t: t.to(torch.float64), sharded)
    ref = fs.tree.tree_map(lambda t: t.to(torch.float64), params)

    def mlp(p, x):
        h = torch.relu(x @ p["in_proj"]["w"].T + p["in_proj"]["b"])
        return torch.relu(h @ p["out_proj"]["w"].T + p["out_proj"]["b"])

    def body(p, x):
        full = {k: fs.parallel.gather_params(p[k], axis="fsdp") for k in ("in_proj", "out_proj")}
        return fs.lax.pmean(mlp(full, x).sum(-1).mean(), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=P()))
    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref_state = opt.init(cast), ref_opt.init(ref)
    x = torch.randn(2 * n, 4, generator=g, dtype=torch.float64)  # fixed; 2 different rows per rank

    def dtypes(tree):  # (global, local shard, DTensor metadata) dtypes of every leaf
        return {(t.dtype, t.to_local().dtype, t._spec.tensor_meta.dtype) for t in fs.tree.leaves(tree)}

    seen, losses, param_err = dtypes(cast), [], 0.0
    for _ in range(10):
        loss, grads = step(cast, x)
        seen |= dtypes(grads)
        up, state = opt.update(grads, state, cast)
        cast = fs.optim.apply_updates(cast, up)
        seen |= dtypes(cast)
        ref_loss, ref_grads = fs.value_and_grad(lambda p: mlp(p, x).sum(-1).mean())(ref)
        up, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, up)
        losses.append((loss.item(), ref_loss.item(), loss.dtype))
        param_err = max(param_err, max((fs.gather(a) - b).abs().max().item()
                                       for a, b in zip(fs.tree.leaves(cast), fs.tree.leaves(ref))))
    state_dtypes = {t.dtype for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return seen, losses, param_err, state_dtypes


def test_scenario7_float64_cast_after_sharding_trains_in_float64():
    for seen, losses, param_err, state_dtypes in run_on_ranks(_float64_after_sharding, world_size=2):
        f64 = torch.float64
        assert seen == {(f64, f64, f64)}, seen
        assert state_dtypes == {f64}, state_dtypes
        # Tighter than the seed's float64 default (1e-7): a step silently run in float32
        # would be off by about 1e-7 relative, and must fail.
        for got, want, dtype in losses:
            assert dtype == f64 and abs(got - want) <= 1e-12 * max(1.0, abs(want)), (got, want)
        assert param_err < 1e-12
        assert abs(losses[-1][0] - losses[0][0]) > 1e-3  # Adam moved the loss


def _layer_structure_mismatch():
    mesh = fs.make_mesh({"fsdp": 2})
    layers = [{"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2), "b": torch.ones(2)}]
    sharded = fs.shard(layers, P(), mesh)
    f = fs.shard_map(lambda p, x: fs.parallel.scan_layers(lambda lp, h: h, p, x), mesh=mesh,
                     in_specs=(P(), P()), out_specs=P())
    try:
        f(sharded, torch.ones(2))
    except ValueError as e:
        return str(e)


def test_layer_loop_rejects_layers_of_different_structure():
    msg = run_on_ranks(_layer_structure_mismatch, world_size=2)[0]
    assert "layer 1 has structure" in msg and "layer 0" in msg


def test_layer_loop_outside_shard_map():
    with pytest.raises(RuntimeError, match="inside a shard_map body"):
        fs.parallel.scan_layers(lambda p, h: h, [{"w": torch.ones(1)}], torch.ones(1))


# --- scenarios 14 and 25: gradient accumulation without sync ----------------------------------

# Which of the 4 groups (the root Linear, MLPs 0..2) skip the reduction until the last
# microbatch: all of them (scenarios 14, 16, 25), only the root, or only MLPs 1 and 2
# (the count variants of scenarios 15 and 25).
DEFERRED = {"all": {"root", 0, 1, 2}, "root": {"root"}, "mlps12": {1, 2}}


def _accumulate(mode, raf, deferred="all", defer="none", order="outside"):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"r": 2, "d": n // 2} if mode == "hsdp" else MESH2D if mode == "fsdp2d" else {"d": n})
    data = ("r", "d") if mode == "hsdp" else AXES2D if mode == "fsdp2d" else "d"
    g = torch.Generator().manual_seed(0)
    dim = 32
    params = {"lin": {"w": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2},
              "layers": [{"w1": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2,
                          "w2": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2} for _ in range(3)]}
    if mode == "fsdp":
        specs, axes = fs.parallel.fsdp_specs(params, "d"), dict(axis="d")
    elif mode == "fsdp2d":  # the same 4 ranks as fsdp, as 2 "nodes" of 2 (reshard_after_forward=2)
        specs, axes = fs.parallel.fsdp_specs(params, AXES2D), dict(axis=AXES2D)
    elif mode == "hsdp":
        specs, axes = fs.parallel.hsdp_specs(params, "d", "r"), dict(axis="d", replicate_axis="r")
    else:
        specs, axes = fs.parallel.replicate_specs(params), dict(axis=None, replicate_axis="d", bucket_bytes=1)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    root_axes = {k: v for k, v in axes.items() if k != "bucket_bytes"}
    options = {k: v for k, v in axes.items() if k == "bucket_bytes"}

    groups = DEFERRED[deferred]
    # Consecutive layers that defer alike share one layer loop (sync is per loop).
    runs = [[0, 1, 2]] if len({i in groups for i in range(3)}) == 1 else [[0], [1, 2]]

    def body(p, x, y, acc, sync):
        def sync_of(group):  # a group that does not defer reduces every microbatch
            return sync if group in groups else True

        h = x @ fs.parallel.gather_params(p["lin"], accumulate=acc, sync=sync_of("root"), **root_axes)["w"]
        for run in runs:
            h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"],
                                        [p["layers"][i] for i in run], h, accumulate=acc, sync=sync_of(run[0]),
                                        config=fs.parallel.ScanConfig(reshard_after_forward=raf, **options),
                                        **root_axes)
        return fs.lax.pmean(((h - y) ** 2).mean(), data)

    in_specs = (specs, P(data), P(data), None, None)
    step = (fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())) if order == "outside" else
            fs.shard_map(fs.value_and_grad(body), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs)))
    acc = fs.parallel.GradAccumulator()
    xs = torch.randn(3, 2 * n, dim, generator=g, dtype=torch.float64)
    ys = torch.randn(3, 2 * n, dim, generator=g, dtype=torch.float64)
    total, early_error = None, None
    with fs.comm_log() as log:
        for k in range(3):
            _, grads = step(sharded, xs[k], ys[k], acc, True if k == 2 else ("reduce_scatter" if defer == "all_reduce" else False))
            if k == 0:
                try:
                    fs.optim.apply_updates(sharded, grads)
                except RuntimeError as e:
                    early_error = str(e)
            # A group that reduces returns its share of this microbatch (everything it
            # accumulated on its sync microbatch); a deferring one returns zeros meanwhile.
            total = grads if total is None else fs.tree.tree_map(torch.add, total, grads)
    ref = fs.tree.tree_map(torch.zeros_like, params)
    for k in range(3):
        def ref_loss(p):
            h = xs[k] @ p["lin"]["w"]
            for lp in p["layers"]:
                h = torch.relu(h @ lp["w1"]) @ lp["w2"]
            return ((h - ys[k]) ** 2).mean()
        ref = fs.tree.tree_map(torch.add, ref, fs.grad(ref_loss)(params))
    diff = max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(fs.gather(total)), fs.tree.leaves(ref)))
    return diff, dict(log.counts), early_error, acc.pending, dict(log.by_axis)


@pytest.mark.parametrize("raf, order", [(True, "outside"), (False, "outside"), (True, "inside")])
def test_scenario14_fsdp_accumulation_reduces_once(raf, order):
    for diff, counts, early, pending, _ in run_on_ranks(_accumulate, "fsdp", raf, order=order, world_size=4):
        assert diff < 1e-10 and not pending
        assert counts["psum_scatter"] == 4                       # one per group, last microbatch only
        # per microbatch: the root group once (gather_params keeps it), each of the 3 layers
        # once, or twice with reshard: 3 x (1 + 2 x 3) = 21 (the seed's 24 reshards the root too)
        assert counts["all_gather"] == (21 if raf else 12)
        assert "sync=True" in early and "never reduced" in early  # no silent step on partial grads


@pytest.mark.parametrize("raf", [2, "fsdp_in"])
def test_scenario14_accumulation_with_reshard_to_inner_axis(raf):
    # The seed's "24 (RAF True or 2)": 21 here (the root group is kept, not resharded), of
    # which the 3 x 3 backward regathers run over the inner axis only.
    for diff, counts, _, pending, by_axis in run_on_ranks(_accumulate, "fsdp2d", raf, world_size=4):
        assert diff < 1e-10 and not pending
        assert counts["all_gather"] == 21
        assert by_axis[("all_gather", AXES2D)] == 3 * (1 + 3)      # forward: root + 3 layers, per microbatch
        assert by_axis[("all_gather", ("fsdp_in",))] == 3 * 3      # backward: 3 layers, per microbatch
        assert by_axis[("psum_scatter", AXES2D)] == counts["psum_scatter"] == 4


@pytest.mark.parametrize("defer, rs, ar, order", [("none", 4, 4, "outside"), ("all_reduce", 12, 4, "outside"),
                                                  ("all_reduce", 12, 4, "inside")])
def test_scenario16_hsdp_accumulation_counts(defer, rs, ar, order):
    for diff, counts, _, pending, _ in run_on_ranks(_accumulate, "hsdp", False, "all", defer, order=order,
                                                    world_size=4):
        assert diff < 1e-10 and not pending
        assert counts["psum_scatter"] == rs
        assert counts["psum"] == ar + 3  # all-reduces over the replicate axis + 3 loss pmeans


# Per step, 3 microbatches. The root is gathered once per microbatch (gather_params keeps
# it until backward), each layer once (twice with reshard_after_forward): 3 x (1 + 3) = 12
# all-gathers, or 3 x (1 + 2 x 3) = 21. The seed's 10 keeps the root and the deferring
# groups gathered across microbatches (reshard_after_backward=False), which fshard's
# functional groups do not: each microbatch's step regathers.
@pytest.mark.parametrize("deferred, raf, scatters, gathers", [
    ("root", False, 1 + 3 * 3, 12),          # the seed's 4 + 3 x 2 = 10: root once, MLPs every microbatch
    ("root", True, 1 + 3 * 3, 21),
    ("mlps12", False, 3 + 3 + 2, 12),        # the seed's 8: root and MLP 0 every microbatch, MLPs 1, 2 once
])
def test_scenario15_partial_sync_exact_counts(deferred, raf, scatters, gathers):
    for diff, counts, early, pending, _ in run_on_ranks(_accumulate, "fsdp", raf, deferred, world_size=4):
        assert diff < 1e-10 and not pending
        assert counts["psum_scatter"] == scatters and counts["all_gather"] == gathers, counts
        assert counts["psum"] == 3 and counts.get("all_to_all", 0) == 0, counts  # the loss pmeans only
        assert "never reduced" in early  # the deferring groups are still pending after microbatch 0


def _tied_in_two_groups():
    mesh = fs.make_mesh({"d": 2})
    w = torch.ones(4, 4, dtype=torch.float64)
    sharded = fs.shard({"w": w, "norm": w[0], "b": w[0]}, P("d"), mesh)

    def body(p, x):  # the root group {w, norm} and a layer group {w, b} both claim w
        root = fs.parallel.gather_params({"emb": p["w"], "norm": p["norm"]}, axis="d")
        h = fs.parallel.scan_layers(lambda lp, z: z @ lp["out"] + lp["b"], [{"out": p["w"], "b": p["b"]}],
                                    x @ root["emb"] * root["norm"], axis="d")
        return h.sum()

    try:
        fs.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P(), check=False)(
            sharded, torch.ones(1, 4, dtype=torch.float64))
    except ValueError as e:
        return str(e)


def test_scenario12_tied_leaf_in_two_groups_is_an_error():
    msg = run_on_ranks(_tied_in_two_groups, world_size=2)[0]
    assert "already managed by another parameter group" in msg and "shape (2, 4)" in msg


@pytest.mark.parametrize("deferred, all_reduces, order", [("all", 4, "outside"), ("all", 4, "inside"),
                                                          ("root", 1 + 3 * 3, "outside"), ("mlps12", 3 + 3 + 2, "outside")])
def test_scenario25_replicate_accumulation_exact_all_reduce_counts(deferred, all_reduces, order):
    # The seed's 4 (sync only on the last microbatch), 10 (only the root defers) and 8
    # (MLPs 1 and 2 defer); one all-reduce per group (buckets of one layer) and microbatch
    # that reduces, plus the 3 loss pmeans; never an all-gather.
    for diff, counts, _, pending, _ in run_on_ranks(_accumulate, "replicate", False, deferred, order=order,
                                                    world_size=2):
        assert diff < 1e-10 and not pending
        assert counts.get("all_gather", 0) == 0 and counts.get("psum_scatter", 0) == 0, counts
        assert counts["psum"] == all_reduces + 3, counts


# --- scenarios 6 and 34: prefetch issue order -----------------------------------------------

def _prefetch_order(forward_prefetch, n_layers):
    from fshard.parallel import groups as groups_mod

    mesh = fs.make_mesh({"d": 2})
    g = torch.Generator().manual_seed(0)
    layers = [{"w": torch.randn(8, 8, generator=g, dtype=torch.float64)} for _ in range(n_layers)]
    specs = fs.parallel.fsdp_specs(layers, "d")
    sharded = fs.shard(layers, specs, mesh)
    issued = []
    original = groups_mod.Groups.start_gather

    def spy(self, i):
        if self.n > 1 and i not in self._inflight and 0 <= i < len(self.groups):
            issued.append(i)
        return original(self, i)

    groups_mod.Groups.start_gather = spy
    try:
        def body(p, x):
            out = fs.parallel.scan_layers(lambda lp, h: torch.tanh(h @ lp["w"]), p, x, axis="d",
                                          config=fs.parallel.ScanConfig(forward_prefetch=forward_prefetch))
            return fs.lax.pmean(out.sum(), "d")

        step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("d")), out_specs=P()))
        step(sharded, torch.randn(4, 8, generator=g, dtype=torch.float64))
    finally:
        groups_mod.Groups.start_gather = original
    return issued


def test_scenario6_34_forward_and_backward_prefetch_order():
    n = 6
    explicit = [[i + 1, i + 2] for i in range(n)]  # forward: the next two layers
    issued = run_on_ranks(_prefetch_order, explicit, n, world_size=2)[0]
    forward, backward = issued[:n], issued[n:]
    assert forward == list(range(n))  # each layer's gather is started before it is needed
    # backward (BACKWARD_PRE): the last layer first, each regather starting the previous one
    assert backward == list(range(n - 1, -1, -1))
    default = run_on_ranks(_prefetch_order, None, n, world_size=2)[0]
    assert default == list(range(n)) + list(range(n - 1, -1, -1))


# --- scenario 10 with reshard_after_forward=2: a 2x2 mesh, regathers over the inner axis -----

MESH2D = {"fsdp_out": 2, "fsdp_in": 2}
AXES2D = ("fsdp_out", "fsdp_in")


def _twice_2d(raf, steps, axes=AXES2D):
    """Two layers, each applied twice, sharded over both axes of a 2x2 mesh; per-rank data.

    Returns per-step (loss, ref loss), the worst grad and param differences against a
    single-process float64 reference, per-step comm_log.by_axis, and, for every slice
    kept after forward, (its storage bytes, the gathered buffer's bytes, whether it is a view).
    """
    from fshard.parallel import groups as groups_mod

    mesh = fs.make_mesh(MESH2D)
    g = torch.Generator().manual_seed(0)
    # w2 has 5 rows over 2 x 2 ranks: cut per axis (3, 2 -> 2, 1, 1, 1), not as one
    # torch.chunk over 4 (2, 2, 1, 0), and padded in the flat buffer.
    params = [{"w1": torch.randn(8, 5, generator=g, dtype=torch.float64) * 0.4,
               "w2": torch.randn(5, 8, generator=g, dtype=torch.float64) * 0.4} for _ in range(2)]
    specs = fs.parallel.fsdp_specs(params, axes)
    sharded = fs.shard(params, specs, mesh, uneven=True)

    def body(p, x, y):
        h = fs.parallel.scan_layers(lambda lp, z: _block(lp, _block(lp, z)), p, x, axis=axes,
                                    config=fs.parallel.ScanConfig(reshard_after_forward=raf))
        return fs.lax.pmean(((h - y) ** 2).mean(), axes)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axes), P(axes)), out_specs=P()))

    def ref_loss(p, x, y):
        h = x
        for lp in p:
            h = _block(lp, _block(lp, h))
        return ((h - y) ** 2).mean()

    kept = []
    original = groups_mod.Groups._post_chunk

    def spy(self, buf):
        chunk = original(self, buf)
        kept.append((chunk.untyped_storage().nbytes(), buf.untyped_storage().nbytes(), chunk._base is not None))
        return chunk

    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    losses, by_axis, grad_err, param_err = [], [], 0.0, 0.0
    groups_mod.Groups._post_chunk = spy
    try:
        for s in range(steps):
            gs = torch.Generator().manual_seed(100 + s)
            x = torch.randn(8, 8, generator=gs, dtype=torch.float64)  # 2 rows per rank
            y = torch.randn(8, 8, generator=gs, dtype=torch.float64)
            with fs.comm_log() as log:
                loss, grads = step(sharded, x, y)
            by_axis.append(dict(log.by_axis))
            rl, rg = fs.value_and_grad(ref_loss)(ref, x, y)
            grad_err = max(grad_err, max((a - b).abs().max().item()
                                         for a, b in zip(fs.tree.leaves(fs.gather(grads)), fs.tree.leaves(rg))))
            up, state = opt.update(grads, state, sharded)
            sharded = fs.optim.apply_updates(sharded, up)
            up, ref_state = ref_opt.update(rg, ref_state, ref)
            ref = fs.optim.apply_updates(ref, up)
            losses.append((loss.item(), rl.item()))
            param_err = max(param_err, max((a - b).abs().max().item()
                                           for a, b in zip(fs.tree.leaves(fs.gather(sharded)), fs.tree.leaves(ref))))
    finally:
        groups_mod.Groups._post_chunk = original
    return losses, grad_err, param_err, by_axis, kept


@pytest.mark.parametrize("raf, regather_axes", [(2, ("fsdp_in",)), ("fsdp_in", ("fsdp_in",)),
                                                (("fsdp_in",), ("fsdp_in",)), ("fsdp_out", ("fsdp_out",))])
def test_scenario10_layer_used_twice_reshard_to_inner_axis(raf, regather_axes):
    # A named axis need not be the trailing one ("fsdp_out": slices kept across "nodes").
    for losses, grad_err, param_err, by_axis, kept in run_on_ranks(_twice_2d, raf, 4, world_size=4):
        assert all(abs(a - b) <= 1e-10 * max(1.0, abs(b)) for a, b in losses)
        assert grad_err < 1e-10 and param_err < 1e-10
        for c in by_axis:
            # forward: one gather per layer over both axes; backward: one regather per layer,
            # over the post-forward axis only, although each layer is used twice
            assert c == {("all_gather", AXES2D): 2, ("all_gather", regather_axes): 2,
                         ("psum_scatter", AXES2D): 2, ("psum", AXES2D): 1}
        # Peak memory: what stays between forward and backward is a copy of half of each
        # gathered buffer (k = 2), never a view that keeps the whole buffer alive.
        assert len(kept) == 2 * 4
        assert all(chunk * 2 == full and not view for chunk, full, view in kept)


@pytest.mark.parametrize("raf, full_gathers, inner_gathers", [(True, 4, 0), (4, 4, 0), (False, 2, 0), (1, 2, 0)])
def test_reshard_after_forward_trivial_group_sizes(raf, full_gathers, inner_gathers):
    # FSDP2's rule: an int equal to the whole group is True; 1 is False (with a warning).
    for losses, grad_err, param_err, by_axis, kept in run_on_ranks(_twice_2d, raf, 2, world_size=4):
        assert grad_err < 1e-10 and param_err < 1e-10 and not kept
        for c in by_axis:
            assert c[("all_gather", AXES2D)] == full_gathers
            assert c.get(("all_gather", ("fsdp_in",)), 0) == inner_gathers


def _raf_error(shape, axis, raf, remat=False):
    mesh = fs.make_mesh(shape)
    layers = [{"w": torch.ones(4, 4, dtype=torch.float64)}]
    specs = fs.parallel.fsdp_specs(layers, axis)
    sharded = fs.shard(layers, specs, mesh)
    f = fs.shard_map(lambda p, x: fs.parallel.scan_layers(
                         lambda lp, h: h @ lp["w"], p, x, axis=axis,
                         config=fs.parallel.ScanConfig(reshard_after_forward=raf, remat=remat)).sum(),
                     mesh=mesh, in_specs=(specs, P()), out_specs=P(), check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            f(sharded, torch.ones(1, 4, dtype=torch.float64))
        except (ValueError, TypeError) as e:
            return type(e).__name__, str(e)
    return "ok", " | ".join(str(w.message) for w in caught)


@pytest.mark.parametrize("shape, axis, raf, kind, needles", [
    # an int that is no product of trailing axes: the valid values are listed
    (MESH2D, AXES2D, 3, "ValueError", ["reshard_after_forward=3", "trailing", "'fsdp_out': 2, 'fsdp_in': 2",
                                       "2 (('fsdp_in',))", "4 (= True)", "reshard_after_forward='fsdp_in'"]),
    # an axis the parameters are not sharded over
    (MESH2D, AXES2D, "tp", "ValueError", ["['tp']", "axis=('fsdp_out', 'fsdp_in')", "reshard_after_forward='fsdp_in'"]),
    # an int on one axis: split the axis
    ({"fsdp": 4}, "fsdp", 2, "ValueError", ["axis='fsdp' of size 4", "must be a mesh axis", "Split the axis",
                                            "make_mesh({'fsdp_out': 2, 'fsdp_in': 2})",
                                            "axis=('fsdp_out', 'fsdp_in')", "reshard_after_forward='fsdp_in'"]),
    ({"fsdp": 4}, "fsdp", 3, "ValueError", ["axis='fsdp' of size 4", "Split the axis", "divides 4"]),
    (MESH2D, AXES2D, 2.0, "TypeError", ["reshard_after_forward=2.0", "float"]),
    (MESH2D, AXES2D, 1, "ok", ["reshard_after_forward=1", "same as reshard_after_forward=False"]),
])
def test_reshard_after_forward_bad_values_name_axis_sizes_and_remedy(shape, axis, raf, kind, needles):
    got_kind, msg = run_on_ranks(_raf_error, shape, axis, raf, world_size=4)[0]
    assert got_kind == kind, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_reshard_to_inner_axis_with_remat_is_an_error():
    kind, msg = run_on_ranks(_raf_error, MESH2D, AXES2D, "fsdp_in", True, world_size=4)[0]
    assert kind == "ValueError" and "remat=True" in msg and "reshard_after_forward=True" in msg


def _axes_not_in_mesh_order():
    """Sharded over ("fsdp_in", "fsdp_out"), the reverse of the mesh order: the gather's rank
    order (mesh order) is not the order of the blocks, which the layout must undo."""
    mesh = fs.make_mesh(MESH2D)
    axes = ("fsdp_in", "fsdp_out")
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(8, 8, generator=g, dtype=torch.float64)}]
    specs = fs.parallel.fsdp_specs(params, axes)
    sharded = fs.shard(params, specs, mesh)

    def body(p, x):
        h = fs.parallel.scan_layers(lambda lp, z: torch.tanh(z @ lp["w"]), p, x, axis=axes)
        return fs.lax.pmean(h.sum(), axes)

    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    loss, grads = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axes)), out_specs=P()))(sharded, x)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: torch.tanh(x @ p[0]["w"]).sum() / 4)(params)
    return abs(loss.item() - ref_loss.item()), (fs.gather(grads)[0]["w"] - ref_grads[0]["w"]).abs().max().item()


def test_shard_axes_not_in_mesh_order():
    for loss_err, grad_err in run_on_ranks(_axes_not_in_mesh_order, world_size=4):
        assert loss_err < 1e-10 and grad_err < 1e-10


# --- scenario 9: a step over a sub-stack between full steps ----------------------------------

def _substep_body():
    # A full step over 3 MLPs, then a step that runs only layer 0, then a full step again,
    # all with SGD on fsdp=2: losses equal the reference's and the unused layers get zero
    # gradients (and no collectives) in the sub-step.
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    params = [{"w1": torch.randn(32, 32, generator=g, dtype=torch.float64) * 0.2,
               "w2": torch.randn(32, 32, generator=g, dtype=torch.float64) * 0.2} for _ in range(3)]
    specs = fs.parallel.fsdp_specs(params, "d")
    sharded = fs.shard(params, specs, mesh)

    def mlp(lp, z):
        return torch.relu(z @ lp["w1"]) @ lp["w2"]

    def body(p, x, y, k):
        h = fs.parallel.scan_layers(mlp, p[:k], x, axis="d")
        return fs.lax.pmean(((h - y) ** 2).mean(), "d")

    opt = fs.optim.sgd(0.1)
    state, ref, ref_state = opt.init(sharded), params, opt.init(params)
    out = []
    for step, k in enumerate((3, 1, 3)):
        x = torch.randn(8, 32, generator=g, dtype=torch.float64)
        y = torch.randn(8, 32, generator=g, dtype=torch.float64)
        f = fs.shard_map(lambda p, a, b: body(p, a, b, k), mesh=mesh, in_specs=(specs, P("d"), P("d")),
                         out_specs=P())
        with fs.comm_log() as log:
            loss, grads = fs.value_and_grad(f)(sharded, x, y)
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)

        def ref_loss(p):
            h = x
            for lp in p[:k]:
                h = mlp(lp, h)
            return ((h - y) ** 2).mean()

        ref_value, ref_grads = fs.value_and_grad(ref_loss)(ref)
        ref_updates, ref_state = opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, ref_updates)
        unused_zero = all(float(fs.gather(gl).abs().max()) == 0.0 for lp in grads[k:] for gl in lp.values())
        out.append((abs(loss.item() - ref_value.item()), unused_zero, log.counts["psum_scatter"]))
    err = max((fs.gather(a) - b).abs().max().item()
              for a, b in zip(fs.tree.leaves(sharded), fs.tree.leaves(ref)))
    return out, err


def test_scenario9_sub_stack_step_between_full_steps():
    for out, err in run_on_ranks(_substep_body, world_size=2):
        assert err < 1e-10
        for (loss_err, unused_zero, scatters), k in zip(out, (3, 1, 3)):
            assert loss_err < 1e-10 and unused_zero
            assert scatters == k  # one reduce-scatter per layer that ran


# --- scenario 35: one communication context for all groups -------------------------------

def _one_context_body():
    # 3 MLP(16) groups, no root group: every all-gather goes through one process group and
    # every reduce-scatter through one (gloo runs one queue per group), none is left in flight
    # after the step, and loss and grads match the reference.
    from torch.utils._python_dispatch import TorchDispatchMode

    funcol = torch.ops._c10d_functional

    class Groups(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.used = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # On gloo a reduce-scatter runs as an all-to-all (comm.reduce_scatter_async);
            # no other all-to-all runs here.
            kind = {funcol.all_gather_into_tensor.default: "all_gather", funcol.reduce_scatter_tensor.default:
                    "reduce_scatter", funcol.all_to_all_single.default: "reduce_scatter"}.get(func)
            if kind is not None:
                self.used.setdefault(kind, set()).add(args[-1])
            return func(*args, **(kwargs or {}))

    mesh = fs.make_mesh({"d": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    params = [{"w1": torch.randn(16, 16, generator=g, dtype=torch.float64) * 0.3,
               "w2": torch.randn(16, 16, generator=g, dtype=torch.float64) * 0.3} for _ in range(3)]
    specs = fs.parallel.fsdp_specs(params, "d")
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    y = torch.randn(8, 16, generator=g, dtype=torch.float64)

    def mlp(lp, z):
        return torch.relu(z @ lp["w1"]) @ lp["w2"]

    f = fs.shard_map(lambda p, a, b: fs.lax.pmean(((fs.parallel.scan_layers(mlp, p, a, axis="d") - b) ** 2).mean(), "d"),
                     mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P())
    with Groups() as mode:
        loss, grads = fs.value_and_grad(f)(fs.shard(params, specs, mesh), x, y)
    in_flight = torch._C._distributed_c10d._get_work_registry_size()

    def ref(p):
        h = x
        for lp in p:
            h = mlp(lp, h)
        return ((h - y) ** 2).mean()

    ref_loss, ref_grads = fs.value_and_grad(ref)(params)
    err = max((fs.gather(a) - b).abs().max().item() for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(ref_grads)))
    return abs(loss.item() - ref_loss.item()), err, {k: len(v) for k, v in mode.used.items()}, in_flight


def test_scenario35_one_gather_queue_one_reduce_scatter_queue_nothing_left_in_flight():
    for loss_err, grad_err, queues, in_flight in run_on_ranks(_one_context_body, world_size=2):
        assert loss_err < 1e-10 and grad_err < 1e-10
        assert queues == {"all_gather": 1, "reduce_scatter": 1}, queues
        assert in_flight == 0


# --- scenario 8: what is alive after forward and after backward ------------------------------

def _alive_body(raf):
    # Functional form of FSDP2's registration semantics: parameters never change form, so
    # what matters is which gathered (full) parameters outlive forward. Weak references to
    # the full tensors each layer saw tell: freed after forward with reshard_after_forward
    # (only shards remain), kept for backward without it, all freed after backward.
    import gc
    import weakref

    mesh = fs.make_mesh({"d": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g, dtype=torch.float64)} for _ in range(3)]
    specs = fs.parallel.fsdp_specs(params, "d")
    refs = []

    def layer(lp, z):
        refs.append(weakref.ref(lp["w"]))
        return torch.tanh(z @ lp["w"])

    def body(p, a):
        return fs.parallel.scan_layers(layer, p, a, axis="d", config=fs.parallel.ScanConfig(reshard_after_forward=raf))

    x = torch.randn(4, 4, generator=g, dtype=torch.float64)
    f = fs.shard_map(body, mesh=mesh, in_specs=(specs, P("d")), out_specs=P("d"))
    sharded = fs.shard(params, specs, mesh)
    for leaf in fs.tree.leaves(sharded):
        leaf.requires_grad_(True)
    y = f(sharded, x)
    gc.collect()
    after_forward = sum(r() is not None for r in refs)
    y.to_local().sum().backward()
    gc.collect()
    after_backward = sum(r() is not None for r in refs)
    shards_sharded = all(leaf.to_local().shape[0] == 2 for leaf in fs.tree.leaves(sharded))
    return after_forward, after_backward, shards_sharded


# Without reshard, layers 1 and 2 keep their full weight for backward (z @ w saves w for
# z's gradient); layer 0's input is the data, which needs no gradient, so nothing keeps w.
@pytest.mark.parametrize("raf, alive", [(True, 0), (False, 2)])
def test_scenario8_gathered_params_alive_after_forward_only_without_reshard(raf, alive):
    for after_forward, after_backward, shards_sharded in run_on_ranks(_alive_body, raf, world_size=2):
        assert after_forward == alive and after_backward == 0 and shards_sharded


# --- scenario 23: a step through part of the model (forward_features) ------------------------

def _features_body():
    # A ViT-like stem (Conv2d, 4-d weight sharded on dim 0) then a head; one step calls only
    # the features, one the whole model: any function of the params is a step, and the
    # sharded grads match the reference in both (the head's are zero in the first).
    import torch.nn.functional as F

    mesh = fs.make_mesh({"d": dist.get_world_size()})
    g = torch.Generator().manual_seed(0)
    params = {"features": {"w": torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64) * 0.2,
                           "b": torch.zeros(8, dtype=torch.float64)},
              "head": {"w": torch.randn(6, 8, generator=g, dtype=torch.float64) * 0.3}}
    specs = fs.parallel.fsdp_specs(params, "d")
    sharded = fs.shard(params, specs, mesh)
    img = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
    target = torch.randn(4, 8, generator=g, dtype=torch.float64)

    def features(p, x):
        return F.conv2d(x, p["w"], p["b"], stride=4).mean(dim=(2, 3))               # (b, 8)

    def feature_loss(p, x, t):
        full = fs.parallel.gather_params(p["features"], axis="d")
        return fs.lax.pmean(((features(full, x) - t) ** 2).mean(), "d")

    def full_loss(p, x, t):
        feats = features(fs.parallel.gather_params(p["features"], axis="d"), x)
        out = feats @ fs.parallel.gather_params(p["head"], axis="d")["w"].T         # (b, 6)
        return fs.lax.pmean(((out - t[:, :6]) ** 2).mean(), "d")

    out = []
    for fn, ref_fn in ((feature_loss, lambda p: ((features(p["features"], img) - target) ** 2).mean()),
                       (full_loss, lambda p: (((features(p["features"], img) @ p["head"]["w"].T)
                                               - target[:, :6]) ** 2).mean())):
        f = fs.shard_map(fn, mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P())
        loss, grads = fs.value_and_grad(f)(sharded, img, target)
        ref_loss, ref_grads = fs.value_and_grad(ref_fn)(params)
        err = max((fs.gather(a) - b).abs().max().item()
                  for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(ref_grads)))
        out.append((abs(loss.item() - ref_loss.item()), err, float(fs.gather(grads["head"]["w"]).abs().max())))
    return out


def test_scenario23_step_through_part_of_the_model():
    for (fl, fg, head_grad), (al, ag, _) in run_on_ranks(_features_body, world_size=2):
        assert max(fl, fg, al, ag) < 1e-10
        assert head_grad == 0.0  # the head did not take part in the features-only step


# --- the map above stays true ----------------------------------------------------------------

def test_scenario_map_lists_all_36_and_names_only_existing_tests():
    import re
    from pathlib import Path

    rows = re.findall(r"^ {1,2}(\d{1,2})  ", __doc__, flags=re.M)
    assert [int(n) for n in rows] == list(range(1, 37)), rows
    sources = "\n".join(p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py"))
    named = set(re.findall(r"(?<![\w/])(test_\w+)(?!\w)(?!\.py)", __doc__))  # test names, not files
    assert len(named) > 30, named
    missing = sorted(n for n in named if f"def {n}(" not in sources)
    assert not missing, missing
    assert "36  graph capture                             not ported:" in __doc__

"""FSDP / replicate / HSDP through scan_layers, against a single-process reference, on gloo.

Functional ports of seed_tests.md scenarios: 1 (uneven MLP shards), 3 (Transformer,
reshard after forward on/off/to the inner axis of a 2x2 mesh, exact comm counts), 5 (host
offload, on CPU meshes: the copies are no-ops here but the code path runs), 11 (remat),
12 (tied weights), 16/17 (HSDP), 22 (fsdp=1 issues nothing), 24 (replicate). Each rank gets different
data (global batch sliced over the data axes); the reference trains on the global batch.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, block, embed, head, transformer_init
from fshard.testing import local_block_diff, run_on_ranks

CFG = dict(vocab_size=33, dim=16, n_layers=3, n_heads=4, max_seq_len=8)
# Adam steps per run (some ran 3): each step's loss and params are compared, the second
# step's update reads the moments of the first.
STEPS = 2


def _setup(shape, mode, tie):
    mesh = fs.make_mesh(shape)
    cfg = TransformerConfig(**CFG, tie_weights=tie)
    params = transformer_init(cfg, 42, dtype=torch.float64)
    if mode == "fsdp":
        axes = dict(axis="fsdp", replicate_axis=None)
        specs = fs.parallel.fsdp_specs(params, "fsdp")
    elif mode == "fsdp2d":  # sharded over both axes of a 2x2 mesh ("nodes" x "GPUs per node")
        axes = dict(axis=("fsdp_out", "fsdp_in"), replicate_axis=None)
        specs = fs.parallel.fsdp_specs(params, ("fsdp_out", "fsdp_in"))
    elif mode == "hsdp":
        axes = dict(axis="fsdp", replicate_axis="dp")
        specs = fs.parallel.hsdp_specs(params, "fsdp", "dp")
    else:  # replicate
        axes = dict(axis=None, replicate_axis="dp")
        specs = fs.parallel.replicate_specs(params)
    data_axes = tuple(a for a in ("dp", "fsdp", "fsdp_out", "fsdp_in") if a in shape)
    return mesh, cfg, params, specs, axes, data_axes


def _loss(p, tokens, targets, cfg, axes, data_axes, raf, remat):
    root = {k: v for k, v in p.items() if k != "layers"}
    root = fs.parallel.gather_params(root, **axes)
    x = embed(root, tokens, cfg)                                              # (b, T, D)
    loop = fs.parallel.ScanConfig(reshard_after_forward=raf, remat=remat, offload=axes.get("offload", False))
    x = fs.parallel.scan_layers(lambda lp, h: block(lp, h, cfg), p["layers"], x, config=loop,
                                **{k: v for k, v in axes.items() if k != "offload"})
    logits = head(root, x, cfg)                                               # (b, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return fs.lax.pmean(loss, data_axes)


def _batch(step, n_rows, cfg):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, cfg.vocab_size, (n_rows, cfg.max_seq_len), generator=g)
    return tok, torch.roll(tok, -1, dims=1)


def _train(shape, mode, raf, remat, tie, steps, check, offload=False, detailed=False, order="outside"):
    mesh, cfg, params, specs, axes, data_axes = _setup(shape, mode, tie)
    axes = dict(axes, offload=offload)
    n_data = math.prod(shape[a] for a in data_axes)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    if offload:  # a no-op move on this CPU mesh, but the helper's DTensor rebuild runs
        sharded = fs.parallel.scan.offload_shards(sharded)
    opt = fs.optim.adam(1e-2)
    state = opt.init(sharded)
    def loss_fn(p, a, b):
        return _loss(p, a, b, cfg, axes, data_axes, raf, remat)

    in_specs = (specs, P(data_axes), P(data_axes))
    if order == "outside":  # value_and_grad(shard_map(loss))
        step = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check))
    else:  # JAX's usual order: shard_map(value_and_grad(loss)), gradients laid out like the params
        step = fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs),
                            check=check)
    ref, ref_opt = params, fs.optim.adam(1e-2)
    ref_state = ref_opt.init(ref)
    losses, counts, worst = [], [], 0.0
    by_axis, on_cpu = [], True
    for s in range(steps):
        tok, tgt = _batch(s, 2 * n_data, cfg)
        with fs.comm_log() as log:
            loss, grads = step(sharded, tok, tgt)
        counts.append(dict(log.counts))
        by_axis.append(dict(log.by_axis))
        on_cpu &= all(_local(t).device.type == "cpu" for t in fs.tree.leaves(grads))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        ref_loss, ref_grads = fs.value_and_grad(
            lambda p: F.cross_entropy(head(p, _ref_body(p, tok, cfg), cfg).flatten(0, 1), tgt.flatten()))(ref)
        upd, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, upd)
        losses.append((loss.item(), ref_loss.item()))
        # Each rank's blocks against the reference's, every step (a gather per step cost about
        # as much as the step); the last step's params are also gathered, through DTensor.
        worst = max(worst, local_block_diff(sharded, ref, specs, mesh, uneven=True))
    full = fs.gather(sharded)
    worst = max(worst, max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(full), fs.tree.leaves(ref))))
    on_cpu &= all(_local(t).device.type == "cpu" for t in fs.tree.leaves((sharded, state)))
    return (losses, counts, worst, by_axis, on_cpu) if detailed else (losses, counts, worst)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # optimizer state holds plain step counts


def _train_detailed(*args, **kwargs):
    """``_train(..., detailed=True)`` (adds per-step comm_log.by_axis and whether params,
    grads and optimizer state stayed on the CPU) plus the ``layout.to_compute`` calls made."""
    from fshard.parallel import flat as layout_mod

    calls = []
    original = layout_mod.to_compute

    def spy(flat, device):
        calls.append((flat.device.type, device.type))
        return original(flat, device)

    layout_mod.to_compute = spy
    try:
        return _train(*args, detailed=True, **kwargs) + (calls,)
    finally:
        layout_mod.to_compute = original


def _ref_body(p, tok, cfg):
    x = embed(p, tok, cfg)
    for lp in p["layers"]:
        x = block(lp, x, cfg)
    return x


def _assert_parity(results, tol=1e-10):
    for losses, _, worst in results:
        for got, want in losses:
            assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)
        assert worst < tol, worst


ORDERS = ["outside", "inside"]  # value_and_grad(shard_map(f)) and shard_map(value_and_grad(f))

_RUNS: dict = {}


def _run(shape, mode, raf, remat, tie, steps, check, offload=False, order="outside"):
    """Every rank's ``_train_detailed`` results for these arguments, computed once per session:
    several tests check different things about the same run (the offload test's baseline is
    another test's run, the order and checked-mode comparisons reuse the parity runs).
    ``r[:3]`` of each rank's result is ``_train``'s (losses, counts, worst)."""
    key = (tuple(shape.items()), mode, raf, remat, tie, steps, check, offload, order)
    if key not in _RUNS:
        _RUNS[key] = run_on_ranks(_train_detailed, shape, mode, raf, remat, tie, steps, check, offload=offload,
                                  order=order, world_size=math.prod(shape.values()))
    return _RUNS[key]


def _plain(results):
    return [r[:3] for r in results]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("raf", [True, False])
def test_fsdp_transformer_loss_params_and_comm_counts(n, raf, order):
    results = _plain(_run({"fsdp": n}, "fsdp", raf, False, False, STEPS, True, order=order))
    _assert_parity(results)
    g = CFG["n_layers"] + 1  # one group per block plus the root group
    for _, counts, _ in results:
        for c in counts:
            # root gathered once (kept for backward); blocks twice with reshard, once without
            assert c["all_gather"] == (1 + 2 * CFG["n_layers"] if raf else g)
            assert c["psum_scatter"] == g
            assert c["psum"] == 1  # the loss pmean only: no gradient all-reduce


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("remat, tie", [(True, False), (False, True), (True, True)])
def test_fsdp_remat_and_tied_weights(remat, tie, order):
    _assert_parity(_plain(_run({"fsdp": 2}, "fsdp", True, remat, tie, STEPS, True, order=order)))


@pytest.mark.parametrize("order", ORDERS)
def test_replicate_is_ddp(order):
    results = _plain(_run({"dp": 2}, "replicate", False, False, False, STEPS, True, order=order))
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c.get("all_gather", 0) == 0 and c.get("psum_scatter", 0) == 0
            assert c["psum"] == 1 + 1 + 1  # loss + root group + one bucket for all blocks


@pytest.mark.parametrize("order", ORDERS)
def test_hsdp_2x2(order):
    results = _plain(_run({"dp": 2, "fsdp": 2}, "hsdp", True, False, False, STEPS, True, order=order))
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c["psum_scatter"] == CFG["n_layers"] + 1
            assert c["psum"] == 1 + CFG["n_layers"] + 1  # loss + all-reduce over dp per group


@pytest.mark.parametrize("raf, order", [(2, "outside"), ("fsdp_in", "outside"), ("fsdp_in", "inside")])
def test_fsdp_2x2_reshard_to_inner_axis_regathers_over_it_only(raf, order):
    # Scenario 3 with RAF=2 on 2 "nodes" of 2: forward gathers over both axes, backward
    # regathers each block over ("fsdp_in",) only; the reduce-scatter stays over both.
    results = _run({"fsdp_out": 2, "fsdp_in": 2}, "fsdp2d", raf, False, False, STEPS, True, order=order)
    _assert_parity([r[:3] for r in results])
    both, L = ("fsdp_out", "fsdp_in"), CFG["n_layers"]
    for _, counts, _, by_axis, _, calls in results:
        for c in by_axis:
            assert c == {("all_gather", both): 1 + L, ("all_gather", ("fsdp_in",)): L,
                         ("psum_scatter", both): 1 + L, ("psum", both): 1}
        assert calls == []  # no offload: the host-to-device copy is never asked for


@pytest.mark.parametrize("shape, mode, raf, order", [
    ({"fsdp": 2}, "fsdp", True, "outside"),
    ({"fsdp": 2}, "fsdp", True, "inside"),
    ({"fsdp": 2}, "fsdp", False, "outside"),
    ({"dp": 2, "fsdp": 2}, "hsdp", True, "outside"),
    ({"fsdp_out": 2, "fsdp_in": 2}, "fsdp2d", "fsdp_in", "outside"),
    ({"dp": 2}, "replicate", False, "outside"),
    ({"dp": 2}, "replicate", False, "inside"),
])
def test_offload_parity_and_everything_stays_on_the_host(shape, mode, raf, order):
    # Scenario 5 on CPU meshes: the compute device is the CPU, so the copies are no-ops,
    # but every gather goes through _to_compute and every gradient through the host path.
    steps = STEPS
    results = _run(shape, mode, raf, False, False, steps, True, offload=True, order=order)
    _assert_parity([r[:3] for r in results])
    base = _plain(_run(shape, mode, raf, False, False, steps, True, order=order))  # another test's run
    L = CFG["n_layers"]
    for (losses, counts, _, _, on_cpu, calls), (base_losses, base_counts, _) in zip(results, base):
        assert losses == base_losses and counts == base_counts  # bitwise the same as without offload
        assert on_cpu
        assert all(c == ("cpu", "cpu") for c in calls)
        if mode == "replicate":
            assert len(calls) > 0  # no gather: each leaf itself is copied to the device
        else:
            # per step, the root group and each block copy their flat shard buffer once per
            # gather from the shards: a full regather (raf=True) copies again, a regather
            # from the kept inner-axis slice does not (that slice stays on the device)
            assert len(calls) == steps * (1 + L + (L if raf is True else 0))


@pytest.mark.parametrize("order", ORDERS)
def test_unchecked_mode_gives_identical_results(order):
    a = _plain(_run({"fsdp": 2}, "fsdp", True, False, False, STEPS, True, order=order))
    b = _plain(_run({"fsdp": 2}, "fsdp", True, False, False, STEPS, False, order=order))
    assert [x[0] for x in a] == [x[0] for x in b]


def test_both_orders_give_bitwise_equal_losses_and_params():
    # Same collectives, same kernels, same order: the two compositions agree exactly.
    a = _plain(_run({"fsdp": 2}, "fsdp", True, False, False, STEPS, True, order="outside"))
    b = _plain(_run({"fsdp": 2}, "fsdp", True, False, False, STEPS, True, order="inside"))
    assert [x[0] for x in a] == [x[0] for x in b] and [x[1] for x in a] == [x[1] for x in b]


def test_fsdp_world_one_issues_nothing():
    (losses, counts, worst), = run_on_ranks(_train, {"fsdp": 1}, "fsdp", True, False, False, 2, True, world_size=1)
    assert all(c == {} for c in counts)
    _assert_parity([(losses, counts, worst)])

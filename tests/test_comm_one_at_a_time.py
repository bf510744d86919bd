"""fshard keeps at most one collective in flight per gloo process group (docs/reliability.md).

Two collectives in flight on one gloo group run at once on the group's two worker
threads, which torch 2.13's gloo does not survive reliably (heap corruption, a rank dead
of SIGSEGV or of glibc's heap checks). These tests watch every functional collective
fshard issues during real FSDP / HSDP / DDP / pipeline steps and check that no gloo group
ever has two of them started and not yet waited, and that the results are unchanged.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fshard as fs
from fshard import P, comm
from fshard.testing import run_on_ranks

_F = torch.ops._c10d_functional
_STARTS = {_F.all_gather_into_tensor.default, _F.reduce_scatter_tensor.default, _F.all_reduce.default,
           _F.all_reduce_.default, _F.all_to_all_single.default}


class _InFlight(TorchDispatchMode):
    """Counts, per process group, the functional collectives started and not yet waited."""

    def __init__(self):
        super().__init__()
        self.open: dict[str, set[int]] = {}
        self.most: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _STARTS:
            group = args[-1]
            started = self.open.setdefault(group, set())
            started.add(out.untyped_storage().data_ptr())
            self.most[group] = max(self.most.get(group, 0), len(started))
        elif func is _F.wait_tensor.default:
            key = args[0].untyped_storage().data_ptr()
            for started in self.open.values():
                started.discard(key)
        return out


def _hsdp_steps(mode: str):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"r": 2, "d": n // 2} if mode == "hsdp" else {"d": n})
    data = ("r", "d") if mode == "hsdp" else "d"
    g = torch.Generator().manual_seed(0)
    dim = 16
    params = {"lin": {"w": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2},
              "layers": [{"w1": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2,
                          "w2": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.2} for _ in range(4)]}
    if mode == "hsdp":
        specs, axes = fs.parallel.hsdp_specs(params, "d", "r"), dict(axis="d", replicate_axis="r")
    elif mode == "fsdp":
        specs, axes = fs.parallel.fsdp_specs(params, "d"), dict(axis="d")
    else:  # ddp: one bucket per layer, so several all-reduces are started during backward
        specs, axes = fs.parallel.replicate_specs(params), dict(axis=None, replicate_axis="d")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    bucket = dict(bucket_bytes=1) if mode == "ddp" else {}
    loop_axes = dict(axes, config=fs.parallel.ScanConfig(prefetch=2, **bucket))

    def body(p, x, y):
        h = x @ fs.parallel.gather_params(p["lin"], **axes)["w"]
        h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"], p["layers"], h,
                                    **loop_axes)
        return fs.lax.pmean(((h - y) ** 2).mean(), data)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(data), P(data)), out_specs=P()))
    xs = torch.randn(2, 2 * n, dim, generator=g, dtype=torch.float64)
    ys = torch.randn(2, 2 * n, dim, generator=g, dtype=torch.float64)
    watch = _InFlight()
    with watch:
        for k in range(2):
            loss, grads = step(sharded, xs[k], ys[k])

    def ref_loss(p):
        h = xs[1] @ p["lin"]["w"]
        for lp in p["layers"]:
            h = torch.relu(h @ lp["w1"]) @ lp["w2"]
        return ((h - ys[1]) ** 2).mean()

    ref = fs.grad(ref_loss)(params)
    diff = max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(fs.gather(grads)), fs.tree.leaves(ref)))
    return watch.most, diff, len(watch.most)


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "ddp"])
def test_at_most_one_collective_in_flight_per_gloo_group(mode):
    for most, diff, n_groups in run_on_ranks(_hsdp_steps, mode, world_size=4):
        assert diff < 1e-10
        assert n_groups >= 1 and max(most.values()) == 1, most


def _overlapped(n_layers: int):
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    group, n, r = mesh.group("d"), mesh.axis_size("d"), mesh.axis_index("d")
    handles = [comm.all_gather_async(torch.full((5,), float(r + k)), group, n) for k in range(n_layers)]
    done_before_wait = [h._done for h in handles]
    rs = comm.reduce_scatter_async(torch.ones(4 * n), group, n)
    outs = [h.wait() for h in handles]
    return done_before_wait, [o.tolist() for o in outs], rs.wait().tolist()


def test_a_new_collective_completes_the_previous_one_on_the_group():
    for done, outs, rs in run_on_ranks(_overlapped, 3, world_size=2):
        assert done == [True, True, False]  # each later start completed the earlier ones
        assert outs == [[float(k)] * 5 + [float(k + 1)] * 5 for k in range(3)]
        assert rs == [2.0] * 4


def _pp_stage(p, x, stage):
    return torch.tanh(x @ p["w"])


def _pp_loss(y, t):
    return ((y - t) ** 2).mean()


def _pp_dp_step():
    # Interleaved 1F1B over pp=2 with 2 stages per rank: each rank's data-parallel gradient
    # all-reduce (sched's _GradReducer) is launched once per stage it holds, during the
    # schedule, so without the rule two would be in flight on the dp group at once.
    mesh = fs.make_mesh({"dp": 2, "pp": 2})
    rank = mesh.axis_index("pp")
    sch = fs.sched.interleaved_1f1b(2, 4, n_virtual=2)
    g = torch.Generator().manual_seed(0)
    dim = 8
    params = [{"w": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.5} for _ in range(sch.n_stages)]
    x = torch.randn(16, dim, generator=g, dtype=torch.float64)
    y = torch.randn(16, dim, generator=g, dtype=torch.float64)
    held = set(sch.stages_of(rank))
    sp = [{"w": p["w"].clone()} if s in held else None for s, p in enumerate(params)]
    watch = _InFlight()
    with watch:  # x, y: the global batch; dp rank d takes rows 8d..8d+7
        loss, grads = fs.sched.pipeline_step(_pp_stage, _pp_loss, sp, (x, y), schedule=sch,
                                             mesh=mesh, data_axes="dp")

    def ref_loss(ps):
        h = x
        for p in ps:
            h = _pp_stage(p, h, None)
        return _pp_loss(h, y)

    ref = fs.grad(ref_loss)(params)
    diff = max((grads[s]["w"] - ref[s]["w"]).abs().max().item() for s in held)
    dp_group = mesh.group("dp").group_name
    return watch.most.get(dp_group, 0), diff, abs(loss.item() - ref_loss(params).item())


def test_pipeline_data_parallel_gradient_reductions_one_at_a_time():
    for most_on_dp, diff, loss_err in run_on_ranks(_pp_dp_step, world_size=4):
        assert most_on_dp == 1  # the reductions ran (2 stages each), never two at once
        assert diff < 1e-10 and loss_err < 1e-10


def _remat_block_with_collective(policy):
    # The rule waits, inside whichever code starts the next collective, for the previous
    # one on the group. Here that happens inside a checkpointed block: the block's pmean
    # over the FSDP axis completes a prefetched gather in forward. Selective checkpointing
    # replays saved collective outputs in order, so an extra wait on one side only could
    # hand a block the wrong tensor: the gradients would be wrong.
    n = dist.get_world_size()
    mesh = fs.make_mesh({"d": n})
    g = torch.Generator().manual_seed(0)
    dim = 8
    params = {"layers": [{"w": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3} for _ in range(4)]}
    specs = fs.parallel.fsdp_specs(params, "d")
    sharded = fs.shard(params, specs, mesh, uneven=True)

    def blk(lp, z):
        h = torch.tanh(z @ lp["w"])
        # tanh after the pmean: backward needs its output, so the recomputation runs
        # through the collective (it stops at the last saved tensor it needs).
        return h + 0.1 * torch.tanh(fs.lax.pmean(h, "d"))

    def body(p, x, y):
        h = fs.parallel.scan_layers(blk, p["layers"], x, axis="d",
                                    config=fs.parallel.ScanConfig(prefetch=2, remat=True, remat_policy=policy))
        return fs.lax.pmean(((h - y) ** 2).mean(), "d")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P()))
    x = torch.randn(2 * n, dim, generator=g, dtype=torch.float64)
    y = torch.randn(2 * n, dim, generator=g, dtype=torch.float64)
    _, grads = step(sharded, x, y)

    def ref(p):
        hs = list(x.chunk(n))
        for lp in p["layers"]:
            hs = [torch.tanh(h @ lp["w"]) for h in hs]
            mean = sum(hs) / n
            hs = [h + 0.1 * torch.tanh(mean) for h in hs]
        return sum(((h - t) ** 2).mean() for h, t in zip(hs, y.chunk(n))) / n

    expected = fs.grad(ref)(params)
    return max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(fs.gather(grads)), fs.tree.leaves(expected)))


@pytest.mark.parametrize("policy", [None, "save_collectives", "dots_saveable"])
def test_remat_block_with_a_collective_on_the_fsdp_group(policy):
    for diff in run_on_ranks(_remat_block_with_collective, policy, world_size=2):
        assert diff < 1e-10

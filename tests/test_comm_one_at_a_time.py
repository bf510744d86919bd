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
    loop_axes = dict(axes, bucket_bytes=1) if mode == "ddp" else axes

    def body(p, x, y):
        h = x @ fs.parallel.gather_params(p["lin"], **axes)["w"]
        h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"], p["layers"], h,
                                    prefetch=2, **loop_axes)
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

"""Stress of overlapped async collectives as FSDP issues them (no model): per iteration,
two all-gathers in flight (a layer and its prefetch), a reduce-scatter started while the
next all-gather runs, an all-reduce of a scalar, compute and allocation churn between, and
every result checked. Sizes from a few elements to ~1 MB, 2 or 4 ranks.

    PYTHONPATH=. nice -n 10 python tools/stress_overlap.py --calls 20 --iters 500 --world 4

``--threads 1`` runs the collectives on a gloo group with one worker thread (instead of
the default two): if failures stop there, they come from collectives running at once.
``--funcol 0`` uses ``dist.*(async_op=True)`` instead of the functional collectives.
"""

import argparse
import sys
import time
import traceback

import torch

SIZES = [1, 3, 17, 256, 4099, 50_000, 200_003]


def _group(threads: int):
    """The world's ranks on a gloo group with ``threads`` worker threads (0: fshard's world group, one worker).

    ``new_group`` ignores ``pg_options`` for gloo (always 2 threads), so the backend is
    built directly and registered by name, which the functional collectives resolve.
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from fshard.runtime import gloo_workers

    if threads in (0, gloo_workers.worker_threads()):  # 0: the world group as fshard made it
        return dist.group.WORLD
    name = f"stress_overlap_t{threads}_{os.getpid()}_{len(c10d._world.pg_names)}"
    before = len(os.listdir("/proc/self/task"))
    store = dist.PrefixStore(f"{name.rsplit('_', 2)[0]}/", c10d._get_default_store())
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = threads
    opts._timeout = timedelta(seconds=600)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    rank, size = dist.get_rank(), dist.get_world_size()
    backend = dist.ProcessGroupGloo(store, rank, size, opts)
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, pg)
    added = len(os.listdir("/proc/self/task")) - before
    assert added == threads + 1, f"expected {threads} gloo workers + 1 I/O thread, got {added} new threads"
    return pg


def body(iters: int, seed: int, threads: int, funcol: int) -> int:
    import torch.distributed as dist

    from fshard import comm

    g = _group(threads)
    n, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)  # same on every rank: same sizes everywhere

    def ag(x):
        if funcol:
            return comm.all_gather_async(x, g, n)
        out = torch.empty(n * x.shape[0], dtype=x.dtype)
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
        return _W(w, out)

    def rs(x):
        if funcol:
            return comm.reduce_scatter_async(x, g, n)
        out = torch.empty(x.shape[0] // n, dtype=x.dtype)
        w = dist.reduce_scatter_tensor(out, x, group=g, async_op=True)
        return _W(w, out)

    checks = 0
    for it in range(iters):
        m1, m2, m3 = (SIZES[int(torch.randint(len(SIZES), (1,), generator=gen))] for _ in range(3))
        a = ag(torch.full((m1,), float(r), dtype=torch.float32))
        b = ag(torch.full((m2,), float(r + 1), dtype=torch.float32))  # the prefetch
        out_a = a.wait()
        assert torch.equal(out_a, torch.arange(n, dtype=torch.float32).repeat_interleave(m1)), "ag a"
        y = out_a.view(n, m1).sum(0)  # compute on the gathered buffer
        c = rs(torch.full((n * m3,), float(r + 1), dtype=torch.float32))  # grads of the layer
        junk = [torch.empty(int(torch.randint(1, 300, (1,), generator=gen))) for _ in range(16)]
        d = ag(torch.full((m3,), 2.0, dtype=torch.float32))  # next layer while the RS runs
        del junk, out_a
        out_b = b.wait()
        assert torch.equal(out_b, (torch.arange(n, dtype=torch.float32) + 1).repeat_interleave(m2)), "ag b"
        out_d = d.wait()
        assert torch.all(out_d == 2.0), "ag d"
        out_c = c.wait()
        assert torch.all(out_c == n * (n + 1) / 2), "rs c"
        s = torch.tensor([float(y.sum())])
        dist.all_reduce(s, group=g)  # the loss / grad-norm scalar, synchronous
        checks += 4
    if g is not dist.group.WORLD:
        torch._C._distributed_c10d._unregister_process_group(g.group_name)
    return checks


def body_hsdp(iters: int, seed: int, sizes: tuple[int, ...]) -> int:
    """HSDP's backward as fshard issues it on a dp x fsdp mesh: per layer a reduce-scatter
    over fsdp (on gloo: an all-reduce of a clone, on a worker thread), a layer's prefetched
    all-gather over fsdp in flight beside it, then, at the end of backward, each
    reduce-scatter waited and its shard all-reduced over dp (synchronously)."""
    import torch.distributed as dist

    import fshard as fs
    from fshard import comm

    mesh = fs.make_mesh({"dp": 2, "fsdp": dist.get_world_size() // 2})
    fsdp, dp = mesh.group("fsdp"), mesh.group("dp")
    n = mesh.axis_size("fsdp")
    r = mesh.axis_index("fsdp")
    checks = 0
    for it in range(iters):
        pending = []
        for k, m in enumerate(sizes):  # backward, last layer first
            g = torch.full((n * m,), float(k + 1), dtype=torch.float32)
            pending.append((k, comm.reduce_scatter_async(g, fsdp, n)))
            ag = comm.all_gather_async(torch.full((m,), float(r), dtype=torch.float32), fsdp, n)
            x = torch.randn(64, 64)
            x = x @ x  # the next layer's backward compute
            out = ag.wait()
            assert out[-1] == n - 1, "ag"
        for k, h in pending:
            shard = h.wait()
            total = comm.all_reduce(shard, dp, "sum", axes=("dp",))
            assert torch.all(total == 2 * n * (k + 1)), "rs+ar"
            checks += 1
    return checks


class _W:
    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        self.work.wait()
        return self.out


def main() -> None:
    from fshard.testing import run_on_ranks, shutdown_pools

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="gloo worker threads of the group")
    ap.add_argument("--funcol", type=int, default=1, help="1: functional collectives (as fshard.comm)")
    ap.add_argument("--hsdp", action="store_true",
                    help="HSDP's backward on a dp=2 x fsdp mesh (per-layer reduce-scatters beside "
                         "all-gathers, then all-reduces over dp) instead of the 1-D pattern")
    a = ap.parse_args()
    fails, t0 = 0, time.time()
    for c in range(a.calls):
        try:
            if a.hsdp:
                run_on_ranks(body_hsdp, a.iters, c, (49_152, 49_152, 8_192, 130_000), world_size=a.world,
                             timeout_s=900)
            else:
                run_on_ranks(body, a.iters, c, a.threads, a.funcol, world_size=a.world, timeout_s=900)
        except Exception as e:  # noqa: BLE001 - count and show every failure
            fails += 1
            print(f"[{c}] FAILED: {''.join(traceback.format_exception_only(type(e), e))[:4000]}", flush=True)
        print(f"{c + 1} calls x {a.iters} iters, {fails} failures, {time.time() - t0:.0f}s", flush=True)
    shutdown_pools()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()

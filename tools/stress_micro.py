"""Micro stress of the raw collectives fshard.comm issues (no model): many small async
all-gathers / reduce-scatters / all-reduces in flight, with small-tensor churn between.

    PYTHONPATH=. nice -n 19 python tools/stress_micro.py --calls 20 --iters 2000 [--variant V] [--world 4]
"""
import argparse
import sys
import time
import traceback

import torch


def body(iters, variant, seed):
    import torch.distributed as dist
    from fshard import comm

    g = dist.group.WORLD
    n = dist.get_world_size()
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 3, 8, 16, 40, 100, 257]
    keep = []
    for it in range(iters):
        hs = []
        for k in range(4):
            m = sizes[(it + k) % len(sizes)]
            x = torch.full((m,), float(r + k), dtype=torch.float64)
            if variant in ("all", "ag"):
                hs.append(("ag", m, comm.all_gather_async(x, g, n)))
            if variant in ("all", "rs"):
                y = torch.full((n * m,), float(r + 1), dtype=torch.float64)
                hs.append(("rs", m, comm.reduce_scatter_async(y, g, n)))
            if variant in ("all", "ar"):
                hs.append(("ar", m, comm.all_reduce_async(x, g)))
            # churn small allocations while the collectives run
            junk = [torch.empty(int(torch.randint(1, 200, (1,), generator=gen))) for _ in range(8)]
            del junk
        for kind, m, h in hs:
            out = h.wait()
            if kind == "ag":
                assert out.numel() == n * m
            elif kind == "rs":
                assert torch.all(out == sum(range(1, n + 1))), out
        if variant in ("all", "p2p") and n > 1:
            x = torch.full((sizes[it % len(sizes)],), float(r))
            out = comm.permute(x, g, [(i, (i + 1) % n) for i in range(n)], r, axes=())
            assert torch.all(out == (r - 1) % n)
        keep = [torch.empty(3) for _ in range(4)]
    return len(keep)


def main():
    from fshard.testing import run_on_ranks, shutdown_pools

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--variant", default="all")
    ap.add_argument("--world", type=int, default=2, help="ranks (2 or 4)")
    a = ap.parse_args()
    fails, t0 = 0, time.time()
    for c in range(a.calls):
        try:
            run_on_ranks(body, a.iters, a.variant, c, world_size=a.world, timeout_s=600)
        except Exception as e:  # noqa: BLE001
            fails += 1
            print(f"[{c}] FAILED: {''.join(traceback.format_exception_only(type(e), e))[:3000]}", flush=True)
        print(f"{c + 1} calls x {a.iters} iters, {fails} failures, {time.time() - t0:.0f}s", flush=True)
    shutdown_pools()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()

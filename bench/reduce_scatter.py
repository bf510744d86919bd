"""gloo reduce-scatter: gloo's own (all-reduce + slice) vs all-to-all + local sum vs a ring.

    python bench/reduce_scatter.py [--world-size 2] [--rounds 9] [--iters 5]

Per call, on each rank, a sum reduce-scatter of a float32 input of 0.5, 2.7 and 8 MiB:

- ``gloo``: ``reduce_scatter_tensor`` as torch's gloo backend runs it (clone, all-reduce
  of the whole input, slice): ``2(n-1)/n`` of the input on the wire per rank.
- ``a2a``: ``fs.comm.reduce_scatter_async`` (``all_to_all_single`` + a local sum of the
  ``n`` received chunks): ``(n-1)/n`` on the wire.
- ``ring``: ``n-1`` steps of point-to-point send/recv with the next/previous rank, adding
  one chunk per step: ``(n-1)/n`` on the wire, ``n-1`` sequential latencies.

The variants run interleaved (round by round, a barrier before each), and the table gives
the median over rounds of each one's mean time per call (rank 0), and the median of the
per-round ratios to ``gloo``. The results are checked against each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs
from fshard import comm

_F = torch.ops._c10d_functional
MIB = 2**20


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _gloo(x, group, n):
    return _F.wait_tensor(_F.reduce_scatter_tensor(x, "sum", n, group.group_name))


def _a2a(x, group, n):
    return comm.reduce_scatter_async(x, group, n).wait()


def _ring(x, group, n):
    me = dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    chunks = x.chunk(n)
    send = chunks[(me - 1) % n]
    recv = torch.empty_like(send)
    for s in range(n - 1):
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                       dist.P2POp(dist.irecv, recv, prv, group)])
        for r in reqs:
            r.wait()
        send = recv + chunks[(me - s - 2) % n]  # a new buffer: the next send must not alias recv
    return send


VARIANTS = {"gloo": _gloo, "a2a": _a2a, "ring": _ring}


def per_rank(sizes_mib, rounds, iters):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"x": n})
    group = mesh.group("x")
    rows = []
    for mib in sizes_mib:
        numel = int(mib * MIB / 4) // n * n
        x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
        outs = {k: f(x, group, n) for k, f in VARIANTS.items()}
        err = max((outs[k] - outs["gloo"]).abs().max().item() for k in outs)
        for f in VARIANTS.values():  # warm-up
            f(x, group, n)
        times = {k: [] for k in VARIANTS}
        for _ in range(rounds):
            for k, f in VARIANTS.items():
                dist.barrier(group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    f(x, group, n)
                times[k].append((time.perf_counter() - t0) / iters)
        with comm.comm_log() as log:
            _a2a(x, group, n)
        with comm.comm_log() as old:
            _gloo(x, group, n)
        ratios = {k: statistics.median(t / g for t, g in zip(times[k], times["gloo"])) for k in VARIANTS}
        rows.append((mib, numel * 4, {k: statistics.median(v) for k, v in times.items()}, ratios, err,
                     old.wire["psum_scatter"], log.wire["psum_scatter"]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.7, 8.0])
    args = ap.parse_args()
    rows = fs.run_local(per_rank, args.sizes, args.rounds, args.iters, world_size=args.world_size)[0]
    print(f"world size {args.world_size}, gloo, float32 sum reduce-scatter; median over {args.rounds} rounds "
          f"of {args.iters} calls (rank 0)")
    print(f"{'MiB':>5} {'gloo ms':>8} {'a2a ms':>8} {'ring ms':>8} {'a2a/gloo':>9} {'ring/gloo':>9} "
          f"{'wire gloo B':>12} {'wire a2a B':>11} {'max diff':>9}")
    for mib, _, t, r, err, w_old, w_new in rows:
        print(f"{mib:>5} {t['gloo'] * 1e3:>8.2f} {t['a2a'] * 1e3:>8.2f} {t['ring'] * 1e3:>8.2f} "
              f"{r['a2a']:>9.2f} {r['ring']:>9.2f} {w_old:>12} {w_new:>11} {err:>9.1e}")


if __name__ == "__main__":
    main()

"""Overhead of fshard's collectives vs calling torch.distributed directly (same sizes, same run).

    python bench/collectives.py [--world-size 2] [--iters 200]

Each rank runs, inside one shard_map body (unchecked and checked), a loop of
fs.lax.{psum, all_gather, psum_scatter, all_to_all} and the same collective through
torch.distributed's c10d API (``dist.all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``) on the same tensor sizes, and reports
the median time per call and the ratio fshard / torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs
from fshard import P


# torch 2.13 renamed these; take whichever this torch has.
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time(fn, iters):
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def per_rank(iters, sizes):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"x": n})
    g = mesh.group("x")
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        out_ag = torch.empty(numel * n)
        out_rs = torch.empty(numel // n)
        out_a2a = torch.empty(numel)
        native = {
            "psum": lambda: dist.all_reduce(x.clone(), group=g),
            "all_gather": lambda: _ag(out_ag, x, group=g),
            "psum_scatter": lambda: _rs(out_rs, x, group=g),
            "all_to_all": lambda: dist.all_to_all_single(out_a2a, x, group=g),
        }
        ours = {
            "psum": lambda: fs.lax.psum(x, "x"),
            "all_gather": lambda: fs.lax.all_gather(x, "x", tiled=True),
            "psum_scatter": lambda: fs.lax.psum_scatter(x, "x", tiled=True),
            "all_to_all": lambda: fs.lax.all_to_all(x, "x", 0, 0, tiled=True),
        }
        for check in (False, True):
            def body(_):
                res = {}
                for k in native:
                    t_native = _time(native[k], iters)
                    t_ours = _time(ours[k], iters)
                    res[k] = (t_native, t_ours)
                return torch.zeros(1), res
            f = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(), None), check=check)
            _, res = f(torch.zeros(1))
            for k, (tn, to) in res.items():
                rows.append((numel * 4, k, check, tn, to))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    sizes = [1024, 256 * 1024, 4 * 1024 * 1024 // 4]
    rows = fs.run_local(per_rank, args.iters, sizes, world_size=args.world_size)[0]
    print(f"world size {args.world_size}, gloo, median of {args.iters} calls")
    print(f"{'bytes':>10} {'collective':>13} {'mode':>9} {'torch us':>10} {'fshard us':>10} {'ratio':>6}")
    for nbytes, k, check, tn, to in rows:
        print(f"{nbytes:>10} {k:>13} {'checked' if check else 'unchecked':>9} {tn * 1e6:>10.1f} {to * 1e6:>10.1f} {to / tn:>6.2f}")


if __name__ == "__main__":
    main()

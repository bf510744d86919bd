"""What ``FSHARD_CHECK_COLLECTIVES=1`` costs per collective (``python bench/check_collectives.py``).

Two gloo ranks (``fs.run_local``) time ``fs.comm.all_reduce`` (psum) and
``fs.comm.all_gather`` of a 4 KiB and a 1 MiB float32 tensor, with the header check off
and on, interleaved (off, on, off, on, ...) in the same processes so that the machine's
load hits both sides alike. Prints the median microseconds per call of each side and the
difference, which is the header exchange (one all-gather of 3 int64 per collective) plus
the caller's frame walk. See bench/README.md.
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

SIZES = {"4KiB": 1024, "1MiB": 256 * 1024}


def _time(fn, calls: int) -> float:
    """Microseconds per call of ``fn`` (ranks start together)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _rank(calls: int, rounds: int) -> dict:
    group = dist.group.WORLD
    n = dist.get_world_size()
    out: dict = {}
    for name, numel in SIZES.items():
        x = torch.randn(numel)
        ops = {"psum": lambda: comm.all_reduce(x, group, "sum", axes=("x",)),
               "all_gather": lambda: comm.all_gather(x, group, n, axes=("x",))}
        for op, fn in ops.items():
            fn()  # warm-up (connections, allocations)
            for _ in range(rounds):
                for flag in ("0", "1"):
                    os.environ["FSHARD_CHECK_COLLECTIVES"] = flag
                    out.setdefault((op, name, flag), []).append(_time(fn, calls))
    os.environ["FSHARD_CHECK_COLLECTIVES"] = "0"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="collectives per timed block")
    ap.add_argument("--rounds", type=int, default=5, help="off/on pairs per size and op")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f}, 2 gloo ranks, {args.rounds} x {args.calls} calls per side")
    res = fs.run_local(_rank, args.calls, args.rounds, world_size=2, timeout_s=900)[0]
    print(f"{'op':<11} {'size':<5} {'off us':>8} {'on us':>8} {'on-off':>8} {'on/off':>7}")
    for op in ("psum", "all_gather"):
        for name in SIZES:
            off, on = statistics.median(res[(op, name, "0")]), statistics.median(res[(op, name, "1")])
            print(f"{op:<11} {name:<5} {off:8.1f} {on:8.1f} {on - off:8.1f} {on / off:7.2f}")


if __name__ == "__main__":
    main()

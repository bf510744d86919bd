"""What checked mode costs per op on a tiny body (``python bench/checked_mode.py``).

One process, a mesh of one rank, ``torch.set_num_threads(1)``: ``value_and_grad`` of a
``shard_map`` body of ``--layers`` small matmul layers (``tanh(h @ w) + h / 2``, centred),
built twice, with ``check=True`` and ``check=False``, and called interleaved (checked,
unchecked, checked, ...) so that the machine's load hits both alike. Each call is timed in
the thread's CPU time; the printed figure per side is the 10th percentile of ``--steps``
calls (the least disturbed), and their difference is checked mode's extra host time: the
type rule's work per op, which a body of tiny ops makes visible. See bench/README.md,
"Checked mode's type rule by schema (issue 29), before and after".
"""

from __future__ import annotations

import argparse
import time

import torch

import fshard as fs
from fshard import P


def measure(layers: int, dim: int, batch: int, steps: int, warmup: int = 5) -> dict[bool, float]:
    """Seconds of thread CPU time per call, checked (``True``) and unchecked (``False``).

    Args:
      layers: matmul layers in the body.
      dim: each layer's weight is ``dim x dim``.
      batch: rows of the input.
      steps: timed calls of each side (interleaved).
      warmup: untimed calls of each side first.

    Returns:
      The 10th percentile of each side's call times, in seconds.
    """
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"dp": 1})
    torch.manual_seed(0)
    weights = [torch.randn(dim, dim) for _ in range(layers)]
    x = torch.randn(batch, dim)

    def loss(weights, x):
        h = x
        for w in weights:
            h = torch.tanh(h @ w) + h * 0.5
            h = h - h.mean(-1, keepdim=True)
        return fs.lax.pmean((h**2).mean(), "dp")

    sides = {
        check: fs.shard_map(
            fs.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), check=check
        )
        for check in (True, False)
    }
    for step in sides.values():
        for _ in range(warmup):
            step(weights, x)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for check, step in sides.items():
            t0 = time.thread_time()
            step(weights, x)
            times[check].append(time.thread_time() - t0)
    return {check: sorted(ts)[len(ts) // 10] for check, ts in times.items()}


def main(argv: list[str] | None = None) -> dict[bool, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="matmul layers in the body (default 8)")
    ap.add_argument("--dim", type=int, default=64, help="width of each layer (default 64)")
    ap.add_argument("--batch", type=int, default=16, help="rows of the input (default 16)")
    ap.add_argument("--steps", type=int, default=200, help="timed calls of each side (default 200)")
    args = ap.parse_args(argv)
    q = measure(args.layers, args.dim, args.batch, args.steps)
    print(f"checked {q[True] * 1e3:.3f} ms unchecked {q[False] * 1e3:.3f} ms extra {(q[True] - q[False]) * 1e3:.3f} ms")
    return q


if __name__ == "__main__":
    main()

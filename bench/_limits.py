"""The physical limit of a bench row: the step's compute alone plus its minimal bytes on the wire.

Used by ``bench/fsdp.py``, ``bench/ddp.py``, ``bench/tp.py``, ``bench/pp.py`` (compute and
wire) and ``bench/overhead.py`` (compute only), inside the same run as the sides they time:

- **compute**: a per-rank step without any collective (the same model's forward, backward
  and optimizer on one rank's local batch and local parameter shapes), *measured*: every
  rank times it at once, on the same cores as the timed sides, and the slowest rank's
  median counts (a step lasts as long as its slowest rank). fsdp/ddp and tp run it as one
  more side in their timed rounds (it issues no collective), and pp times its stages once
  per round, so machine noise hits it as it hits the sides. With more ranks than cores
  the ranks share cores while they measure, so the measured figure already contains the
  sharing (about the one-rank compute x ranks / cores); no factor is applied on top.
- **wire**: the minimal bytes a rank sends in one step (ring algorithms) divided by the link
  rate measured in the same processes on the same gloo group: a large all-reduce, whose
  ring sends ``2 (n - 1) / n`` of its payload per rank.
- the limit is ``compute + wire`` (no overlap) and ``max(compute, wire)`` (perfect overlap);
  each side's measured step is reported as a fraction of both.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import attrs
import torch
import torch.distributed as dist


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def median_seconds(fn: Callable[[], object], steps: int = 5, warmup: int = 2) -> float:
    """Median wall seconds of ``fn()`` over ``steps`` calls after ``warmup`` (local: no collective)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slowest(seconds: float, group=None) -> float:
    """The largest of every rank's ``seconds`` (collective: every rank of ``group`` calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def link_rate(group=None, nbytes: int = 8 * 2**20, iters: int = 5) -> float:
    """Bytes per second one rank sends in a ring all-reduce of ``nbytes`` on ``group``.

    Collective: every rank of ``group`` calls it. The median of ``iters`` all-reduces (after
    one warm-up), each timed from a barrier to the slowest rank's end; the ring sends
    ``2 (n - 1) / n * nbytes`` per rank. One rank sends nothing: ``inf``.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return float("inf")
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x, group=group)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(slowest(time.perf_counter() - t0, group))
    return 2 * (n - 1) / n * (nbytes // 4 * 4) / statistics.median(times)


def ring_sent(kind: str, payload: int, n: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` input bytes on ``n`` ranks (ring).

    Args:
      kind: ``psum`` / ``all_reduce`` (2 (n-1)/n of the payload), ``all_gather`` (the input
        is the shard: (n-1) x it), ``psum_scatter`` / ``reduce_scatter`` ((n-1)/n of the
        input), ``send`` (point to point: the payload).

    Raises:
      ValueError: another kind.
    """
    factor = {
        "psum": 2 * (n - 1) / n,
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": n - 1,
        "psum_scatter": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "send": 1,
    }.get(kind)
    if factor is None:
        raise ValueError(
            f"ring_sent: kind {kind!r} is not one of psum, all_reduce, all_gather, psum_scatter, reduce_scatter, send."
        )
    return factor * payload


@attrs.frozen
class Limit:
    """One step's physical limit: measured compute seconds, minimal bytes sent per rank and the
    measured link rate (bytes/s per rank), with ``ranks`` ranks on ``cores`` cores."""

    compute_s: float
    sent_bytes: float = 0.0
    rate: float = float("inf")
    ranks: int = 1
    cores: int = 1

    @property
    def wire_s(self) -> float:
        return self.sent_bytes / self.rate if self.sent_bytes else 0.0

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.wire_s

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, self.wire_s)

    def line(self, measured: dict[str, float]) -> str:
        """``physical limit: ...`` and, per side, its step seconds as ``x.xx of the limit``
        (no overlap, then perfect overlap)."""
        share = f"{self.ranks} ranks on {self.cores} cores" + (
            " (they share cores: measured sharing)" if self.ranks > self.cores else ""
        )
        head = f"physical limit: compute {self.compute_s * 1e3:.1f} ms ({share})"
        if self.sent_bytes:
            head += (
                f" + wire {self.sent_bytes / 2**20:.2f} MiB at {self.rate / 2**20:.0f} MiB/s = "
                f"{self.wire_s * 1e3:.1f} ms -> {self.serial_s * 1e3:.1f} ms no overlap, "
                f"{self.overlap_s * 1e3:.1f} ms perfect overlap"
            )
        sides = "; ".join(
            f"{k} {t / self.serial_s:.2f}" + (f" / {t / self.overlap_s:.2f}" if self.sent_bytes else "")
            for k, t in measured.items()
        )
        return head + f"; of the limit{' (no overlap / overlap)' if self.sent_bytes else ''}: {sides}"

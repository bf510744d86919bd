"""Where a step's time goes: torch.profiler's CPU events of one thread, by kind.

Used by ``bench/jit_step.py --profile`` and ``bench/overhead.py --breakdown`` to show, for a
missed target, what each side spends its step on. Only the calling thread is read: with one
thread per rank that is where compute, the collectives' launches and their waits happen
(gloo's own worker threads move the bytes, and are not profiled).

The kinds, by op name (an op's *self* time, so nested ops are not counted twice):
  matrix products     aten::mm / addmm / bmm / baddbmm (the same kernels on every side)
  attention           scaled_dot_product_* (fused attention)
  collective wait     ops that block until a collective ends (``wait_tensor``, ``c10d::wait``)
  collective launch   c10d / gloo / _c10d_functional ops that start one
  compiled kernels    the self time of Inductor's "## Call CompiledFxGraph" ranges: its C++
                      kernels (the fused elementwise work, and the optimizer under fs.jit),
                      which emit no event of their own, and the wrapper's Python
  eager optimizer     the ops under ``Optimizer.step`` (torch's foreach or fused AdamW)
  other aten ops      every other recorded op: elementwise, reductions, copies, views
  host                the step's wall time less all the above: Python, dispatch, guards
"""

from __future__ import annotations

import collections
import os
import re
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = ("matrix products", "attention", "compiled kernels", "eager optimizer", "other aten ops",
         "collective wait", "collective launch", "host")

_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def kind(name: str) -> str:
    """The kind of one profiler event, by its name."""
    if name in _MATMUL:
        return "matrix products"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    low = name.lower()
    if "wait" in low and ("c10d" in low or "tensor" in low or "work" in low):
        return "collective wait"
    if any(s in low for s in ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather",
                              "reduce_scatter", "all_to_all", "alltoall", "broadcast")):
        return "collective launch"
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled kernels"
    if re.match(r"[a-z_][a-z0-9_]*::", name):  # an operator (aten::, fshard::); ranges are "FSDP::..."
        return "other aten ops"
    return "host"  # record_function ranges (FSDP::..., Torch-Compiled Region): their self time is Python


def _in_optimizer(e) -> bool:
    while e is not None:
        if e.name.startswith("Optimizer.step#"):
            return True
        e = e.cpu_parent
    return False


def breakdown(step: Callable[[], object], n: int) -> dict[str, float]:
    """Seconds per step by kind over ``n`` profiled calls of ``step`` (the calling thread).

    Returns:
        ``{kind: seconds per step}`` for every kind in ``KINDS``, plus ``"step"`` (wall time
        per step under the profiler, which adds a few percent) and ``"thread CPU"`` (this
        thread's CPU time per step: below the wall time by what other processes took, or
        what the thread waited).
    """
    import threading
    import time

    tid = threading.get_native_id()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    per: dict[str, float] = collections.defaultdict(float)
    threads = collections.Counter()
    for e in prof.events():
        threads[e.thread] += e.self_cpu_time_total
    # The profiler's thread ids are not always the OS's: fall back to the busiest thread.
    main = tid if tid in threads else threads.most_common(1)[0][0]
    for e in prof.events():
        if e.thread == main:
            k = kind(e.name)
            if k in ("other aten ops", "host") and _in_optimizer(e):
                k = "eager optimizer"
            per[k] += e.self_cpu_time_total * 1e-6
    if os.environ.get("FSHARD_BREAKDOWN_TOP"):  # which names went where: checking the kinds
        top = collections.Counter()
        for e in prof.events():
            if e.thread == main:
                top[e.name] += e.self_cpu_time_total * 1e-3 / n
        for name, ms in top.most_common(int(os.environ["FSHARD_BREAKDOWN_TOP"])):
            print(f"  {ms:8.2f} ms  {kind(name):<18} {name}")
    out = {k: per.get(k, 0.0) / n for k in KINDS}
    recorded = sum(per.values()) - per.get("host", 0.0)
    out["host"] = max(wall - recorded, 0.0) / n
    out["step"] = wall / n
    out["thread CPU"] = cpu / n
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    """A text table: one column per side, one row per kind, in ms per step."""
    sides = list(rows)
    width = max(12, *(len(s) for s in sides))
    lines = [f"{'ms per step':<20}" + "".join(f"{s:>{width + 2}}" for s in sides)]
    for k in (*KINDS, "step", "thread CPU"):
        lines.append(f"{k:<20}" + "".join(f"{rows[s][k] * 1e3:>{width + 2}.1f}" for s in sides))
    return "\n".join(lines)

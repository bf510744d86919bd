"""Where a step's time goes: torch.profiler's CPU events of one thread, by kind.

Used by ``bench/jit_step.py --profile`` and ``bench/overhead.py --breakdown`` to show, for a
missed target, what each side spends its step on. Only the calling thread is read (found by
a marker range it records): with one thread per rank on CPU that is where compute, the
collectives' launches and their waits happen (gloo's own worker threads move the bytes, and
are not profiled).

The kinds, by op name (an op's *self* time, so nested ops are not counted twice):
  matrix products     aten::mm / addmm / bmm / baddbmm (the same kernels on every side)
  attention           scaled_dot_product_* (fused attention)
  compiled kernels    the self time of Inductor's "## Call CompiledFxGraph" ranges: its C++
                      kernels (the fused elementwise work, and the optimizer under fs.jit),
                      which emit no event of their own, and the wrapper's Python
  eager optimizer     the ops under ``Optimizer.step`` (torch.optim's foreach or fused AdamW;
                      fs.optim's eager ops are not annotated and count as other aten ops)
  other aten ops      every other recorded operator: elementwise, reductions, copies, views
  collective wait     the operators that block until a collective ends (``wait_tensor``)
  collective launch   c10d / _c10d_functional / gloo / nccl operators that start one
  off core, unrecorded  an upper bound on the wall time the thread spent off its core
                      outside the recorded waits (wall - thread CPU - collective wait, at most
                      what no event recorded): ``Work.wait()``, which DDP and fully_shard call
                      and which records no event, and other processes' time slices (an op
                      descheduled mid-way counts in its own kind and here too)
  host                the rest of the wall time no event recorded, a lower bound: Python,
                      dispatch, guards, the autograd engine's own work
"""

from __future__ import annotations

import collections
import os
import re
import time
from typing import Callable

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

KINDS = ("matrix products", "attention", "compiled kernels", "eager optimizer", "other aten ops",
         "collective wait", "collective launch", "off core, unrecorded", "host")

_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
_COLLECTIVE_NS = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")
_MARKER = "fshard.breakdown.marker"


def kind(name: str) -> str:
    """The kind of one profiler event, by its name (``"host"`` for ranges and engine work)."""
    if name.startswith("## Call CompiledFxGraph"):  # first: its hash could spell anything
        return "compiled kernels"
    if name in _MATMUL:
        return "matrix products"
    if name.startswith("aten::") and ("scaled_dot_product" in name or "flash_attention" in name):
        return "attention"
    if name.startswith(_COLLECTIVE_NS):
        return "collective wait" if "wait" in name else "collective launch"
    if re.match(r"[a-z_][a-z0-9_]*::", name) and not name.startswith("autograd::"):
        return "other aten ops"  # an operator (aten::, fshard::); ranges are "FSDP::...", "Optimizer..."
    return "host"  # record_function ranges, autograd::engine::evaluate_function: their self time is Python


def _in_optimizer(e) -> bool:
    while e is not None:
        if e.name.startswith("Optimizer.step#"):
            return True
        e = e.cpu_parent
    return False


def breakdown(step: Callable[[], object], n: int) -> dict[str, float]:
    """Seconds per step by kind over ``n`` profiled calls of ``step`` (the calling thread).

    Returns:
        ``{kind: seconds per step}`` for every kind in ``KINDS`` (they add up to the step),
        plus ``"step"`` (wall time per step under the profiler, which adds a few percent) and
        ``"thread CPU"`` (this thread's CPU time per step).
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(_MARKER):  # the profiler's thread ids are its own: find ours by this
            pass
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    events = prof.events()
    main = next(e.thread for e in events if e.name == _MARKER)
    per: dict[str, float] = collections.defaultdict(float)
    top: collections.Counter = collections.Counter()
    for e in events:
        if e.thread != main or e.name == _MARKER:
            continue
        k = kind(e.name)
        if k in ("other aten ops", "host") and _in_optimizer(e):
            k = "eager optimizer"
        per[k] += e.self_cpu_time_total * 1e-6
        top[e.name] += e.self_cpu_time_total * 1e-3 / n
    if os.environ.get("FSHARD_BREAKDOWN_TOP"):  # which names went where: checking the kinds
        for name, ms in top.most_common(int(os.environ["FSHARD_BREAKDOWN_TOP"])):
            print(f"  {ms:8.2f} ms  {kind(name):<18} {name}")
    per.pop("host", None)  # ranges' self time is Python: counted in the remainder below
    unrecorded = max(wall - sum(per.values()), 0.0)
    off_core = max(wall - cpu - per.get("collective wait", 0.0), 0.0)
    per["off core, unrecorded"] = min(off_core, unrecorded)
    per["host"] = unrecorded - per["off core, unrecorded"]
    out = {k: per.get(k, 0.0) / n for k in KINDS}
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

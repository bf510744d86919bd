"""Measuring a real run next to its prediction: median step time and peak memory per rank.

:class:`StepProbe` wraps a train step ``step(params, opt_state, *batch) -> (params,
opt_state, ...)``. It profiles the memory of one step after the warm-up and leaves
the others alone:

- on CUDA, ``torch.cuda.max_memory_allocated`` over that step (everything allocated);
- on CPU, the bytes of the parameters and optimizer state handed to the step, plus the
  peak of the CPU memory allocated during the step that is alive at once, from
  ``torch.profiler``'s allocation events (``profile_memory=True``: every allocation the
  step's thread makes, gloo's staging buffers included; Python objects are not counted).

  The profiler records a free only when the thread that frees has profiling on: a
  tensor whose last reference a gloo worker thread drops (a collective's input, held by
  its work object) is never seen freed, and the profiler's own running total stays too
  high by that tensor from then on, by whole buffers at random from run to run (the
  same remat step's peak about doubled from one run to another; docs/plan.md, "Figures
  behind the planner's rules"). The probe therefore also watches,
  with a dispatch mode, when every storage an op creates dies, on whichever thread, and
  puts the missing frees back at that time (:func:`peak_from_events`); an allocation
  whose address is allocated again before any free was seen is freed at the latest then.

The profiled step is slower (the profiler records every op), so :meth:`summary` leaves
it out of the median step time.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fshard import tree as tree_util
from fshard.runtime import simulation

__all__ = ["StepProbe", "StorageWatch", "local_bytes", "peak_from_events"]


def local_bytes(*trees: Any) -> int:
    """Bytes of the distinct storages of the (local shards of the) tensors in ``trees``."""
    seen: dict[tuple, int] = {}
    for tree in trees:
        for x in tree_util.leaves(tree):
            if not isinstance(x, torch.Tensor):
                continue
            t = x.to_local() if hasattr(x, "to_local") else x
            st = t.untyped_storage()
            seen[(t.device.type, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


class StorageWatch(TorchDispatchMode):
    """Base of the dispatch modes that follow the CPU storages ops create until they die.

    For each plain CPU tensor an op returns, :meth:`born` is called; when it returns True,
    :meth:`died` is called once that tensor's Python object is gone. torch keeps a tensor's
    Python object as long as autograd or a collective holds the tensor, so this is when
    its memory is released, on whichever thread drops it (a gloo worker's, too). Both run
    under ``self.lock``. DTensor's own dispatch is not seen: only the plain tensors it
    computes with.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def born(self, t: torch.Tensor, key: int, args: tuple, kwargs: dict) -> bool:
        """A tensor ``t`` on the storage at address ``key``, returned by an op called with
        ``args`` / ``kwargs``; returns whether to call :meth:`died` when ``t`` dies."""
        raise NotImplementedError

    def died(self, key: int, now_ns: int) -> None:
        """A tensor on the storage at ``key`` died at ``now_ns`` (``time.time_ns()``)."""
        raise NotImplementedError

    def _release(self, key: int) -> None:
        now = time.time_ns()
        with self.lock:
            self.died(key, now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) is not torch.Tensor or t.device.type != "cpu":
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0:
                continue
            with self.lock:
                follow = self.born(t, key, args, kwargs)
            if follow:
                weakref.finalize(t, self._release, key)
        return out


class _StorageDeaths(StorageWatch):
    """When each storage that an op creates dies (the last tensor seen on it), on any thread:
    ``deaths[address]`` lists the times (``time.time_ns()``, the profiler's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}  # storage address -> tensors seen on it still alive
        self.deaths: dict[int, list[int]] = {}

    def born(self, t: torch.Tensor, key: int, args: tuple, kwargs: dict) -> bool:
        self.refs[key] = self.refs.get(key, 0) + 1
        return True

    def died(self, key: int, now_ns: int) -> None:
        n = self.refs.get(key, 0) - 1
        if n > 0:
            self.refs[key] = n
            return
        self.refs.pop(key, None)
        self.deaths.setdefault(key, []).append(now_ns)


def peak_from_events(
    allocations: Sequence[tuple[int, int, int]], deaths: dict[int, list[int]] | None = None
) -> tuple[int, int]:
    """The peak of bytes alive at once from allocation events, missing frees put back.

    Args:
      allocations: ``(time_ns, address, size)`` per event of one thread, a negative size
        for a free (``torch.profiler``'s CPU memory events).
      deaths: ``address -> [time_ns, ...]``: when storages at that address were seen to
        die (on any thread), for allocations whose free event is missing.

    Returns:
      ``(peak bytes, bytes never seen freed)`` over allocations made within the events
      (frees of older memory are ignored).
    """
    deaths = deaths or {}
    events = sorted(allocations)
    fixed: list[tuple[int, int]] = []  # (time, +-size), missing frees added
    live: dict[int, tuple[int, int]] = {}  # address -> (alloc time, size)

    def missing_free(addr: int, t_alloc: int, size: int, before: int | None) -> None:
        later = [d for d in deaths.get(addr, ()) if d >= t_alloc and (before is None or d <= before)]
        if later:
            fixed.append((min(later), -size))
        elif before is not None:  # the address came back: it was freed by then
            fixed.append((before, -size))

    for t, addr, size in events:
        if size > 0:
            if addr in live:
                missing_free(addr, *live.pop(addr), before=t)
            live[addr] = (t, size)
            fixed.append((t, size))
        elif addr in live:
            live.pop(addr)
            fixed.append((t, size))
    never = 0
    for addr, (t_alloc, size) in live.items():
        n = len(fixed)
        missing_free(addr, t_alloc, size, before=None)
        if len(fixed) == n:
            never += size
    # At equal times, frees first: a death seen at the time of the next allocation.
    fixed.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in fixed:
        cur += d
        peak = max(peak, cur)
    return peak, never


class StepProbe:
    """Wraps a train step to measure its peak memory once, after ``warmup`` steps.

    Args:
      warmup: steps left out of the measurements (optional, default 2).
    """

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.calls = 0
        self.profiled: int | None = None  # index of the profiled call
        self.peak_bytes: int | None = None
        self.never_freed_bytes: int = 0  # allocated in the profiled step, no free seen (CPU)

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def probed(params: Any, opt_state: Any, *rest: Any) -> Any:
            i = self.calls
            self.calls += 1
            if i != self.warmup or simulation.active() is not None:
                # Under fs.simulate one process holds every rank's blocks: no rank's peak to measure.
                return step(params, opt_state, *rest)
            self.profiled = i
            out, self.peak_bytes = self._measure(step, params, opt_state, *rest)
            return out

        return probed

    def _measure(self, step: Callable[..., Any], params: Any, opt_state: Any, *rest: Any) -> tuple[Any, int]:
        dev = next((x.device for x in tree_util.leaves(params) if isinstance(x, torch.Tensor)), torch.device("cpu"))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            out = step(params, opt_state, *rest)
            torch.cuda.synchronize(dev)
            return out, int(torch.cuda.max_memory_allocated(dev))
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        at_rest = local_bytes(params, opt_state)
        deaths = _StorageDeaths()
        # Kineto prints "profiler_start"/"profiler_stop" lines (stderr, every rank) unless its
        # log level is above them; it reads the variable when the first profile starts. The
        # user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with deaths:
                out = step(params, opt_state, *rest)
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == "cpu":
                    events.append((e.start_time_ns, f.ptr, f.alloc_size))
            stack.extend(e.children)
        peak, self.never_freed_bytes = peak_from_events(events, deaths.deaths)
        return out, at_rest + peak

    def summary(self, step_times: Sequence[float]) -> dict[str, float | None]:
        """``measured_step_s`` (median after the warm-up, the profiled step left out) and
        ``measured_peak_mib`` (None if no step was profiled)."""
        times = [t for i, t in enumerate(step_times) if i >= self.warmup and i != self.profiled]
        if not times:
            times = list(step_times[self.warmup :]) or list(step_times)
        return {
            "measured_step_s": statistics.median(times) if times else None,
            "measured_peak_mib": None if self.peak_bytes is None else self.peak_bytes / 2**20,
        }

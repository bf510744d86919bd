"""Measuring a real run next to its prediction: median step time and peak memory per rank.

:class:`StepProbe` wraps a train step ``step(params, opt_state, *batch) -> (params,
opt_state, ...)``. It profiles the memory of one step after the warm-up and leaves
the others alone:

- on CUDA, ``torch.cuda.max_memory_allocated`` over that step (everything allocated);
- on CPU, the bytes of the parameters and optimizer state handed to the step, plus the
  peak of ``torch.profiler``'s running total of CPU tensor memory allocated during the
  step (``profile_memory=True``; gloo's own buffers and Python objects are not tensors
  and are not counted, as in ``bench/data_parallel.py``).

The profiled step is slower (the profiler records every op), so :meth:`summary` leaves
it out of the median step time.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from fshard import tree as tree_util

__all__ = ["StepProbe", "local_bytes"]


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

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def probed(params: Any, opt_state: Any, *rest: Any) -> Any:
            i = self.calls
            self.calls += 1
            if i != self.warmup:
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
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step(params, opt_state, *rest)
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == "cpu":
                    events.append((e.start_time_ns, f.total_allocated, f.alloc_size))
            stack.extend(e.children)
        if not events:
            return out, at_rest
        events.sort()
        # The running total counts what was allocated since profiling began (frees of older
        # tensors are not seen): its value before the first event is the base.
        base = events[0][1] - events[0][2]
        return out, at_rest + max(0, max(total for _, total, _ in events) - base)

    def summary(self, step_times: Sequence[float]) -> dict[str, float | None]:
        """``measured_step_s`` (median after the warm-up, the profiled step left out) and
        ``measured_peak_mib`` (None if no step was profiled)."""
        times = [t for i, t in enumerate(step_times) if i >= self.warmup and i != self.profiled]
        if not times:
            times = list(step_times[self.warmup:]) or list(step_times)
        return {"measured_step_s": statistics.median(times) if times else None,
                "measured_peak_mib": None if self.peak_bytes is None else self.peak_bytes / 2**20}

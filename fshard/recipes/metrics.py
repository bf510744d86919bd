"""What a training run measures besides its loss: a windowed token rate, MFU, peak memory,
elapsed time and ETA, and the run's summary.

- :class:`Meter` turns each step's duration into the record's ``tokens_per_s`` (the rate over
  the last ``window`` steps, not one step's: one step's swings with the machine's load, a
  warm-up or a checkpoint), ``elapsed_s`` and ``eta_s``.
- :class:`MFU`: the model's FLOPs per token (the planner's count,
  ``fs.plan.estimate.model_flops``) over the machine's peak FLOP/s (the planner's machine
  file: a shipped GPU's datasheet figure, or this host's calibrated matrix-product rate on
  CPU). :func:`mfu_for` builds one from a machine file only: it never calibrates.
- :func:`peak_memory`: this rank's peak, ``torch.cuda.max_memory_allocated`` on a GPU, the
  process's peak resident set (``getrusage``) on CPU, labelled as such.
- :func:`summarize` and :func:`summary_table`: the run's final figures, as a record and as
  the table rank 0 prints.
"""

from __future__ import annotations

import collections
import math
import resource
import sys
import time
from typing import Any, Sequence

import attrs
import torch
import torch.distributed as dist

__all__ = ["MFU", "Meter", "mfu_for", "peak_memory", "summarize", "summary_table"]


@attrs.frozen
class MFU:
    """Model FLOPs utilisation: ``flops_per_token * tokens_per_s / peak_flops``.

    Attributes:
      flops_per_token: the model's training FLOPs per token (forward and backward, as
        published MFU figures count them: ``6 N`` plus attention, no recompute).
      peak_flops: the peak FLOP/s of all the run's ranks together.
      machine: the machine file's name, for the summary.
    """

    flops_per_token: float = attrs.field(validator=attrs.validators.gt(0))
    peak_flops: float = attrs.field(validator=attrs.validators.gt(0))
    machine: str = "?"

    def of(self, tokens_per_s: float) -> float:
        """The fraction of the peak that ``tokens_per_s`` (the global rate) reaches."""
        return self.flops_per_token * tokens_per_s / self.peak_flops


# What a run without a machine file says about MFU (no calibration on the default path).
NO_MACHINE = (
    "MFU: not measured (no machine file for this host): give --machine h100, a100 or a machine file, or run once "
    "with --mesh auto or --log-json, which calibrates this host and saves {path}"
)


def mfu_for(
    cfg: Any, seq_len: int, dtype: str, machine: str | None, world: int, moe: Any = None
) -> tuple[MFU | None, str]:
    """The :class:`MFU` of fshard's Transformer ``cfg`` on ``world`` ranks of a machine.

    The machine is ``machine`` (a shipped name or a file), else this host's saved machine
    file (``fs.plan.default_machine_path()``), else none: MFU needs a peak, and measuring
    one costs seconds that a default run should not pay. Every rank reads the same file.
    Under ``fs.simulate``: none (one process runs every rank's step); with ``moe``
    (``fs.recipes.MoE``): none (the FLOPs count is a dense MLP's).

    Returns:
      ``(mfu, line)``: the MFU (None without a machine, or without a FLOPs figure for
      ``dtype``) and one line saying what it is measured against or how to get it.

    Raises:
      fs.plan.DescriptionError: ``machine`` names neither a shipped machine nor a file.
    """
    from fshard import plan
    from fshard.plan.estimate import model_flops
    from fshard.runtime.simulation import active

    if active() is not None:  # N ranks' steps in one process: no machine's peak to hold them to
        return None, "MFU: not measured under fs.simulate (one process runs every rank)"
    if moe is not None:
        return None, "MFU: not measured with experts (fs.plan's FLOPs count is a dense MLP's)"
    path = plan.default_machine_path()
    if machine:
        found = plan.get_machine(machine)
    elif path.exists():
        found = plan.load_machine(path)
    else:
        return None, NO_MACHINE.format(path=path)
    if dtype not in found.flops:
        return None, f"MFU: not measured: machine {found.name!r} has no {dtype} FLOPs figure ({sorted(found.flops)})"
    # Shapes only: the FLOP count needs the layers' sizes, not their kernels' timings.
    per_token = model_flops(plan.describe_transformer(cfg, seq_len=seq_len, dtype=dtype, device="meta")) / seq_len
    # On CPU the calibrated rate is shared by the ranks on one host's cores (share()).
    per_rank = found.flops[dtype] * found.share(min(world, found.devices_per_node))
    mfu = MFU(per_token, per_rank * world, found.name)
    return (
        mfu,
        f"MFU against {_flops(mfu.peak_flops)} ({world} x {found.name}, {dtype}; {_flops(per_token, 'FLOP')}/token)",
    )


def _flops(x: float, unit: str = "FLOP/s") -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def peak_memory(device: torch.device) -> tuple[float, str]:
    """This rank's peak memory so far, in MiB, and what it measures: ``"cuda"`` (the
    allocator's peak on ``device``) or ``"rss"`` (the process's peak resident set on CPU,
    which includes the interpreter and torch itself)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "rss"


class Meter:
    """Times a run's steps: the windowed token rate, elapsed time and ETA of each record.

    Args:
      window: the rate and the ETA are over the last this many steps.
      end: the run's last step (for the ETA).
    """

    def __init__(self, window: int, end: int) -> None:
        self.end = end
        self.t0 = time.perf_counter()
        # (tokens, seconds in the step): the rate counts the steps' own time, so that a
        # validation or a checkpoint between steps does not lower it.
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=max(1, window))
        # The wall clock at each step's end: the ETA counts everything a step costs.
        self.ends: collections.deque[float] = collections.deque([self.t0], maxlen=max(1, window) + 1)

    def step(self, step: int, tokens: int, seconds: float) -> dict[str, float]:
        """The timing fields of step ``step``'s record (``step`` 1-based)."""
        now = time.perf_counter()
        self.steps.append((tokens, seconds))
        self.ends.append(now)
        rate = sum(n for n, _ in self.steps) / max(sum(s for _, s in self.steps), 1e-12)
        per_step = (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)
        return {"tokens_per_s": rate, "elapsed_s": now - self.t0, "eta_s": per_step * max(0, self.end - step)}


def summarize(
    records: Sequence[dict[str, Any]], tokens_per_step: int, mfu: MFU | None, device: torch.device, elapsed_s: float
) -> dict[str, Any]:
    """The run's final figures (a ``"kind": "summary"`` log record).

    ``tokens_per_s`` is the mean rate over the run's steps after the first (the first
    also warms up: allocations, a compilation); ``mfu`` is of that rate; ``peak_mem_mib``
    is this rank's (``peak_mem_kind``: see :func:`peak_memory`).
    """
    ran = [r for r in records if "skipped" not in r]
    timed = ran[1:] or ran
    rate = len(timed) * tokens_per_step / max(sum(r["step_time_s"] for r in timed), 1e-12) if timed else None
    vals = [(r["val_loss"], r["step"]) for r in records if r.get("val_loss") is not None]
    best = min(vals) if vals else (None, None)
    mem, kind = peak_memory(device)
    return {
        "steps": len(records),
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "final_val_loss": vals[-1][0] if vals else None,
        "best_val_loss": best[0],
        "best_val_step": best[1],
        "tokens_per_s": rate,
        "mfu": None if mfu is None or rate is None else mfu.of(rate),
        "mfu_peak_flops": None if mfu is None else mfu.peak_flops,
        "peak_mem_mib": mem,
        "peak_mem_kind": kind,
        "elapsed_s": elapsed_s,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
    }


MEMORY_KINDS = {"cuda": "torch.cuda.max_memory_allocated", "rss": "process peak RSS"}


def summary_table(s: dict[str, Any]) -> str:
    """The summary as a small table (rank 0 prints it at the end of a run)."""

    def num(x: float | None, spec: str) -> str:
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)

    rows = [
        ("steps", f"{s['first_step']}-{s['last_step']} ({s['steps']} run)" if s["steps"] else "none run"),
        ("loss", f"{num(s['first_loss'], '.4f')} -> {num(s['final_loss'], '.4f')}"),
        (
            "val loss",
            "not measured (--val-every)"
            if s["final_val_loss"] is None
            else f"final {s['final_val_loss']:.4f}, best {s['best_val_loss']:.4f} (step {s['best_val_step']})",
        ),
        ("tokens/s", f"{num(s['tokens_per_s'], ',.0f')} (mean after the first step)"),
        (
            "MFU",
            "not measured (it needs the machine's peak: --machine)"
            if s["mfu"] is None
            else f"{s['mfu']:.2%} of {_flops(s['mfu_peak_flops'])}",
        ),
        ("peak memory", f"{s['peak_mem_mib']:,.1f} MiB (rank {s['rank']}, {MEMORY_KINDS[s['peak_mem_kind']]})"),
        ("elapsed", clock(s["elapsed_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def clock(seconds: float | None) -> str:
    """``seconds`` as ``h:mm:ss`` (``m:ss`` under an hour)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"

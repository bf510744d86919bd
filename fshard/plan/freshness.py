"""Whether a stored calibration still describes this machine as it is now.

:func:`fshard.plan.calibrate` records in the machine file what it ran under
(:func:`conditions`: torch and fshard versions, core counts, the load averages before and
after, the time). A stored calibration is reused only when the versions and core counts
match and the load the calibration ran beside is within :data:`LOAD_BAND` of the load now
(:func:`stale` says which field differs, and the fix). A calibration that ran beside other
work (:data:`LOADED_PER_CORE`) is marked ``under_load``: it is not reused on a quiet
machine.

The load is measured where the host counts its busy CPU time (Linux ``/proc/stat``): the
other processes' CPU per core during the calibration (its own ranks' CPU time left out) and,
when a file is reused, over a short sample (:data:`SAMPLE_S`). The 1-minute load average,
which lags by a minute (right after a job ends it still reads it), is the fallback
elsewhere, less what the caller's own ranks add to it (:func:`own_load`).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping

__all__ = ["LOADED_PER_CORE", "LOAD_BAND", "busy_seconds", "conditions", "load_per_core", "own_load", "stale"]

# Other work per core (1-minute load average) above which a calibration counts as made under
# load. Issue 37's runs: a quiet 2-core machine read 0.5-0.9 (0.25-0.45 per core); with one
# other 2-rank job it reads about 2 (1 per core), and that calibration predicted +424-637 %.
LOADED_PER_CORE = 0.5

# How far (other work per core) the load now may be from the calibration's for the file to be
# reused: the gap between those quiet readings and one other job's, so that a file made
# beside another job is not reused on a quiet machine and the other way round.
LOAD_BAND = 0.5

# Linux's 1-minute load average is an exponential average with this time constant (s).
_LOAD_TAU_S = 60.0

_IMPORTED = time.time()


def _cores() -> tuple[int, int]:
    """``(os.cpu_count(), the cores this process may run on)``."""
    total = os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = total
    return total, allowed


def _loadavg() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _process_age_s() -> float:
    """Seconds since this process started (Linux: ``/proc``), else since this module was imported."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def own_load(ranks: int, seconds: float) -> float:
    """What ``ranks`` busy processes running for ``seconds`` add to the 1-minute load average
    (at most: a rank waiting in a collective does not count)."""
    return ranks * (1.0 - math.exp(-max(0.0, seconds) / _LOAD_TAU_S))


def load_per_core(ranks: int = 1, *, seconds: float | None = None) -> float | None:
    """The other work per core now: the 1-minute load average less what this run's ``ranks``
    on this host add (:func:`own_load`, over ``seconds``, default this process's age), over
    ``os.cpu_count()``; None where the platform has no load average."""
    load = _loadavg()
    if load is None:
        return None
    age = _process_age_s() if seconds is None else seconds
    return max(0.0, load - own_load(ranks, age)) / _cores()[0]


def busy_seconds() -> float | None:
    """CPU seconds this host's cores have been busy since boot (Linux ``/proc/stat``: every
    state but idle and iowait), or None where there is no such counter."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# How long :func:`stale` watches the host's busy time to read the other work now.
SAMPLE_S = 0.5


def _sampled_per_core() -> float | None:
    """Other processes' CPU per core over the next :data:`SAMPLE_S` seconds (the host's busy
    time less this process's), or None where the host has no busy-time counter. Unlike the
    load average it does not lag: a job that ended a minute ago no longer counts."""
    b0, c0, t0 = busy_seconds(), time.process_time(), time.monotonic()
    if b0 is None:
        return None
    time.sleep(SAMPLE_S)
    b1, c1, dt = busy_seconds(), time.process_time(), time.monotonic() - t0
    if b1 is None or dt <= 0:
        return None
    return max(0.0, (b1 - b0) - (c1 - c0)) / dt / _cores()[0]


def conditions(
    *, ranks: int, load_before: float | None, started: float, others_cpu_s: float | None = None
) -> dict[str, Any]:
    """What a calibration ran under, for its machine file (call it when the calibration ends).

    Args:
      ranks: the calibration's ranks on this host.
      load_before: the 1-minute load average when it started (``os.getloadavg()[0]``; None:
        unknown).
      started: ``time.time()`` when it started.
      others_cpu_s: CPU seconds other processes spent on this host meanwhile (measured from
        :func:`busy_seconds`; None: judged from the load averages instead, which lag).

    Returns:
      ``torch``, ``fshard`` (versions), ``cpu_count``, ``affinity_cores``, ``load_before``,
      ``load_after``, ``others_per_core`` (the other work per core it ran beside: the larger of
      the load before and the load after less its own ranks'), ``under_load`` (that above
      :data:`LOADED_PER_CORE`), ``ranks``, ``time`` (epoch seconds at the end) and ``duration_s``.
    """
    import torch

    from fshard._version import __version__

    total, allowed = _cores()
    now = time.time()
    after = _loadavg()
    others = None
    if others_cpu_s is not None and now - started > 0:
        # Measured: the other processes' CPU time over the calibration, per core. The load
        # average lags by a minute: right after another job ends it still reads that job.
        others = others_cpu_s / (now - started) / total
    elif load_before is not None and after is not None:
        others = max(load_before, after - own_load(ranks, now - started), 0.0) / total
    return {
        "torch": torch.__version__,
        "fshard": __version__,
        "cpu_count": total,
        "affinity_cores": allowed,
        "load_before": load_before,
        "load_after": after,
        "others_per_core": others,
        "under_load": others is not None and others > LOADED_PER_CORE,
        "ranks": ranks,
        "time": now,
        "duration_s": now - started,
    }


FIX = "measure again: --recalibrate (python -m fshard.plan --machine local --recalibrate) or fs.plan.calibrate(mesh)"


def stale(recorded: Mapping[str, Any], path: Any, *, ranks: int = 1, load: float | None = None) -> str | None:
    """Why the calibration that recorded ``recorded`` (a machine's ``conditions``) should not be
    reused on this machine now, or None when it may.

    Args:
      recorded: the machine file's ``conditions`` (empty: a file older than the field).
      path: the file, for the message.
      ranks: this run's ranks on this host (their own share of the load is left out).
      load: other work per core now (optional; default: measured over :data:`SAMPLE_S`
        from the host's busy time, else :func:`load_per_core` from the load average).

    Returns:
      One sentence naming the file, the field that differs (recorded and now) and the fix.
    """
    import torch

    from fshard._version import __version__

    where = f"machine file {path}"
    if not recorded:
        return f"{where} records no calibration conditions (written before fshard recorded them): unknown; {FIX}"
    total, allowed = _cores()
    now = {"torch": torch.__version__, "fshard": __version__, "cpu_count": total, "affinity_cores": allowed}
    for key, value in now.items():
        if recorded.get(key) != value:
            return f"{where} was calibrated with {key} {recorded.get(key)!r}, this process has {value!r}; {FIX}"
    then = recorded.get("others_per_core")
    if load is None:
        load = _sampled_per_core()
    if load is None:
        load = load_per_core(ranks)
    if then is None or load is None:
        return None  # no load average on this platform: nothing to compare
    if abs(then - load) > LOAD_BAND:
        why = "calibrated under load" if recorded.get("under_load") else "calibrated on a quieter machine"
        return (
            f"{where} was {why}: others_per_core {then:.2f} (load average per core beside it), "
            f"{load:.2f} now (band {LOAD_BAND}); {FIX}"
        )
    return None

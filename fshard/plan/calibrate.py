"""``calibrate(mesh)``: measure the machine this runs on and write a machine file.

Every rank of the mesh measures at the same time (so the figures include what the ranks
cost each other when they share CPU cores or a node's links):

- matrix products (square, sizes whose FLOPs span two decades and more) per dtype: time
  ``= a + flops / F`` fitted over the sizes gives the sustained rate ``F`` apart from the
  host's share ``a`` of a call; each fit's relative residual is recorded, and a noisy fit
  is repeated once, then marked uncertain (:func:`_fit_twice`);
- the fixed cost of a kernel (a one-element add, many times);
- real Transformer blocks, forward and backward through ``value_and_grad(shard_map)``,
  one, two and four per call, at one sample and at up to 32: matrix products of a model's shapes, attention
  and norms reach a fraction of the square products' rate, and autograd and fshard cost a
  fixed host time per call and per layer besides; the timings, with the block's traced
  work (:func:`~fshard.plan.model.describe_transformer`), fit ``matmul_efficiency``,
  ``layer_overhead_s`` and ``call_overhead_s`` so that the estimate's formulas reproduce
  them (a block faster than the square products raises the matrix-product rates instead);
- memory bandwidth (copies whose bytes span two decades and more, fitted as the products
  are: bytes read + written per second);
- per mesh axis, all-gather, reduce-scatter, all-reduce and point-to-point (a ring of
  sends) at several sizes: ``(latency, bandwidth)`` fitted to the ring formulas of
  :mod:`fshard.plan.comm` (so the estimate uses exactly what was fitted), one fit per
  collective kind and link level: an axis whose ranks share a host is ``intra``, one that
  spans hosts ``inter`` (the levels the estimate picks per axis);
- overlap: a matrix-product loop with an all-gather in flight, against each alone;
- CPU ranks: what a blocking collective costs beyond its own time when the ranks compute
  between such calls (small all-reduces between matrix-product bursts);
- the optimizer: its host time per parameter leaf beyond its kernels, and the share of the
  copy's bandwidth its kernels reach (DTensor leaves, small and large).

Every compute figure is timed as :func:`_sustained` times it: all ranks at once, long enough
to span several of the scheduler's time slices, the slowest rank's time (what a step whose
ranks all compute sees, also with more ranks than cores).

The result is a :class:`~fshard.plan.machine.Machine` (the same on every rank), saved
by rank 0 to ``path`` (default :func:`~fshard.plan.machine.default_machine_path`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fshard.plan.machine import Link, Machine, default_machine_path, save_machine

__all__ = ["calibrate"]


def _others_cpu_s(busy_before: float | None, own_cpu_s: float, world: int) -> float | None:
    """CPU seconds this host's cores spent on other work since ``busy_before``
    (:func:`~fshard.plan.freshness.busy_seconds`): the host's busy time less this
    calibration's own ranks' CPU time on it (summed over the ranks on rank 0's host).
    Collective when ``world`` > 1; None where the host has no busy-time counter."""
    from fshard.plan import freshness

    host = platform.node()
    if world > 1:
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, (host, own_cpu_s))
        host = per_rank[0][0]
        own_cpu_s = sum(cpu for h, cpu in per_rank if h == host)
    busy_after = freshness.busy_seconds()
    if busy_before is None or busy_after is None:
        return None
    return max(0.0, busy_after - busy_before - own_cpu_s)


def _timeit(fn: Callable[[], Any], *, repeat: int, sync: Callable[[], None], warmup: int = 2) -> float:
    """Mean seconds of ``fn`` over ``repeat`` runs (after ``warmup``).

    The mean, not the median: on cores shared with other processes a short run either
    gets a core or waits for one, and the median of short runs is the speed with a core
    to itself, while a training step, seconds long, runs at the mean (waits included).
    """
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


# A timed burst lasts at least this long on every rank: the scheduler's time slices are a few
# milliseconds, and a shorter burst on oversubscribed cores (4 ranks on 2 here) can run whole
# on a core another rank is waiting for, so it times the speed of a core to itself.
MIN_BURST_S = 0.15


def _sustained(
    fn: Callable[[], Any],
    *,
    repeat: int,
    sync: Callable[[], None],
    barrier: Callable[[], None],
    device: torch.device,
    min_s: float = MIN_BURST_S,
) -> float:
    """Seconds per call of ``fn`` while every rank runs it at once: all ranks start after a
    barrier, each runs ``fn`` back to back for at least ``min_s`` (the same count on every
    rank), and the time is the slowest rank's elapsed time over the count. The count comes
    from a short burst of ``repeat`` calls (the median of the ranks' per-call times); a
    timed burst whose slowest rank took less than ``min_s`` runs again with the count scaled
    up, so every timed burst lasts at least ``min_s``.

    That is the rate a step sees when every rank computes: a step's collectives wait for
    the slowest rank. With more ranks than cores, a rank's own per-call times (their mean,
    or their mean over the ranks) are too fast: a rank that finishes its burst early leaves
    its core to the others, so their later calls run faster than they would if all kept
    computing: short bursts time a core to itself, well above the rate of long ones
    (docs/plan.md, "Figures behind the planner's rules";
    ``tests/plan/test_plan_measure.py`` has the rule on sleeps).
    Without a process group, ``fn``'s time on this process.
    """
    for _ in range(2):
        fn()
    sync()
    # The count from a short burst's per-call time, the median over the ranks: one call timed
    # on the slowest rank is a time slice long when that rank was preempted, and the count
    # then falls to ``repeat`` (bursts far shorter than ``min_s``).
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    per_call = _median_over_ranks((time.perf_counter() - t0) / repeat, device)
    # 1.25: the calls of a short burst run a little slower than those of a long one (cold
    # caches), and a count sized exactly made most first bursts a little short, each then run
    # again (docs/plan.md, "Figures behind the planner's rules").
    count = max(repeat, math.ceil(_BURST_MARGIN * min_s / max(per_call, 1e-9)))
    for _ in range(_BURST_TRIES):
        barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        sync()
        elapsed = _max_over_ranks(time.perf_counter() - t0, device)  # the same on every rank
        if elapsed >= min_s:
            break
        # Too short (the calls ran faster than the estimate): again, long enough this time;
        # every rank computes the same count from the same reduced time.
        count = math.ceil(count * _BURST_MARGIN * min_s / max(elapsed, 1e-9))
    return elapsed / count


# Timed bursts before _sustained takes a short one (each retry is sized from the last, so a
# second is short only if the calls sped up more than _BURST_MARGIN times between the two).
_BURST_TRIES = 4
_BURST_MARGIN = 1.25


def _median_over_ranks(t: float, device: torch.device) -> float:
    """The median of ``t`` over the ranks (``t`` itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    x = torch.tensor([t], dtype=torch.float64, device=device)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return statistics.median(float(p) for p in parts)


def _max_over_ranks(t: float, device: torch.device) -> float:
    """The largest ``t`` over the ranks (``t`` itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    x = torch.tensor([t], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def _medians_in_turn(
    fns: Mapping[Any, Callable[[], Any]],
    rounds: int,
    *,
    repeat: int,
    sync: Callable[[], None],
    barrier: Callable[[], None],
    device: torch.device,
    per_round: dict[Any, list[float]] | None = None,
) -> dict[Any, float]:
    """Per key of ``fns``, the median over ``rounds`` of its :func:`_sustained` time, the
    functions taken in turn each round: a drift of the machine's speed then moves every
    figure alike, and a figure made of differences of them (a fit, an overlap) keeps.
    ``per_round``, when given, receives per key each round's time."""
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(_sustained(fn, repeat=repeat, sync=sync, barrier=barrier, device=device))
    medians = {k: statistics.median(v) for k, v in times.items()}
    if per_round is not None:
        per_round.update(times)
    return medians


def _spread(values: Sequence[float]) -> float:
    """``(max - min) / median`` of ``values`` (0 for a median of 0 or less: nothing to compare)."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def _fit(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least squares ``t = a + x / B``: returns ``(a >= 0, B > 0)``."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
    if slope <= 0:  # flat or noisy: all latency; take the largest size for the rate
        slope = max(ts[-1], 1e-12) / xs[-1]
    a = max(0.0, mt - slope * mx)
    return a, 1.0 / slope


def residual(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The relative residual of a fit: root mean square of ``(predicted - measured) / measured``."""
    rel = [(p - m) / m for p, m in zip(predicted, measured) if m > 0]
    return math.sqrt(sum(r * r for r in rel) / len(rel)) if rel else 0.0


# A fit whose relative residual (or spread of repeated rounds) is above this is repeated once,
# and marked uncertain in the machine file when it is still above: the agreement issue 37
# asks of two calibrations minutes apart (15 % on every rate) is the precision a fit must have
# to be used as exact.
NOISY_FIT = 0.15


def _rate_fit(measure: Callable[[int], tuple[float, float]], sizes: Sequence[int]) -> tuple[float, float, float]:
    """``(host seconds, rate, relative residual)`` of ``t = host + x / rate`` over ``sizes``,
    ``measure(size) -> (x, t)``; the rate bounded by the largest size's plain rate (from below,
    and twice it from above: the fit can overshoot on noise)."""
    xs, ts = zip(*(measure(n) for n in sizes))
    host, rate = _fit(xs, ts)
    rate = max(min(rate, 2 * xs[-1] / ts[-1]), xs[-1] / ts[-1])
    host = max(0.0, statistics.mean(t - x / rate for x, t in zip(xs, ts)))
    return host, rate, residual([host + x / rate for x in xs], ts)


def _fit_twice(
    name: str, fit: Callable[[], tuple[Any, float]], residuals: dict[str, float], uncertain: list[str]
) -> Any:
    """``fit()``'s value (``fit() -> (value, residual)``), fitted again once when its residual
    is above :data:`NOISY_FIT`, the better of the two kept; its residual goes in ``residuals``
    and, still above the threshold, ``name`` in ``uncertain``. Collective: every rank takes
    the same branch (the residuals are of the slowest rank's times, the same on every rank)."""
    value, res = fit()
    if res > NOISY_FIT:
        again, res2 = fit()
        if res2 < res:
            value, res = again, res2
    residuals[name] = res
    if res > NOISY_FIT:
        uncertain.append(name)
    return value


def _matmul_rate(
    dtype: torch.dtype,
    device: torch.device,
    sizes: Sequence[int],
    repeat: int,
    sync: Callable[[], None],
    barrier: Callable[[], None],
) -> tuple[float, float]:
    """``(FLOP/s, relative residual)`` of ``t = host + flops / rate`` over square products of
    ``sizes`` (their FLOPs span more than two decades: the small ones time the host's share of
    a call, the large ones the rate)."""

    def measure(n: int) -> tuple[float, float]:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _sustained(lambda: torch.mm(a, b), repeat=repeat, sync=sync, barrier=barrier, device=device)
        return 2.0 * n**3, t

    _, rate, res = _rate_fit(measure, sizes)
    return rate, res


def _copy_rate(
    device: torch.device,
    sizes: Sequence[int],
    repeat: int,
    sync: Callable[[], None],
    barrier: Callable[[], None],
) -> tuple[float, float]:
    """``(bytes/s, relative residual)`` of ``t = host + bytes / rate`` over copies of ``sizes``
    fp32 elements (bytes read + written; the sizes span two decades and more)."""

    def measure(n: int) -> tuple[float, float]:
        pair = [torch.empty(n, device=device), torch.empty(n, device=device)]
        t = _sustained(lambda: pair[1].copy_(pair[0]), repeat=repeat, sync=sync, barrier=barrier, device=device)
        return 2.0 * n * 4, t

    _, rate, res = _rate_fit(measure, sizes)
    return rate, res


def calibrate(
    mesh: Any,
    *,
    path: str | os.PathLike | None = None,
    quick: bool = False,
    name: str | None = None,
    block: Any = None,
    check: bool = False,
) -> Any:
    """Measures this machine on every rank of ``mesh`` (collective) and saves a machine file.

    Args:
      mesh: an ``fs.Mesh``; every rank calls this. Each axis's collectives are measured.
      path: where rank 0 writes the JSON (optional; default
        :func:`~fshard.plan.machine.default_machine_path`; ``""`` writes nothing). With
        ``check``, the stored file to compare against.
      quick: fewer sizes and repeats (seconds on CPU) (optional, default False).
      name: the machine's name (optional; default ``"<host>-<device>"``).
      block: the ``fshard.models.TransformerConfig`` whose block fits the compute
        efficiency and the host costs per call and layer (optional; default: dim 256, 4
        heads, 128 tokens, the size ``bench/plan_validate.py`` trains; ``False`` skips the
        fit). Pass the model to be planned: the host costs depend on its shapes. The
        matrix-product and copy rates are fitted on sizes of their own, whatever ``block``
        is, and a block whose compute is too small a share of its time to fit a rate from
        leaves the square products' rate as it is.
      check: compare the stored calibration at ``path`` with a quick re-measure (nothing is
        saved) (optional, default False).

    Returns:
      The measured :class:`~fshard.plan.machine.Machine`, identical on every rank (rank
      0's measurements; every rank measured at the same time). With ``check``: per fitted
      rate of the stored file, the ratio re-measured / stored (keys ``"flops[<dtype>]"``
      and the names in :data:`CHECKED`; 1 means the file still holds).

    Raises:
      FileNotFoundError: ``check`` and no file at ``path``.
    """
    if check:
        return _check(mesh, path, name=name, block=block)
    from fshard.plan import freshness

    started, load_before = time.time(), freshness._loadavg()
    busy_before, cpu_before = freshness.busy_seconds(), time.process_time()
    device = mesh.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    barrier = dist.barrier if world > 1 else (lambda: None)
    repeat = 5 if quick else 15
    # FLOPs over more than two decades (32^3 to 384^3 and more): the small products time the
    # host's share of a call, the large ones the rate (a fit over one size cannot tell them apart).
    sizes: tuple[int, ...] = (32, 128, 384) if quick else (32, 64, 128, 256, 512, 768)
    if cuda:
        sizes = (128, 512, 2048, 8192)
    residuals: dict[str, float] = {}
    uncertain: list[str] = []

    flops = {}
    for dt in (torch.float32,) if quick else (torch.float32, torch.bfloat16, torch.float64):
        key = str(dt).removeprefix("torch.")
        try:
            flops[key] = _fit_twice(
                f"flops[{key}]",
                functools.partial(_matmul_rate, dt, device, sizes, repeat, sync, barrier),
                residuals,
                uncertain,
            )
        except RuntimeError:  # a dtype this device cannot multiply
            pass
    if "float32" in flops:  # tensor-parallel runs sometimes request the fp32 rate for fp64 ops
        flops.setdefault("float64", flops["float32"] / 2)
        flops.setdefault("bfloat16", flops["float32"])

    one = torch.ones(1, device=device)
    n_ops = 200 if quick else 1000
    op_overhead = (
        _sustained(
            lambda: [torch.add(one, one) for _ in range(n_ops)],
            repeat=repeat,
            sync=sync,
            barrier=barrier,
            device=device,
        )
        / n_ops
    )

    # Copies whose bytes span two decades and more: the small ones time the host share of a call.
    copies = (2**16, 2**19, 2**23) if quick else (2**16, 2**18, 2**20, 2**22, 2**24)
    mem_bw = _fit_twice(
        "mem_bandwidth", functools.partial(_copy_rate, device, copies, repeat, sync, barrier), residuals, uncertain
    )

    efficiency, layer_overhead, call_overhead, fit_note = 1.0, 0.0, 0.0, "block fit skipped"
    if block is not False and "float32" in flops:
        peak = flops["float32"]

        def fit() -> tuple[tuple[float, float, float, float, str], float]:
            out = _block_fit(block, mesh, peak, mem_bw, op_overhead, quick, sync, barrier)
            return out[:-1], out[-1]

        efficiency, layer_overhead, call_overhead, slope_spread, fit_note = _fit_twice(
            "block", fit, residuals, uncertain
        )
        flops, efficiency, note = resolve_efficiency(flops, efficiency, slope_spread)
        fit_note += note
    # Every rank returns rank 0's machine (broadcast below), fit included.
    optimizer_leaf, optimizer_eff = _optimizer_fit(mesh, mem_bw, op_overhead, quick, sync, barrier)

    collectives, measurements = _collectives(mesh, quick, sync, barrier)
    overlap = _overlap(mesh, sync, barrier, quick) if world > 1 else 0.5
    sync_overhead = _sync_overhead(mesh, sync, barrier, quick) if world > 1 and not cuda else 0.0

    host = _host()
    total_mem = torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory() / max(1, world)
    others_cpu = _others_cpu_s(busy_before, time.process_time() - cpu_before, world)
    conditions = freshness.conditions(ranks=world, load_before=load_before, started=started, others_cpu_s=others_cpu)
    fits = ", ".join(f"{k} {v:.1%}" for k, v in residuals.items())
    machine = Machine(
        name=name or f"{host}-{device.type}",
        memory_bytes=float(total_mem),
        flops=flops,
        mem_bandwidth=mem_bw,
        devices_per_node=torch.cuda.device_count() if cuda else 1 << 20,
        links=_links(collectives),
        matmul_efficiency=efficiency,
        op_overhead_s=op_overhead,
        layer_overhead_s=layer_overhead,
        call_overhead_s=call_overhead,
        optimizer_leaf_overhead_s=optimizer_leaf,
        optimizer_mem_efficiency=optimizer_eff,
        collectives=collectives,
        overlap=overlap,
        sync_overhead_s=sync_overhead,
        cores_per_node=0 if cuda else (os.cpu_count() or 1),
        comm_temporaries=1.0 if dist.is_initialized() and dist.get_backend() == "gloo" else 0.0,
        calibrated_ranks=0 if cuda else world,
        fit_residuals=residuals,
        uncertain=tuple(uncertain),
        conditions=conditions,
        sources=(
            f"fs.plan.calibrate on {host} ({device.type}), {world} rank(s) at once, "
            f"{time.strftime('%Y-%m-%d %H:%M')}; load average {_load()}",
        ),
        notes="measured: "
        + "; ".join(
            [
                f"fit residuals {fits}" + (f" (uncertain: {', '.join(uncertain)})" if uncertain else ""),
                fit_note,
                f"optimizer {optimizer_leaf * 1e3:.3f} ms per leaf besides its kernels, its kernels at "
                f"{optimizer_eff:.2f} of the copy's bandwidth",
                f"overlap {overlap:.2f}, {sync_overhead * 1e3:.2f} ms per blocking collective beside compute",
            ]
            + measurements
        ),
    )
    if world > 1:  # every rank returns rank 0's figures (they measured at the same time)
        box = [machine]
        dist.broadcast_object_list(box, src=0)
        machine = box[0]
    target = default_machine_path() if path is None else path
    if machine.conditions.get("under_load") and (world == 1 or dist.get_rank() == 0):
        logging.getLogger(__name__).warning(
            "fs.plan.calibrate: measured beside other work (%.2f load per core besides its own ranks, "
            "above %s): the file is marked under_load and is not reused on a quieter machine",
            machine.conditions["others_per_core"],
            freshness.LOADED_PER_CORE,
        )
    if target and (world == 1 or dist.get_rank() == 0):
        save_machine(machine, Path(target))
    return machine


# The rates calibrate(check=True) compares (figures of a Machine, by name).
CHECKED = ("mem_bandwidth", "op_overhead_s", "layer_overhead_s", "call_overhead_s")


def _check(mesh: Any, path: Any, *, name: str | None, block: Any) -> dict[str, float]:
    """``calibrate(check=True)``: per fitted rate of the file at ``path``, re-measured / stored."""
    from fshard.plan.machine import load_machine

    target = Path(default_machine_path() if path is None else path)
    stored = load_machine(target)  # FileNotFoundError: nothing to check
    now = calibrate(mesh, path="", quick=True, name=name, block=block)
    out = {
        f"flops[{k}]": now.flops[k] * now.matmul_efficiency / (v * stored.matmul_efficiency)
        for k, v in stored.flops.items()
        if k in now.flops
    }
    for f in CHECKED:
        old, new = getattr(stored, f), getattr(now, f)
        if old > 0:
            out[f] = new / old
    return out


# The block fit's largest sample count is the one whose compute, at the square products'
# rate, takes about BLOCK_SAMPLE_S (within 4 and MAX_BLOCK_SAMPLES): a small block's per-sample
# cost is then most of its largest points' time rather than a sliver beside its host costs.
BLOCK_SAMPLE_S = 0.02
MAX_BLOCK_SAMPLES = 32


def block_points(big: int) -> tuple[tuple[int, int], ...]:
    """The ``(blocks per call, samples)`` the block fit times, ``big`` samples at the largest:
    one, two and four blocks of few samples (the per-call and per-layer costs), and one and
    two blocks of ``big`` (the per-sample cost)."""
    return tuple(dict.fromkeys(((1, 1), (4, 1), (2, 2), (1, big), (2, big))))


def block_samples(per_sample_s: float) -> int:
    """The block fit's largest sample count for a block whose one sample's compute takes
    ``per_sample_s`` at the square products' rate (:data:`BLOCK_SAMPLE_S`)."""
    if per_sample_s <= 0:
        return MAX_BLOCK_SAMPLES
    return max(4, min(MAX_BLOCK_SAMPLES, math.ceil(BLOCK_SAMPLE_S / per_sample_s)))


# How far a block's fit may raise the matrix-product rates, and the spread of its per-sample
# cost over the rounds above which that cost is noise: the rounds disagree by more than it.
MAX_RATE_RAISE = 2.0
MAX_SLOPE_SPREAD = 1.0


def resolve_efficiency(
    flops: dict[str, float], efficiency: float, slope_spread: float
) -> tuple[dict[str, float], float, str]:
    """``(flops, matmul_efficiency, note)`` from a block fit's efficiency and the spread of
    its per-sample cost over the fit's rounds (``(max - min) / median``).

    The block is what a step runs, and its fit reproduces its timings up to the samples it
    timed, so its efficiency is used (a spread above :data:`NOISY_FIT` marks the block fit
    uncertain, which widens every interval). Not used: a spread above
    :data:`MAX_SLOPE_SPREAD`, where the per-sample cost is noise (a host-bound block); the
    square products' rate then stands. An efficiency above 1 means the block multiplied faster
    than the square products' fit says: the rates (every dtype's, as the efficiency applies
    to every dtype) are raised to the block's, by at most :data:`MAX_RATE_RAISE`, and only
    from a fit that repeats within :data:`NOISY_FIT`.
    """
    if slope_spread > MAX_SLOPE_SPREAD or (efficiency > 1 and slope_spread > NOISY_FIT):
        return (
            flops,
            1.0,
            (
                f"; efficiency {efficiency:.3f} not used: the block's per-sample cost spread "
                f"{slope_spread:.0%} over the rounds, too noisy to plan with"
            ),
        )
    if efficiency <= 1:
        return flops, efficiency, ""
    factor = min(efficiency, MAX_RATE_RAISE)
    capped = f" (fit {efficiency:.2f}x, capped)" if factor < efficiency else ""
    return (
        {k: v * factor for k, v in flops.items()},
        1.0,
        f"; the matmul rates raised {factor:.2f}x to the block's{capped}",
    )


# (leaves, elements per leaf) the optimizer's timing takes: see _optimizer_fit.
OPTIMIZER_POINTS = ((8, 4096), (32, 4096), (8, 262144))
# The least share the large leaves' update must take beyond the small ones' for fit_optimizer
# to read a bandwidth from it (on 4 CPU ranks sharing 2 cores: several times more).
MIN_BYTES_SHARE = 0.25


def _optimizer_fit(
    mesh: Any, mem_bw: float, op_overhead: float, quick: bool, sync: Callable[[], None], barrier: Callable[[], None]
) -> tuple[float, float]:
    """``(optimizer_leaf_overhead_s, optimizer_mem_efficiency)`` of the update
    ``examples/train_lm.py`` takes (``global_norm``, the clipping scale, ``fs.optim.adamw``
    and ``apply_updates`` under ``donate()``), as :func:`fit_optimizer` fits them.

    Timed on replicated DTensor leaves over ``mesh`` (as train_lm's parameters are: every
    op goes through DTensor's dispatch) at :data:`OPTIMIZER_POINTS` (a block's matrices
    are 2^16 to 2^18 elements), as :func:`_sustained` times it, the median of rounds
    taken in turn (three; one when ``quick``). Why a share of the copy's bandwidth: on
    ranks sharing cores, train_lm's update ran slower than its traced kernels at the copy's
    bandwidth with the per-leaf cost of small leaves, by a difference that scales with the
    bytes, not the leaves (docs/plan.md, "Figures behind the planner's rules").
    """
    from fshard import optim
    from fshard.mesh.sharding import shard
    from fshard.mesh.spec import PartitionSpec as P
    from fshard.plan.trace import trace_optimizer

    g = torch.Generator().manual_seed(0)

    def make(n_leaves: int, numel: int) -> Callable[[], None]:
        params = shard([torch.randn(numel, generator=g) for _ in range(n_leaves)], P(), mesh)
        grads = shard([torch.randn(numel, generator=g) for _ in range(n_leaves)], P(), mesh)
        opt = optim.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
        box = [params, opt.init(params)]

        def step() -> None:  # replicated leaves: global_norm issues no collective
            norm = float(optim.global_norm(grads))
            clipped = [x * (1.0 / (norm + 1e-6)) for x in grads]
            with optim.donate():
                updates, box[1] = opt.update(clipped, box[1], box[0])
                box[0] = optim.apply_updates(box[0], updates)

        return step

    t = _medians_in_turn(
        {pt: make(*pt) for pt in OPTIMIZER_POINTS},
        1 if quick else 3,
        repeat=3,
        sync=sync,
        barrier=barrier,
        device=mesh.device,
    )
    return fit_optimizer(
        OPTIMIZER_POINTS,
        [t[pt] for pt in OPTIMIZER_POINTS],
        trace_optimizer(torch.float32),
        mem_bw,
        op_overhead,
        cpu=mesh.device.type != "cuda",
    )


def fit_optimizer(
    points: Sequence[tuple[int, int]],
    times: Sequence[float],
    work: Any,
    mem_bw: float,
    op_overhead: float,
    *,
    cpu: bool,
) -> tuple[float, float]:
    """``(optimizer_leaf_overhead_s, optimizer_mem_efficiency)`` that make the estimate's
    optimizer formula give ``times`` at ``points``, each ``(leaves, elements per leaf)``.

    The formula (:func:`fshard.plan.estimate._optimizer_time`), for ``n`` leaves of ``e``
    elements::

        t(n, e) = n * e * bytes_per_element / (mem_bw * eff) + kernels(n) * op_overhead + n * leaf

    The two points with the fewest leaves, at different sizes, give ``eff`` (their
    difference is bytes alone); the two smallest leaves, at different counts, give
    ``leaf`` with that ``eff``. ``eff`` is kept in ``[0.05, 1]`` and ``leaf`` at 0 or above;
    ``eff`` is 1 when the larger leaves took less than :data:`MIN_BYTES_SHARE` more than
    the smaller ones (on a GPU the bytes' difference is tens of microseconds against
    milliseconds of host time: noise, which would make ``eff`` anything).

    Args:
      points: ``(leaves, elements per leaf)``: two with the same count and different
        sizes, and two with the same (smallest) size and different counts.
      times: their measured seconds.
      work: the update's :class:`~fshard.plan.trace.OptimizerWork` (fp32).
      mem_bw, op_overhead: the machine's calibrated figures.
      cpu: the estimate's kernel count rule (:func:`~fshard.plan.estimate.optimizer_kernels`).

    Raises:
      ValueError: points that do not hold such pairs.
    """
    from fshard.plan.estimate import optimizer_kernels

    by = dict(zip(points, times))
    if len(points) != len(times) or len(by) != len(times):
        raise ValueError(
            f"fit_optimizer: needs one time per distinct point; got points {list(points)} and {len(times)} times"
        )
    e0 = min(e for _, e in points)
    small = sorted(n for n, e in points if e == e0)
    n0 = small[0]
    sizes = sorted(e for n, e in points if n == n0)
    if len(small) < 2 or len(sizes) < 2:
        raise ValueError(
            f"fit_optimizer: points {list(points)} need two leaf counts at the smallest size "
            f"({e0}) and two sizes at the fewest leaves ({n0})"
        )
    e1, n1 = sizes[-1], small[-1]
    d_bytes = n0 * (e1 - e0) * work.bytes_per_element
    d_t = by[(n0, e1)] - by[(n0, e0)]
    eff = min(1.0, max(0.05, d_bytes / (mem_bw * d_t))) if d_t > MIN_BYTES_SHARE * by[(n0, e0)] else 1.0
    kernels = (optimizer_kernels(work, n1, cpu) - optimizer_kernels(work, n0, cpu)) / (n1 - n0)
    per_leaf = (by[(n1, e0)] - by[(n0, e0)]) / (n1 - n0)
    leaf = per_leaf - e0 * work.bytes_per_element / (mem_bw * eff) - kernels * op_overhead
    return max(0.0, leaf), eff


def _reference_block() -> Any:
    from fshard.models import TransformerConfig

    return TransformerConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, max_seq_len=128)


def _block_fit(
    cfg: Any,
    mesh: Any,
    peak: float,
    mem_bw: float,
    op_overhead: float,
    quick: bool,
    sync: Callable[[], None],
    barrier: Callable[[], None],
) -> tuple[float, float, float, float, str, float]:
    """``(matmul_efficiency, layer_overhead_s, call_overhead_s, slope_spread, note, residual)``
    from real blocks' forward + backward (``slope_spread``: ``(max - min) / median`` of the
    per-sample cost fitted on each round alone; ``residual``: the largest of the fit's relative
    residual, that spread and each point's spread over the rounds).

    The blocks run as a training step runs them: ``fs.value_and_grad`` of an
    ``fs.shard_map`` (checked mode, the default) over ``mesh`` with everything replicated
    (no collective), so the time includes autograd's and fshard's host work. The estimate
    costs a flat step's body of ``n`` layer calls of ``b`` samples
    ``call_overhead + n * (2 * layer_overhead + ops * op_overhead + b * (flops / (peak * eff)
    + bytes / BW))``; timing the :func:`block_points` (one block's parameters applied ``n``
    times) gives the three unknowns (:func:`fit_block`). Each point is the median of rounds
    taken in turn (five; three when ``quick``), so that a drift of the machine's speed moves
    every point alike.

    Why three unknowns: on ranks sharing cores, a call's time is a fixed part per call plus
    a part per block and sample, with almost nothing per block besides. A fit of one block
    at two ``b`` put the whole per-call cost on every layer's forward and backward, which a
    flat step pays once per microbatch and a pipeline stage's action half of (docs/plan.md,
    "Figures behind the planner's rules"). Why up to :data:`MAX_BLOCK_SAMPLES` samples: a
    small block's per-sample cost must be most of its largest points' time, not a sliver
    beside its host costs (docs/plan.md, "How far to trust a calibration").
    """
    import optree

    from fshard.mesh.spec import PartitionSpec as P
    from fshard.models import transformer_init
    from fshard.models.transformer import block as block_fn
    from fshard.plan.model import describe_transformer
    from fshard.transforms import shard_map, value_and_grad

    if cfg is None:
        cfg = _reference_block()
    desc = next(layer for layer in describe_transformer(cfg).layers if layer.name == "block")
    work = desc.fwd + desc.bwd_input + desc.bwd_weight
    device = mesh.device
    with torch.device("meta"):
        shapes = transformer_init(cfg, 0)["layers"][0]
    g = torch.Generator().manual_seed(0)
    # One block's parameters, applied n times: the memory of one block's parameters and of
    # at most 2 * big samples' activations.
    params = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.02).to(device), shapes)
    T = cfg.max_seq_len

    def blocks(n: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        def body(p: Any, x: torch.Tensor) -> torch.Tensor:
            for _ in range(n):
                x = block_fn(p, x, cfg)
            return x.sum()

        return body

    points = block_points(block_samples(work.flops / peak + work.bytes / mem_bw))
    grads = {
        n: value_and_grad(shard_map(blocks(n), mesh=mesh, in_specs=(P(), P()), out_specs=P()), argnums=(0, 1))
        for n in sorted({n for n, _ in points})
    }
    xs = {b: torch.randn(b, T, cfg.dim, generator=g).to(device) for b in sorted({b for _, b in points})}
    per_round: dict[Any, list[float]] = {}
    medians = _medians_in_turn(
        {(n, b): functools.partial(grads[n], params, xs[b]) for n, b in points},
        3 if quick else 5,
        repeat=3,
        sync=sync,
        barrier=barrier,
        device=device,
        per_round=per_round,
    )
    times = [medians[pt] for pt in points]
    efficiency, layer_overhead, call_overhead = fit_block(points, times, work, peak, mem_bw, op_overhead)
    fitted = [
        call_overhead
        + n * (2 * layer_overhead + work.ops * op_overhead)
        + n * b * (work.flops / (peak * efficiency) + work.bytes / mem_bw)
        for n, b in points
    ]
    # Each round's own per-sample cost (1 / efficiency): how well the medians' one is known.
    slopes = [
        1.0 / fit_block(points, [per_round[pt][r] for pt in points], work, peak, mem_bw, op_overhead)[0]
        for r in range(len(per_round[points[0]]))
    ]
    slope_spread = _spread(slopes)
    res = max(residual(fitted, times), slope_spread, *(_spread(v) for v in per_round.values()))
    note = (
        f"block fit (dim {cfg.dim}, {T} tokens, (blocks, samples) per value_and_grad(shard_map) call: "
        + ", ".join(f"{pt}: {t * 1e3:.1f} ms" for pt, t in zip(points, times))
        + f") -> {efficiency:.2f} of the matmul rate (spread {slope_spread:.0%} over the rounds), "
        f"{layer_overhead * 1e3:.2f} ms per layer forward or backward call, {call_overhead * 1e3:.2f} ms per "
        f"step-body call (residual {res:.1%})"
    )
    return efficiency, layer_overhead, call_overhead, slope_spread, note, res


def fit_block(
    points: Sequence[tuple[int, int]], times: Sequence[float], work: Any, peak: float, mem_bw: float, op_overhead: float
) -> tuple[float, float, float]:
    """``(matmul_efficiency, layer_overhead_s, call_overhead_s)`` that make the estimate's
    formulas give ``times`` (seconds of one step-body call) at ``points``, each
    ``(blocks per call, samples)``.

    The formula, for ``n`` blocks' forward and backward (two layer calls each) in one call::

        t(n, b) = call + n * (2 * layer + ops * op_overhead) + n * b * (flops / (peak * eff) + bytes / mem_bw)

    Least squares over the points for ``call``, ``layer`` and ``1 / eff``, with ``call`` and
    ``layer`` kept at 0 or above (the fit with the fewest of them pinned to 0 that keeps
    the others non-negative, the smallest residual among those).

    Args:
      points: three or more ``(blocks, samples)`` that separate the three unknowns (the rows
        ``(1, blocks, blocks * samples)`` have rank 3).
      times: their measured seconds.
      work: the block's :class:`~fshard.plan.trace.Work` summed over its phases.
      peak: the matrix-product rate the efficiency is a share of (FLOP/s).
      mem_bw, op_overhead: the machine's other calibrated figures.

    Returns:
      The efficiency (above 0; above 1 when the block ran faster than ``peak`` says, which
      the caller resolves), and the two overheads, ``>= 0``.

    Raises:
      ValueError: fewer than three points, too few distinct block or sample counts, or
        points that do not separate the unknowns.
    """
    if (
        len(points) != len(times)
        or len(points) < 3
        or len({n for n, _ in points}) < 2
        or len({b for _, b in points}) < 2
    ):
        raise ValueError(
            f"fit_block: needs 3 or more (blocks, samples) points with 2 block counts and 2 sample "
            f"counts, and one time each; got points {list(points)} and {len(times)} times"
        )
    design = torch.tensor([[1.0, n, n * b] for n, b in points], dtype=torch.float64)
    if int(torch.linalg.matrix_rank(design)) < 3:
        raise ValueError(
            f"fit_block: points {list(points)} do not separate the per-call, per-layer and per-sample "
            f"costs (their (1, blocks, blocks * samples) rows have rank < 3)"
        )
    ys = [t - n * work.ops * op_overhead - n * b * work.bytes / mem_bw for (n, b), t in zip(points, times)]
    cols = {
        "call": [1.0] * len(points),
        "layer": [2.0 * n for n, _ in points],
        "rate": [n * b * work.flops for n, b in points],
    }
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    best: tuple[int, float, dict[str, float]] | None = None  # (free terms, sse, fit): most free, then least sse
    for free in (("call", "layer"), ("layer",), ("call",), ()):
        names = list(free) + ["rate"]
        a = torch.tensor([[cols[k][i] for k in names] for i in range(len(points))], dtype=torch.float64)
        scale = a.abs().amax(0).clamp_min(1e-30)  # the columns differ by orders of magnitude
        sol = (torch.linalg.lstsq(a / scale, y).solution.squeeze(1) / scale).tolist()
        fit = dict(zip(names, sol))
        if fit["rate"] <= 0 or any(fit[k] < 0 for k in free):
            continue
        sse = float(((a @ torch.tensor(sol, dtype=torch.float64).unsqueeze(1) - y) ** 2).sum())
        if best is None or (len(free), -sse) > (best[0], -best[1]):
            best = (len(free), sse, fit)
    if best is None:  # nothing but noise: the rate alone, through the origin
        num = sum(x * y for x, y in zip(cols["rate"], ys))
        den = sum(x * x for x in cols["rate"])
        fit = {"rate": num / den if num > 0 else 1.0 / peak}
    else:
        fit = best[2]
    return max(1e-3, 1.0 / fit["rate"] / peak), fit.get("layer", 0.0), fit.get("call", 0.0)


def _links(collectives: dict[str, dict[str, Link]]) -> dict[str, Link]:
    """The machine's links: the all-gather fit per level; a level not measured (one host:
    no inter-node axis) takes the other's, so that the file stays complete."""
    ag = collectives.get("all_gather", {})
    intra = ag.get("intra") or ag.get("inter") or Link(1e9, 1e-5)
    return {"intra": intra, "inter": ag.get("inter", intra)}


def _host() -> str:
    return platform.node() or "host"


def _axis_level(group: Any, n: int) -> str:
    """``"intra"`` when the ranks of this axis group share a host, else ``"inter"``."""
    hosts: list[Any] = [None] * n
    dist.all_gather_object(hosts, _host(), group=group)
    return "intra" if len(set(hosts)) == 1 else "inter"


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _collectives(mesh: Any, quick: bool, sync, barrier) -> tuple[dict[str, dict[str, Link]], list[str]]:
    """Fits (latency, bandwidth) per collective kind over every mesh axis of size > 1."""
    from fshard import comm

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return {}, []
    sizes = (2**10, 2**16, 2**20) if quick else (2**10, 2**14, 2**18, 2**20, 2**22)
    repeat = 5 if quick else 11
    kinds = ("all_gather", "psum_scatter", "psum", "ppermute")
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    notes = []
    for axis in mesh.axis_names:
        n = mesh.shape[axis]
        if n == 1:
            continue
        group = mesh.group(axis)
        # Every rank must agree on the level (it keys the fit rank 0 reports): the axis is
        # inter-node if any of its groups spans hosts.
        flag = torch.tensor([_axis_level(group, n) == "inter"], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        level = "inter" if float(flag) else "intra"
        me = mesh.axis_index(axis)
        nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
        for nbytes in sizes:
            x = torch.ones(max(n, nbytes // 4), device=mesh.device)
            x = x[: x.numel() // n * n]
            nb = x.numel() * 4
            runs: dict[str, tuple[Callable[[], object], int]] = {
                "all_gather": (lambda: comm.all_gather(x, group, n, axes=(axis,)), nb),
                "psum_scatter": (lambda: comm.reduce_scatter(x, group, n, axes=(axis,)), nb),
                "psum": (lambda: comm.all_reduce(x, group, "sum", axes=(axis,)), nb),
            }

            def ring() -> None:
                out = torch.empty_like(x)
                reqs = dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
                )
                for r in reqs:
                    r.wait()

            runs["ppermute"] = (ring, nb)
            for kind, (fn, size) in runs.items():
                barrier()
                t = _timeit(fn, repeat=repeat, sync=sync)
                t_all = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(t_all, op=dist.ReduceOp.MAX)  # a collective lasts as long as its slowest rank
                t = float(t_all)
                # Normalise to the formula's unit "one step of a + x_step / B".
                if kind == "all_gather":
                    steps, x_step = n - 1, size
                elif kind == "psum_scatter":
                    steps, x_step = n - 1, size / n
                elif kind == "psum":
                    steps, x_step = 2 * (n - 1), size / n
                else:
                    steps, x_step = 1, size
                points.setdefault((kind, level), []).append((x_step, t / steps))
        notes.append(f"axis {axis} (n={n}, {level}): sizes {[s for s in sizes]} B")
    out: dict[str, dict[str, Link]] = {}
    for kind in kinds:
        for level in ("intra", "inter"):
            pts = sorted(points.get((kind, level), []))
            if not pts:
                continue
            a, B = _fit([p[0] for p in pts], [p[1] for p in pts])
            out.setdefault(kind, {})[level] = Link(bandwidth=B, latency=a)
            notes.append(f"{kind} ({level}): latency {a * 1e6:.0f} us, bandwidth {B / 1e9:.2f} GB/s")
    return out, notes


def _overlap(mesh: Any, sync, barrier, quick: bool = False) -> float:
    """Share of an all-gather hidden behind a concurrent matrix-product loop.

    Each of the three (compute alone, gather alone, both) is timed as :func:`_sustained`
    times it, the median of rounds taken in turn (five; three when ``quick``): the share is
    a difference of times, which single short timings of each left to noise (calibrations
    of one quiet machine minutes apart spread over most of [0, 1]); the compute loop is
    sized to last as long as the gather. With every core computing, gloo's transfers take
    cores from the compute rather than hide behind it, so the share comes out small on ranks
    sharing cores (docs/plan.md, "Figures behind the planner's rules").
    """
    from fshard import comm

    axis = max(mesh.axis_names, key=lambda a: mesh.shape[a])
    n = mesh.shape[axis]
    if n == 1:
        return 0.5
    group = mesh.group(axis)
    a = torch.randn(256, 256, device=mesh.device)
    x = torch.ones(2**20, device=mesh.device)

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    def gather() -> None:
        comm.all_gather(x, group, n, axes=(axis,))

    def both() -> None:
        h = comm.all_gather_async(x, group, n, axes=(axis,))
        compute()
        h.wait()

    # As long as the gather alone: the share is a difference over the shorter of the two,
    # which a short compute loop (the 8 products it starts from: a fraction of the gather's
    # time on ranks sharing cores) makes far less precise.
    reps = 8
    tg = _sustained(gather, repeat=5, sync=sync, barrier=barrier, device=mesh.device)
    tc = _sustained(compute, repeat=5, sync=sync, barrier=barrier, device=mesh.device)
    reps = max(8, min(256, round(8 * tg / tc)))
    t = _medians_in_turn(
        {"compute": compute, "gather": gather, "both": both},
        3 if quick else 5,
        repeat=5,
        sync=sync,
        barrier=barrier,
        device=mesh.device,
    )
    tc, tg, tb = t["compute"], t["gather"], t["both"]
    hidden = (tc + tg - tb) / min(tc, tg)
    # _sustained's times are the slowest rank's, the same on every rank
    return min(1.0, max(0.0, hidden))


def _sync_overhead(mesh: Any, sync, barrier, quick: bool = False) -> float:
    """Seconds a blocking collective costs beyond its own time when the ranks compute
    between such collectives (tensor parallelism's all-reduces between a block's matrix
    products), per call.

    A loop of ``reps`` times (a matrix-product burst, then a small all-reduce over the
    largest axis), against the bursts alone and the all-reduces alone, each as
    :func:`_sustained` times it, the median of rounds taken in turn (five; one when
    ``quick``). On a device every rank has its own, this is about 0. With more ranks than
    cores, a rank that reaches the collective waits for peers the scheduler has preempted
    in favour of other ranks' compute: the tp=2 layouts of ``bench/plan_validate.py`` ran
    well over the estimate with their all-reduces at the idle link's time (docs/plan.md,
    "Figures behind the planner's rules").
    """
    from fshard import comm

    axis = max(mesh.axis_names, key=lambda a: mesh.shape[a])
    n = mesh.shape[axis]
    if n == 1:
        return 0.0
    group = mesh.group(axis)
    a = torch.randn(256, 256, device=mesh.device)
    x = torch.ones(1024, device=mesh.device)
    reps = 8
    burst = 4  # products per burst: a few milliseconds on a CPU core, a block's half

    def compute() -> None:
        for _ in range(reps):
            for _ in range(burst):
                torch.mm(a, a)

    def reduce() -> None:
        for _ in range(reps):
            comm.all_reduce(x, group, "sum", axes=(axis,))

    def both() -> None:
        for _ in range(reps):
            for _ in range(burst):
                torch.mm(a, a)
            comm.all_reduce(x, group, "sum", axes=(axis,))

    t = _medians_in_turn(
        {"compute": compute, "reduce": reduce, "both": both},
        1 if quick else 5,
        repeat=3,
        sync=sync,
        barrier=barrier,
        device=mesh.device,
    )
    return max(0.0, (t["both"] - t["compute"] - t["reduce"]) / reps)

"""Timeline plots of a simulated schedule (one row per rank), via matplotlib."""

from __future__ import annotations

import os
from fractions import Fraction

from fshard.sched.ir import Kind, Schedule
from fshard.sched.simulate import Number, _costs, simulate

__all__ = ["plot"]

_COLORS = {Kind.F: "#4C72B0", Kind.B: "#8172B2", Kind.I: "#55A868", Kind.W: "#DD8452"}
_NAMES = {Kind.F: "F forward", Kind.B: "B full backward", Kind.I: "I backward (input)", Kind.W: "W backward (weight)"}
_FORMATS = (".png", ".svg")


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    # Later local chunks are drawn lighter so interleaved stages stay readable.
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.45, 0.3 * chunk)
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]


def plot(
    schedule: Schedule,
    path: str | os.PathLike[str],
    *,
    f: Number = 1,
    b: Number = 1,
    w: Number = 1,
    comm: Number = 0,
    title: str | None = None,
) -> str:
    """Draws the simulated timeline of ``schedule`` to a PNG or SVG file.

    One row per rank (rank 0 on top); each compute action is a block colored by
    kind (F, B, I, W), lighter for later local chunks, labelled with its
    microbatch. Times come from :func:`fshard.sched.simulate` with the same costs.
    Uses matplotlib's Agg/SVG canvases directly, so the global pyplot backend
    is left alone.

    Args:
        schedule: a compute-only or lowered schedule.
        path: output file; ``.png`` or ``.svg`` picks the format.
        f: forward cost per microbatch of one rank's layers (optional, default 1).
        b: backward-input cost (optional, default 1).
        w: backward-weight cost (optional, default 1).
        comm: latency on cross-rank edges (optional, default 0).
        title: plot title (optional, default: name, makespan and bubble).

    Returns:
        The path written, as a string.

    Raises:
        ImportError: matplotlib is not installed (install ``fshard[viz]``).
        ValueError: the extension is not .png or .svg, or a cost is invalid.
        ScheduleError: the schedule deadlocks.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ValueError(f"plot path must end in .png or .svg, got {path!r}")
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("fshard.sched.plot needs matplotlib; install it with `pip install fshard[viz]`") from err
    report = simulate(schedule, f=f, b=b, w=w, comm=comm)
    costs = _costs(f, b, w, comm)
    v, p = schedule.n_virtual, schedule.n_ranks
    width = min(40.0, max(6.0, float(report.makespan) * 0.5))
    fig = Figure(figsize=(width, 0.6 * p + 1.4))
    ax = fig.add_subplot()
    used: set[Kind] = set()
    for rank, spans in enumerate(report.spans):
        chunks = schedule.stages_of(rank)
        for span in spans:
            start = span.start
            for part in span.action.parts:
                length = costs.of(part, v)
                _block(ax, rank, start, length, part.microbatch, _shade(_COLORS[part.kind], chunks.index(part.stage)))
                used.add(part.kind)
                start += length
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, float(report.makespan))
    ax.set_xlabel("time (f = forward of one rank's layers per microbatch); lighter blocks: a rank's later stages")
    ax.legend(
        handles=[Patch(color=_COLORS[k], label=_NAMES[k]) for k in _COLORS if k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if p < 3 else -0.2),
        ncol=4,
        frameon=False,
        fontsize=8,
    )
    ax.set_title(
        title
        if title is not None
        else f"{schedule.name}: p={p}, m={schedule.n_microbatches}, v={v}; makespan "
        f"{float(report.makespan):g}, bubble {float(report.bubble_fraction):.1%}"
    )
    fig.tight_layout()
    fig.savefig(path, format=ext[1:])
    return path


def _block(
    ax: object, rank: int, start: Fraction, length: Fraction, mb: int | None, color: tuple[float, float, float]
) -> None:
    ax.barh(  # type: ignore[attr-defined]
        rank,
        float(length),
        left=float(start),
        height=0.8,
        color=color,
        edgecolor="white",
        linewidth=0.5,
    )
    ax.text(  # type: ignore[attr-defined]
        float(start + length / 2),
        rank,
        str(mb),
        ha="center",
        va="center",
        fontsize=7,
        color="white",
    )

"""``python -m fshard.sched``: print, simulate and plot any pipeline schedule.

::

    python -m fshard.sched 1f1b --ranks 4 --microbatches 8
    python -m fshard.sched interleaved --ranks 4 --microbatches 8 --virtual 2 --plot out.png
    python -m fshard.sched zbv --ranks 2 --microbatches 4 --f 1 --b 1 --w 1 --lower
    python -m fshard.sched --list

It prints the per-rank grid of actions, then the simulated makespan, the bubble and the
peak activation memory per rank. The names are :mod:`fshard.sched.registry`'s, so scripts
take the same names as this command (``examples/train_lm.py --schedule 1f1b``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fshard.sched.ir import Schedule
from fshard.sched.lower import lower
from fshard.sched.registry import ALIASES, GENERATORS, build_schedule, choices, resolve_name
from fshard.sched.simulate import simulate

__all__ = ["ALIASES", "GENERATORS", "build_schedule", "main", "resolve_name"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fshard.sched",
        description="Print a pipeline schedule's per-rank grid, its simulated makespan, "
        "bubble and peak activation memory; optionally plot its timeline.",
        epilog=f"schedules: {choices()}",
    )
    p.add_argument(
        "schedule", nargs="?", help="schedule name or alias, e.g. 1f1b, gpipe, interleaved, zb, zbv, dualpipev"
    )
    p.add_argument("--ranks", "-p", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument(
        "--virtual", "-v", type=int, default=None, help="stages per rank (default: the schedule's own, 1 or 2)"
    )
    p.add_argument("--f", type=float, default=1, help="forward cost per microbatch (default 1)")
    p.add_argument("--b", type=float, default=1, help="backward-input cost (default 1)")
    p.add_argument("--w", type=float, default=1, help="backward-weight cost; a full B costs b + w (default 1)")
    p.add_argument("--comm", type=float, default=0, help="latency of each cross-rank transfer (default 0)")
    p.add_argument("--lower", action="store_true", help="show the SEND/RECV actions the executor runs")
    p.add_argument("--plot", metavar="PATH", help="write the timeline to PATH (.png or .svg; needs matplotlib)")
    p.add_argument("--no-grid", action="store_true", help="print only the summary")
    p.add_argument("--list", action="store_true", help="list the schedule names and exit")
    return p


def _cost(x: float) -> int | float:
    # Whole costs stay ints so the simulator's exact Fractions print without decimals.
    return int(x) if float(x).is_integer() else x


def _summary(schedule: Schedule, f: float, b: float, w: float, comm: float) -> str:
    rep = simulate(schedule, f=_cost(f), b=_cost(b), w=_cost(w), comm=_cost(comm))
    peaks = ", ".join(str(x) for x in rep.peak_activations)
    memory = f"peak memory     [{peaks}] (stage, microbatch) activations held per rank"
    if schedule.n_virtual > 1:  # a rank's stage is 1/v of its layers: also give layer-set units
        memory += (
            f" = [{', '.join(f'{float(x):g}' for x in rep.peak_stage_activations)}] "
            f"in units of a rank's whole layer set ({schedule.n_virtual} stages)"
        )
    return "\n".join(
        [
            f"makespan        {float(rep.makespan):g} (ideal {float(rep.ideal):g} = "
            f"{schedule.n_microbatches} microbatches x (f + b + w))",
            f"bubble          {float(rep.bubble_fraction):.1%} of the step "
            f"(bubble ratio {float(rep.bubble_ratio):.3f} = idle / ideal)",
            memory,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0, or 2 for a bad request)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for name, gen in GENERATORS.items():
            aliases = sorted(a for a, n in ALIASES.items() if n == name)
            doc = (gen.__doc__ or "").strip().splitlines()[0]
            print(f"{name:<17} {', '.join(aliases):<34} {doc}")
        return 0
    if args.schedule is None:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: name a schedule: {choices()}", file=sys.stderr)
        return 2
    try:
        schedule = build_schedule(args.schedule, args.ranks, args.microbatches, n_virtual=args.virtual)
        shown = lower(schedule) if args.lower else schedule
        summary = _summary(schedule, args.f, args.b, args.w, args.comm)
    except ValueError as e:  # bad name or sizes: the generator's message says why
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if not args.no_grid:
        print(shown)
        print()
    print(summary)
    if args.plot:
        try:
            path = plot_schedule(schedule, args.plot, args.f, args.b, args.w, args.comm)
        except (ImportError, ValueError) as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        print(f"timeline written to {path}")
    return 0


def plot_schedule(schedule: Schedule, path: str, f: float, b: float, w: float, comm: float) -> str:
    """:func:`fshard.sched.plot` with the command's costs (imported late: matplotlib is optional)."""
    from fshard.sched.plot import plot

    return plot(schedule, path, f=_cost(f), b=_cost(b), w=_cost(w), comm=_cost(comm))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        sys.stderr.close()
        sys.exit(0)

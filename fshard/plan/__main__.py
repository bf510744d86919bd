"""``python -m fshard.plan``: rank layouts for a model on a cluster, or estimate one.

::

    python -m fshard.plan --model llama3-8b --devices 64 --machine h100 --batch 1024 --seq 8192
    python -m fshard.plan --model llama3-70b --devices 256 --machine h100 --batch 512 \\
        --layout fsdp=32,tp=8 --remat
    python -m fshard.plan --list

The table shows the fastest layouts that fit: predicted step time, tokens per second per
device, MFU, where the step goes (compute, communication not hidden behind compute,
pipeline bubble, optimizer) and what each device's memory holds at its peak. It is a
rich table when ``rich`` is installed, plain text otherwise (``--plain``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fshard.parallel.layout import parse_mesh
from fshard.plan.estimate import estimate
from fshard.plan.layout import AXES, Layout, LayoutError
from fshard.plan.machine import MACHINES, get_machine
from fshard.plan.model import PRESETS, DescriptionError, get_model
from fshard.plan.report import render
from fshard.plan.search import SCHEDULES, SearchConfig, search

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fshard.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help=f"a preset ({', '.join(PRESETS)})")
    p.add_argument("--machine", default="h100", help=f"a shipped machine ({', '.join(MACHINES)}) or a machine file")
    p.add_argument("--devices", type=_positive_int, default=8, help="number of devices (>= 1)")
    p.add_argument(
        "--batch", type=_positive_int, default=None, help="global batch in sequences, >= 1 (default: 2 per device)"
    )
    p.add_argument("--seq", type=_positive_int, default=8192, help="tokens per sequence (>= 1)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument(
        "--memory-limit",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="memory per device in GiB, > 0 (default: the machine's less its reserve)",
    )
    p.add_argument("--top", type=_positive_int, default=10, help="rows to show (>= 1)")
    p.add_argument(
        "--schedules",
        type=_schedule_list,
        default=",".join(SCHEDULES),
        help="pipeline schedules to try, comma-separated (fs.sched's names)",
    )
    p.add_argument(
        "--layout",
        type=_mesh,
        default=None,
        metavar="AXIS=N,...",
        help=f"estimate this one mesh instead of searching (axes {', '.join(AXES)}; sizes >= 1)",
    )
    p.add_argument("--microbatches", type=_positive_int, default=1, help="with --layout (>= 1)")
    p.add_argument("--schedule", type=_schedule_name, default="1f1b", help="with --layout and pp")
    p.add_argument("--remat", action="store_true", help="with --layout")
    p.add_argument("--sequence-parallel", action="store_true", help="with --layout")
    p.add_argument("--plain", action="store_true", help="plain text table even when rich is installed")
    p.add_argument("--list", action="store_true", help="list models and machines and exit")
    return p


# Argument types: argparse reports an ArgumentTypeError as "argument --flag: <message>" and
# exits 2, so a bad value stops the run instead of being replaced by a default (``--batch 0``
# once meant "2 per device") or reaching the search (a negative memory limit fitted nothing).
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):  # "not >" also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _schedule_name(text: str) -> str:
    from fshard.sched.registry import resolve_name

    try:
        resolve_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _schedule_list(text: str) -> list[str]:
    """Comma-separated schedule names, every one known to ``fs.sched`` (an unknown one was
    once only a "rejected" count in the table, and the run exited 0)."""
    from fshard.sched.registry import choices, resolve_name

    names = [n.strip() for n in text.split(",")]
    if any(not n for n in names):
        raise argparse.ArgumentTypeError(f"empty schedule name in {text!r}; write names separated by commas")
    unknown = []
    for n in names:
        try:
            resolve_name(n)
        except ValueError:
            unknown.append(n)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {', '.join(map(repr, unknown))}; known: {choices()}")
    return names


def _mesh(text: str) -> dict[str, int]:
    """``--layout``'s ``axis=size,...`` (:func:`fshard.parallel.layout.parse_mesh`)."""
    try:
        return parse_mesh(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print("models:", ", ".join(PRESETS))
        print("machines:", ", ".join(MACHINES))
        return 0
    try:
        model = get_model(args.model, seq_len=args.seq, dtype=args.dtype)
        machine = get_machine(args.machine)
        batch = args.batch if args.batch is not None else 2 * args.devices
        limit = args.memory_limit * 2**30 if args.memory_limit is not None else None
        if args.layout is not None:
            layout = Layout(
                args.layout,
                batch=batch,
                microbatches=args.microbatches,
                schedule=args.schedule,
                remat=args.remat,
                sequence_parallel=args.sequence_parallel,
                dtype=args.dtype,
            )
            est = estimate(model, machine, layout, memory_limit=limit)
            print(
                render(
                    [est],
                    title=f"{model.name} on {layout.n_devices} x {machine.name}, batch {batch} x {args.seq} tokens",
                    plain=args.plain,
                )
            )
            print(est.explain())
            if est.memory_limit is not None and not est.fits:
                print(f"does not fit: peak {est.peak_bytes / 2**30:.1f} GiB > limit {est.memory_limit / 2**30:.1f} GiB")
            return 0
        config = SearchConfig(schedules=args.schedules, dtype=args.dtype, top=args.top)
        res = search(model, machine, args.devices, batch, limit, config=config)
    except (DescriptionError, LayoutError, ValueError) as e:
        print(f"python -m fshard.plan: error: {e}", file=sys.stderr)
        return 2
    title = (
        f"{model.name} ({model.numel / 1e9:.2f}B params) on {args.devices} x {machine.name}, "
        f"batch {batch} x {args.seq} tokens: top {len(res)} of {res.considered} layouts"
    )
    print(render(res.ranked, title=title, plain=args.plain))
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(res.rejected.items()))
    print(f"rejected: {dropped or 'none'}")
    if res.best is not None:
        print("best:", res.best.explain())
    elif res.best_unfit is not None:
        print(
            "nothing fits; the fastest layout needs",
            f"{res.best_unfit.peak_bytes / 2**30:.1f} GiB:",
            res.best_unfit.explain(),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

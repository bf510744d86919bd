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

from fshard.plan.estimate import estimate
from fshard.plan.layout import AXES, Layout, LayoutError
from fshard.plan.machine import MACHINES, get_machine
from fshard.plan.model import PRESETS, DescriptionError, get_model
from fshard.plan.report import render
from fshard.plan.search import SCHEDULES, search

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fshard.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help=f"a preset ({', '.join(PRESETS)})")
    p.add_argument("--machine", default="h100", help=f"a shipped machine ({', '.join(MACHINES)}) or a machine file")
    p.add_argument("--devices", type=int, default=8, help="number of devices")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 2 per device)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="memory per device in GiB (default: the machine's less its reserve)")
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="pipeline schedules to try, comma-separated")
    p.add_argument("--layout", default=None, metavar="AXIS=N,...",
                   help=f"estimate this one mesh instead of searching (axes {', '.join(AXES)})")
    p.add_argument("--microbatches", type=int, default=1, help="with --layout")
    p.add_argument("--schedule", default="1f1b", help="with --layout and pp")
    p.add_argument("--remat", action="store_true", help="with --layout")
    p.add_argument("--sequence-parallel", action="store_true", help="with --layout")
    p.add_argument("--plain", action="store_true", help="plain text table even when rich is installed")
    p.add_argument("--list", action="store_true", help="list models and machines and exit")
    return p


def _mesh(text: str) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise LayoutError(f"--layout {text!r}: expected axis=size items, got {item!r}")
        out[name.strip()] = int(size)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print("models:", ", ".join(PRESETS))
        print("machines:", ", ".join(MACHINES))
        return 0
    try:
        model = get_model(args.model, seq_len=args.seq, dtype=args.dtype)
        machine = get_machine(args.machine)
        batch = args.batch or 2 * args.devices
        limit = args.memory_limit * 2**30 if args.memory_limit else None
        if args.layout:
            layout = Layout(_mesh(args.layout), batch=batch, microbatches=args.microbatches, schedule=args.schedule,
                            remat=args.remat, sequence_parallel=args.sequence_parallel, dtype=args.dtype)
            est = estimate(model, machine, layout, memory_limit=limit)
            print(render([est], title=f"{model.name} on {layout.n_devices} x {machine.name}, batch {batch} x "
                         f"{args.seq} tokens", plain=args.plain))
            print(est.explain())
            if not est.fits:
                print(f"does not fit: peak {est.peak_bytes / 2**30:.1f} GiB > limit {est.memory_limit / 2**30:.1f} GiB")
            return 0
        res = search(model, machine, args.devices, batch, limit, schedules=args.schedules.split(","),
                     dtype=args.dtype, top=args.top)
    except (DescriptionError, LayoutError, ValueError) as e:
        print(f"python -m fshard.plan: error: {e}", file=sys.stderr)
        return 2
    title = (f"{model.name} ({model.numel / 1e9:.2f}B params) on {args.devices} x {machine.name}, "
             f"batch {batch} x {args.seq} tokens: top {len(res)} of {res.considered} layouts")
    print(render(res.ranked, title=title, plain=args.plain))
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(res.rejected.items()))
    print(f"rejected: {dropped or 'none'}")
    if res.best is not None:
        print("best:", res.best.explain())
    elif res.best_unfit is not None:
        print("nothing fits; the fastest layout needs", f"{res.best_unfit.peak_bytes / 2**30:.1f} GiB:",
              res.best_unfit.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m fshard.plan``: rank layouts for a model on a cluster, or estimate one.

::

    python -m fshard.plan --model llama3-8b --devices 64 --machine h100 --batch 1024 --seq 8192
    python -m fshard.plan --model llama3-70b --devices 256 --machine h100 --batch 512 \\
        --layout fsdp=32,tp=8 --remat
    python -m fshard.plan --machine local --recalibrate     # this host, measured again
    python -m fshard.plan --list

The table shows the fastest layouts that fit: predicted step time, tokens per second per
device, MFU, the shares of the step that are communication not hidden behind compute,
pipeline bubble and optimizer, and each device's peak memory. It fits 100 columns;
``--wide`` adds the seconds and what the memory holds, ``--json`` prints every field as
JSON. A layout above the memory limit is marked "does not fit (needs X GiB of Y GiB)".
The first line names the machine: a shipped data sheet, or the machine file and its age.
It is a rich table when ``rich`` is installed, plain text otherwise (``--plain``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from fshard.parallel.layout import parse_mesh
from fshard.plan.estimate import estimate
from fshard.plan.freshness import stale
from fshard.plan.layout import AXES, Layout, LayoutError
from fshard.plan.machine import MACHINES, Machine, default_machine_path, get_machine, load_machine
from fshard.plan.model import PRESETS, DescriptionError, get_model
from fshard.plan.report import file_note, record, render, wrap
from fshard.plan.search import SCHEDULES, SearchConfig, search

__all__ = ["LOCAL", "main"]

LOCAL = "local"  # --machine's name for this host's calibration file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fshard.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help=f"a preset ({', '.join(PRESETS)})")
    p.add_argument(
        "--machine",
        default=None,
        help=f"a shipped machine ({', '.join(MACHINES)}), a machine file, or {LOCAL!r}: this host's calibration "
        "($FSHARD_MACHINE, else ~/.cache/fshard/machine-<host>.json; measured now if absent) "
        f"(default: h100; {LOCAL} with --recalibrate)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help=f"measure this host again (a quick calibration, seconds) and save it to the machine file "
        f"({LOCAL}'s, or the --machine path)",
    )
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
    p.add_argument("--wide", action="store_true", help="every time and memory column (wider than 100 columns)")
    p.add_argument("--json", action="store_true", help="print the machine, the rows and the rejections as JSON")
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


def _calibrate(path: Path) -> Machine:
    """A quick calibration of this host in this one process (``fs.plan.calibrate``), saved at ``path``."""
    from fshard.mesh.mesh import make_mesh
    from fshard.plan.calibrate import calibrate

    return calibrate(make_mesh({"ranks": 1}), path=path, quick=True)


def _machine(args: argparse.Namespace) -> tuple[Machine, dict[str, Any]]:
    """The machine to plan for, and where its figures came from (the first line printed).

    Returns:
      The machine and ``{"name", "source", "path", "age_s", "line"}``: ``source`` is
      ``"shipped"`` (a data sheet in fshard), ``"file"`` (a machine file, ``age_s`` since it
      was written; ``"stale"``: why it may not hold here now, or None) or ``"calibrated"``
      (measured just now and saved at ``path``).

    Raises:
      ValueError: ``--recalibrate`` with a shipped machine (nothing to measure).
      DescriptionError: no such machine or file, or not a valid machine file.
    """
    name = args.machine or (LOCAL if args.recalibrate else "h100")
    if name.lower() in MACHINES and not Path(name).exists():
        if args.recalibrate:
            raise ValueError(
                f"--recalibrate measures this host, but --machine {name} is a shipped data sheet: "
                f"use --machine {LOCAL} (this host's file, {default_machine_path()}) or a machine file path"
            )
        found = get_machine(name)
        line = f"machine {found.name}: shipped figures ({name.lower()}.json in fshard, data sheets, not measured here)"
        return found, {"name": found.name, "source": "shipped", "path": None, "age_s": None, "line": line}
    path = default_machine_path() if name == LOCAL else Path(name)
    if args.recalibrate or (name == LOCAL and not path.exists()):
        why = "--recalibrate" if args.recalibrate else "no calibration file yet"
        t0 = time.perf_counter()
        found = _calibrate(path)
        line = (
            f"machine {found.name}: calibrated now ({why}: a quick calibration, {time.perf_counter() - t0:.0f} s), "
            f"saved to {path}"
        )
        return found, {"name": found.name, "source": "calibrated", "path": str(path), "age_s": 0.0, "line": line}
    if not path.exists():
        return get_machine(name), {}  # raises: names the shipped machines
    found = load_machine(path)
    line = f"machine {found.name}: {file_note(path)}; --recalibrate measures again"
    # Used as asked, but said when it may not hold here now (versions, cores, load: freshness).
    problem = stale(found.conditions, path)
    if problem:
        line += f"\nwarning: {problem}"
    age_s = time.time() - path.stat().st_mtime
    return found, {
        "name": found.name,
        "source": "file",
        "path": str(path),
        "age_s": age_s,
        "stale": problem,
        "line": line,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print("models:", ", ".join(PRESETS))
        print("machines:", ", ".join(MACHINES), f"(or a machine file, or {LOCAL}: this host's calibration)")
        return 0
    width = None if args.wide else 100  # report.WIDTH; --wide: lines as long as they are
    try:
        model = get_model(args.model, seq_len=args.seq, dtype=args.dtype)
        machine, source = _machine(args)
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
            shown = [estimate(model, machine, layout, memory_limit=limit)]
            devices, considered, rejected, unfit = layout.n_devices, 1, {}, None
        else:
            config = SearchConfig(schedules=args.schedules, dtype=args.dtype, top=args.top)
            res = search(model, machine, args.devices, batch, limit, config=config)
            shown, devices, considered, rejected, unfit = (
                list(res.ranked),
                args.devices,
                res.considered,
                res.rejected,
                res.best_unfit,
            )
    except (DescriptionError, LayoutError, ValueError) as e:
        print(f"python -m fshard.plan: error: {e}", file=sys.stderr)
        return 2
    usable = limit if limit is not None else machine.memory_bytes - machine.reserved_bytes
    if args.json:
        doc = {
            "model": model.name,
            "params": model.numel,
            "machine": {k: v for k, v in source.items() if k != "line"},
            "devices": devices,
            "batch": batch,
            "seq": args.seq,
            "dtype": args.dtype,
            "memory_limit_gib": usable / 2**30,
            "considered": considered,
            "rejected": rejected,
            "rows": [record(e, k) for k, e in enumerate(shown, 1)],
            "best_unfit": None if unfit is None else record(unfit),
        }
        print(json.dumps(doc, indent=1))
        return 0
    print(wrap(source["line"], width))
    head = (
        f"{model.name} ({model.numel / 1e9:.2f}B params) on {devices} x {machine.name}, "
        f"batch {batch} x {args.seq} tokens, {args.dtype}"
    )
    if args.layout is not None:
        title = head
    elif shown:
        title = f"{head}: top {len(shown)} of {considered} layouts"
    else:  # the layout that comes closest, marked as not fitting
        shown = [unfit] if unfit is not None else []
        title = f"{head}: none of {considered} layouts fits in {usable / 2**30:.1f} GiB; the smallest peak"
    print(render(shown, title=title, plain=args.plain, wide=args.wide, width=width))
    if args.layout is not None:
        print(wrap(shown[0].explain(), width))
        return 0
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(rejected.items()))
    print(wrap(f"rejected: {dropped or 'none'}", width))
    if res.best is not None:
        print(wrap(f"best: {res.best.explain()}", width))
    elif unfit is not None:
        print(wrap(f"nothing fits; the smallest peak: {unfit.explain()}", width))
    return 0


if __name__ == "__main__":
    sys.exit(main())

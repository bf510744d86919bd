"""Text forms of a Schedule: the per-rank grid and the CSV file format."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import IO

from fshard.sched.ir import Action, Schedule, ScheduleError

_HEADER = "# fshard.sched "


def format_grid(schedule: Schedule) -> str:
    """One column per rank, one row per list position, under a line of sizes."""
    head = (
        f"Schedule {schedule.name!r}: {schedule.n_ranks} ranks, {schedule.n_stages} stages "
        f"({schedule.placement} placement, {schedule.n_virtual} per rank), "
        f"{schedule.n_microbatches} microbatches"
    )
    cols = [[str(a) for a in row] for row in schedule.actions]
    widths = [max([len(f"rank {r}")] + [len(c) for c in col]) for r, col in enumerate(cols)]
    steps = max((len(c) for c in cols), default=0)
    step_w = max(4, len(str(steps)))
    lines = [head, " | ".join([f"{'step':>{step_w}}"] + [f"{f'rank {r}':<{w}}" for r, w in enumerate(widths)])]
    for i in range(steps):
        cells = [f"{col[i] if i < len(col) else '':<{w}}" for col, w in zip(cols, widths)]
        lines.append(" | ".join([f"{i:>{step_w}}"] + cells).rstrip())
    return "\n".join(lines)


def write_csv(schedule: Schedule, path: str | os.PathLike[str] | IO[str] | None, *, header: bool) -> str:
    """See :meth:`Schedule.to_csv`."""
    buf = io.StringIO()
    if header:
        meta = {
            "name": schedule.name,
            "n_stages": schedule.n_stages,
            "n_microbatches": schedule.n_microbatches,
            "placement": schedule.placement,
        }
        buf.write(_HEADER + json.dumps(meta) + "\n")
    writer = csv.writer(buf, lineterminator="\n")
    for row in schedule.actions:
        writer.writerow([str(a) for a in row])
    text = buf.getvalue()
    if path is None:
        return text
    if hasattr(path, "write"):
        path.write(text)  # type: ignore[union-attr]
    else:
        with open(path, "w", newline="") as fh:
            fh.write(text)
    return text


def read_csv(path: str | os.PathLike[str] | IO[str], overrides: dict[str, object]) -> Schedule:
    """See :meth:`Schedule.from_csv`."""
    if hasattr(path, "read"):
        text = path.read()  # type: ignore[union-attr]
    else:
        with open(path, newline="") as fh:
            text = fh.read()
    meta: dict[str, object] = {}
    lines = []
    for line in text.splitlines():
        if line.startswith(_HEADER):
            meta = json.loads(line[len(_HEADER) :])
        elif line.strip() and not line.startswith("#"):
            lines.append(line)
    rows = [[Action.parse(c) for c in cells if c.strip()] for cells in csv.reader(lines)]
    meta.update(overrides)
    return _from_rows(rows, meta)


def _from_rows(rows: list[list[Action]], meta: dict[str, object]) -> Schedule:
    parts = [p for row in rows for a in row for p in a.parts]
    if not rows or not parts:
        raise ScheduleError("the CSV holds no actions")
    n_stages = int(
        meta.get("n_stages")  # type: ignore[arg-type]
        or 1 + max(p.stage for p in parts)
    )
    n_mb = int(
        meta.get("n_microbatches")
        or 1
        + max(  # type: ignore[arg-type]
            (p.microbatch for p in parts if p.microbatch is not None), default=0
        )
    )
    name = str(meta.get("name", "custom"))
    if "placement" in meta:
        return Schedule(
            actions=rows, n_stages=n_stages, n_microbatches=n_mb, placement=str(meta["placement"]), name=name
        )
    errors = []
    for placement in ("loop", "v"):
        try:
            return Schedule(actions=rows, n_stages=n_stages, n_microbatches=n_mb, placement=placement, name=name)
        except ScheduleError as err:
            errors.append(f"{placement}: {err}")
    raise ScheduleError("no stage placement fits the CSV:\n  " + "\n  ".join(errors))

"""Tables of estimates for ``python -m fshard.plan``: text that fits a terminal, or JSON.

The default table fits :data:`WIDTH` columns (the shares of the step, the peak); ``wide``
adds every time and memory field (:data:`COLUMNS`). It is a rich table when ``rich`` is
installed, plain text otherwise, and both are cut to the width: rich's console is given
the width (a captured console has no terminal to ask), and plain text wraps the layout
column. :func:`record` is one estimate as JSON, :func:`fit_note` says when a layout does
not fit, :func:`file_note` names a machine file and its age.
"""

from __future__ import annotations

import datetime
import os
import textwrap
import time
from typing import Any, Sequence

from fshard.plan.estimate import Estimate

__all__ = ["COLUMNS", "SHORT_COLUMNS", "WIDTH", "age", "file_note", "fit_note", "record", "render", "rows", "wrap"]

WIDTH = 100

COLUMNS = (
    "#",
    "layout",
    "step s",
    "tok/s/dev",
    "MFU",
    "compute",
    "exposed comm",
    "bubble",
    "optim",
    "peak GiB",
    "params+grads+opt",
    "gathered",
    "activations",
    "grad buffers",
)

# The default table: the shares of the step beside compute (which is the rest) and the peak.
SHORT_COLUMNS = ("#", "layout", "step s", "tok/s/dev", "MFU", "comm", "bubble", "optim", "peak GiB")
LEGEND = (
    "comm, bubble, optim: shares of the step (communication not hidden behind compute, pipeline "
    "bubble, optimizer); compute is the rest. --wide: seconds and the memory split; --json: every field."
)

# The layout column wraps to no less than this (a five-axis mesh is about 30 characters).
_MIN_LAYOUT = 24


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}" if x >= 2**30 / 10 else f"{x / 2**20:.1f} Mi"


def _gib_text(x: float) -> str:
    """Bytes as GiB: one decimal, or three significant figures below 1 (a tiny limit stays readable)."""
    g = x / 2**30
    return f"{g:.1f}" if g >= 1 else f"{g:.3g}"


def _s(x: float, step: float) -> str:
    return f"{x:.3g} ({x / step:.0%})" if step else f"{x:.3g}"


def _share(x: float, step: float) -> str:
    return f"{x / step:.0%}" if step else "-"


def fit_note(e: Estimate) -> str | None:
    """``"does not fit (needs X GiB of Y GiB)"`` for an estimate above its memory limit, else None."""
    if e.fits or e.memory_limit is None:
        return None
    return f"does not fit (needs {_gib_text(e.peak_bytes)} GiB of {_gib_text(e.memory_limit)} GiB)"


def _label(e: Estimate, wide: bool) -> str:
    # The dtype ends every label but float32's; the default table's title states it instead.
    label = e.layout.label()
    return label if wide else label.removesuffix(f" {e.layout.dtype}")


def _peak(e: Estimate) -> str:
    return _gib(e.peak_bytes) + ("" if e.fits else " *")


def rows(estimates: Sequence[Estimate], *, wide: bool = True) -> list[list[str]]:
    """One row per estimate: of :data:`COLUMNS` (``wide``, the default) or :data:`SHORT_COLUMNS`.

    A peak that does not fit its limit ends in ``" *"`` (:func:`fit_note` says by how much).
    """
    out = []
    for k, e in enumerate(estimates, 1):
        b, m, step = e.breakdown, e.memory, e.step_s
        head = [str(k), _label(e, wide), f"{step:.4g}", f"{e.tokens_per_s / e.layout.n_devices:,.0f}", f"{e.mfu:.1%}"]
        if not wide:
            shares = [_share(b[kind], step) for kind in ("exposed_comm", "bubble", "optimizer")]
            out.append([*head, *shares, _peak(e)])
            continue
        out.append(
            [
                *head,
                _s(b["compute"], step),
                _s(b["exposed_comm"], step),
                _s(b["bubble"], step),
                _s(b["optimizer"], step),
                _peak(e),
                _gib(m["params"] + m["grads"] + m["optimizer"]),
                _gib(m["gathered"]),
                _gib(m["activations"]),
                _gib(m["grad_buffers"] + m["w_pending"]),  # ZB: the gradients held for W too
            ]
        )
    return out


def record(e: Estimate, rank: int | None = None) -> dict[str, Any]:
    """One estimate as JSON-ready data: the layout's fields, the times (s), the memory (GiB), the fit."""
    lay = e.layout
    out: dict[str, Any] = {} if rank is None else {"rank": rank}
    out.update(
        layout=lay.label(),
        mesh=dict(lay.shape),
        batch=lay.batch,
        microbatches=lay.microbatches,
        schedule=lay.schedule if lay.pp > 1 else None,
        virtual=lay.virtual,
        remat=lay.remat,
        reshard=lay.reshard,
        sequence_parallel=lay.sequence_parallel,
        dtype=lay.dtype,
        step_s=e.step_s,
        tokens_per_s_per_device=e.tokens_per_s / lay.n_devices,
        mfu=e.mfu,
        breakdown_s=dict(e.breakdown),
        peak_gib=e.peak_bytes / 2**30,
        memory_gib={k: v / 2**30 for k, v in e.memory.items()},
        memory_limit_gib=None if e.memory_limit is None else e.memory_limit / 2**30,
        fits=e.fits,
        note=fit_note(e),
    )
    return out


def wrap(text: str, width: int | None = WIDTH) -> str:
    """``text`` wrapped to ``width`` columns, continuation lines indented by two (None: as it is).

    Breaks only at spaces: a path or a layout stays whole (and copyable), even where it
    alone is longer than ``width``.
    """
    if width is None:
        return text
    return "\n".join(
        textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
        if line
        else line
        for line in text.split("\n")
    )


def _plain(columns: Sequence[str], body: list[list[str]], width: int | None) -> list[str]:
    lay = columns.index("layout")
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(columns)]
    if width is not None:  # the layout column takes what the others leave, and wraps
        rest = sum(w for i, w in enumerate(widths) if i != lay) + 2 * (len(columns) - 1)
        widths[lay] = min(widths[lay], max(_MIN_LAYOUT, width - rest))
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        parts = textwrap.wrap(r[lay], widths[lay], break_on_hyphens=False) or [""]
        for j, part in enumerate(parts):
            cells = [v if j == 0 else "" for v in r]
            cells[lay] = part
            lines.append("  ".join(v.ljust(w) for v, w in zip(cells, widths)).rstrip())
    return lines


def _rich(columns: Sequence[str], body: list[list[str]], width: int | None) -> list[str] | None:
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return None
    table = Table(box=box.SIMPLE_HEAD)
    for c in columns:
        table.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c != "layout")
    for r in body:
        table.add_row(*r)
    # A captured console asks no terminal for its width: give it one. Wide: the table's own.
    console = Console(width=width or 10_000)
    with console.capture() as cap:
        console.print(table)
    return [line.rstrip() for line in cap.get().split("\n") if line.strip()]  # no blank edges


def render(
    estimates: Sequence[Estimate],
    *,
    title: str = "",
    plain: bool | None = None,
    wide: bool = False,
    width: int | None = WIDTH,
) -> str:
    """The table as text: rich's when available and ``plain`` is not True, else plain text.

    Args:
      estimates: the rows, in order.
      title: a line above the table (optional).
      plain: plain text even when rich is installed (optional, default False).
      wide: every column of :data:`COLUMNS`, and no width limit (optional, default
        False: :data:`SHORT_COLUMNS` and a legend, in ``width`` columns).
      width: the most columns a line may take (optional, default :data:`WIDTH`; None: no
        limit). Ignored with ``wide``.

    Returns:
      The table, then one line per estimate that does not fit its memory limit
      (``#k <layout>: does not fit (needs X GiB of Y GiB)``, its peak marked ``*``).
    """
    width = None if wide else width
    columns = COLUMNS if wide else SHORT_COLUMNS
    body = rows(estimates, wide=wide)
    table = None if plain else _rich(columns, body, width)
    if table is None:
        table = _plain(columns, body, width)
    lines = [wrap(title, width), *table] if title else table  # the title on 100 columns, not the table's
    if not wide and body:
        lines.append(wrap(LEGEND, width))
    for k, e in enumerate(estimates, 1):
        note = fit_note(e)
        if note:
            lines.append(wrap(f"* #{k} {e.layout.label()}: {note}", width))
    return "\n".join(lines)


def age(seconds: float) -> str:
    """A duration in words: ``"40 s"``, ``"12 min"``, ``"3.2 h"``, ``"5 days"``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def file_note(path: str | os.PathLike, *, now: float | None = None) -> str:
    """``"machine file PATH, written YYYY-MM-DD HH:MM UTC (N h ago)"``: the file and how old
    its figures are (its modification time: a calibration writes the file whole)."""
    mtime = os.stat(path).st_mtime
    when = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ago = age((time.time() if now is None else now) - mtime)
    return f"machine file {os.fspath(path)}, written {when} ({ago} ago)"

"""Tables of estimates: a rich table when ``rich`` is installed, plain text otherwise."""

from __future__ import annotations

from typing import Sequence

from fshard.plan.estimate import Estimate

__all__ = ["rows", "render"]

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


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}" if x >= 2**30 / 10 else f"{x / 2**20:.1f} Mi"


def _s(x: float, step: float) -> str:
    return f"{x:.3g} ({x / step:.0%})" if step else f"{x:.3g}"


def rows(estimates: Sequence[Estimate]) -> list[list[str]]:
    """One row of :data:`COLUMNS` per estimate."""
    out = []
    for k, e in enumerate(estimates, 1):
        b, m = e.breakdown, e.memory
        out.append(
            [
                str(k),
                e.layout.label(),
                f"{e.step_s:.4g}",
                f"{e.tokens_per_s / e.layout.n_devices:,.0f}",
                f"{e.mfu:.1%}",
                _s(b["compute"], e.step_s),
                _s(b["exposed_comm"], e.step_s),
                _s(b["bubble"], e.step_s),
                _s(b["optimizer"], e.step_s),
                _gib(e.peak_bytes),
                _gib(m["params"] + m["grads"] + m["optimizer"]),
                _gib(m["gathered"]),
                _gib(m["activations"]),
                _gib(m["grad_buffers"] + m["w_pending"]),
            ]
        )  # ZB: the gradients held for W too
    return out


def render(estimates: Sequence[Estimate], *, title: str = "", plain: bool | None = None) -> str:
    """The table as text (rich's rendering when available and ``plain`` is not True)."""
    body = rows(estimates)
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            table = Table(title=title or None)
            for c in COLUMNS:
                table.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c == "layout")
            for r in body:
                table.add_row(*r)
            console = Console(width=200)
            with console.capture() as cap:
                console.print(table)
            return cap.get()
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(COLUMNS)]
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)

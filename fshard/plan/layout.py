"""The planner's view of a :class:`fshard.parallel.Layout`: its schedule and the model's rules.

``fs.plan.Layout`` is ``fs.parallel.Layout`` (the one description of a layout); this module
adds what needs a model description or a schedule: :func:`check_layout` and
:func:`layout_schedule`.
"""

from __future__ import annotations

import functools
from typing import Any

from fshard.parallel.layout import AXES, DATA_AXES, Layout, LayoutError
from fshard.plan.model import ModelDesc

__all__ = ["AXES", "DATA_AXES", "Layout", "LayoutError", "check_layout", "layout_schedule"]


@functools.lru_cache(maxsize=512)
def _schedule(name: str, pp: int, m: int, virtual: int | None) -> Any:
    from fshard.sched.registry import build_schedule

    return build_schedule(name, pp, m, n_virtual=virtual)


def _splits_backward(schedule: Any) -> bool:
    from fshard.sched.ir import Kind

    return any(p.kind is Kind.I for row in schedule.actions for a in row for p in a.parts)


def layout_schedule(layout: Layout) -> Any:
    """The pipeline schedule (``fs.sched``) of ``layout``, or None without pp (cached).

    Raises:
      LayoutError: the generator rejects the sizes (its reason is quoted).
    """
    if layout.pp == 1:
        return None
    try:
        return _schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    except (ValueError, KeyError) as e:
        raise LayoutError(
            f"Layout.schedule {layout.schedule!r} on pp={layout.pp} with microbatches={layout.microbatches}: {e}"
        ) from None


def check_layout(layout: Layout, model: ModelDesc, n_devices: int | None = None) -> None:
    """Checks that ``layout`` can run ``model`` (:meth:`Layout.validate`, then the model's rules).

    Raises:
      LayoutError: naming the field and the sizes that do not fit.
    """
    layout.validate(n_devices)
    for d in model.tp_divides:
        if d % layout.tp:
            raise LayoutError(
                f"Layout.mesh['tp']={layout.tp} must divide {d} (model {model.name!r}: "
                f"tp_divides {model.tp_divides}, e.g. heads and KV heads)"
            )
    if layout.ep > 1 and (not model.n_experts or model.n_experts % layout.ep):
        raise LayoutError(
            f"Layout.mesh['ep']={layout.ep} needs a model whose experts it divides; "
            f"model {model.name!r} has n_experts={model.n_experts}"
        )
    if layout.sequence_parallel and model.seq_len % layout.tp:
        raise LayoutError(f"Layout.sequence_parallel: seq_len {model.seq_len} must be divisible by tp={layout.tp}")
    if layout.pp > 1:
        sch = layout_schedule(layout)
        if model.n_blocks < sch.n_stages:
            raise LayoutError(
                f"Layout: schedule {layout.schedule!r} on pp={layout.pp} has {sch.n_stages} stages "
                f"but model {model.name!r} has {model.n_blocks} blocks"
            )
        if layout.remat and _splits_backward(sch):
            # Each W group's pass recomputes the checkpointed block (comm_log, pp=2 x tp=2,
            # zb: 13 TP psums per block and microbatch instead of 5).
            raise LayoutError(
                f"Layout.remat with schedule {layout.schedule!r} (backward split into I and W) "
                f"is not modeled: fshard's executor recomputes a checkpointed block in each W "
                f"pass; use remat with 1f1b, gpipe or interleaved"
            )

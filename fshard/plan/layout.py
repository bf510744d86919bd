"""The planner's view of a :class:`fshard.parallel.Layout`: its schedule and the model's rules.

``fs.plan.Layout`` is ``fs.parallel.Layout`` (the one description of a layout); this module
adds what needs a model description or a schedule: :func:`check_layout` (each axis rule's
checks) and :func:`layout_schedule` (from :mod:`fshard.plan.axes.pp`).
"""

from __future__ import annotations

from fshard.parallel.layout import AXES, DATA_AXES, Layout, LayoutError
from fshard.plan.axes import RULES
from fshard.plan.axes.pp import _schedule as _schedule  # re-exported: a schedule by its key, cached
from fshard.plan.axes.pp import layout_schedule
from fshard.plan.model import ModelDesc

__all__ = ["AXES", "DATA_AXES", "Layout", "LayoutError", "check_layout", "layout_schedule"]


def check_layout(layout: Layout, model: ModelDesc, n_devices: int | None = None) -> None:
    """Checks that ``layout`` can run ``model`` (:meth:`Layout.validate`, then each axis
    rule's, :data:`fshard.plan.axes.RULES`).

    Raises:
      LayoutError: naming the field and the sizes that do not fit.
    """
    layout.validate(n_devices)
    for r in RULES:
        r.check(layout, model)

"""One home per parallelism in the planner: ``plan/axes/<name>.py``, one row of :data:`RULES` each.

Each module holds what the planner knows about one parallelism, as an
:class:`~fshard.plan.axes.base.AxisRule`: the layout rules it adds for a model, the sizes
and layout choices the search tries, the spec rule that says what each rank holds, how it
divides a layer's work and activations, the collectives a step issues over it (kind,
axes, bytes per call, count) and its memory terms. The planner's engines iterate
:data:`RULES` instead of naming a parallelism: ``plan/layout.py`` (``check_layout``),
``plan/shards.py`` (sizes per rank), ``plan/comm.py`` (a step's collectives, phase by
phase), ``plan/estimate.py`` (work, activations, gathered copies, pending gradients) and
``plan/search.py`` (mesh sizes and choices).

To add a parallelism (as ``plan/axes/cp.py`` added context parallelism): write a module with
an ``AxisRule`` subclass that overrides the hooks it has something to say to (base.py
lists them; the defaults add nothing), and add its row to :data:`RULES` below. Nothing
else in ``fshard/plan/`` changes.

:data:`RULES` is ordered as the search picks the sizes: the most constrained axes first
(tp within a node and dividing the heads, ep dividing the experts, pp up to the blocks, cp
dividing the sequence), then dp, and fsdp last, taking the devices left. The first rule whose spec rule answers
picks a layer's specs (tp composes fsdp's axis in its own).
"""

from __future__ import annotations

from fshard.plan.axes.base import AxisRule, Collective, LayerShards, Step
from fshard.plan.axes.cp import CP
from fshard.plan.axes.data import DATA
from fshard.plan.axes.ep import EP
from fshard.plan.axes.fsdp import FSDP
from fshard.plan.axes.pp import PP
from fshard.plan.axes.tp import TP

__all__ = ["RULES", "AxisRule", "Collective", "LayerShards", "Step", "rule"]

RULES: tuple[AxisRule, ...] = (TP, EP, PP, CP, DATA, FSDP)


def rule(name: str) -> AxisRule:
    """The rule of mesh axis ``name``.

    Raises:
      KeyError: no rule has that name (the known ones are listed).
    """
    for r in RULES:
        if r.name == name:
            return r
    raise KeyError(f"fs.plan.axes: no rule for axis {name!r}; the rules are {[r.name for r in RULES]}")

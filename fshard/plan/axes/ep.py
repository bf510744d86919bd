"""Expert parallelism (``ep``) in the planner.

- Layout: ``ep`` divides the model's experts (a model without experts takes ep = 1).
- The batch: ep splits its rows, as the data axes do (``fs.parallel.DATA_AXES``).
- Not modeled yet: the all-to-all dispatch and the expert weights' split (no preset or
  traced model has experts); ep counts in the batch split and the loss mean only.
"""

from __future__ import annotations

from fshard.parallel.layout import Layout, LayoutError
from fshard.plan.axes.base import AxisRule, divisors
from fshard.plan.machine import Machine
from fshard.plan.model import ModelDesc

__all__ = ["EP"]


class ExpertParallel(AxisRule):
    name = "ep"
    splits_batch = True

    def check(self, layout: Layout, model: ModelDesc) -> None:
        if layout.ep > 1 and (not model.n_experts or model.n_experts % layout.ep):
            raise LayoutError(
                f"Layout.mesh['ep']={layout.ep} needs a model whose experts it divides; "
                f"model {model.name!r} has n_experts={model.n_experts}"
            )

    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        return [e for e in divisors(rest) if e == 1 or (model.n_experts and model.n_experts % e == 0)]


EP = ExpertParallel()

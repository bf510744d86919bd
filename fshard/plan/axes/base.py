"""What a parallelism tells the planner: :class:`AxisRule`'s hooks, and the records they pass.

A rule answers for one mesh axis. The planner's engines (``plan/layout.py``,
``plan/shards.py``, ``plan/comm.py``, ``plan/estimate.py``, ``plan/search.py``) call every
rule of :data:`fshard.plan.axes.RULES` and combine the answers; a hook a parallelism has
nothing to say to keeps the default here (no rule, no collective, no memory, no division).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from fshard.parallel.layout import Layout
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, LayerDesc, ModelDesc
from fshard.plan.trace import Work

__all__ = ["AxisRule", "Collective", "LayerShards", "Step", "divisors", "flat_bytes"]


@attrs.frozen
class Collective:
    """One kind of collective call a step issues on one rank.

    Attributes:
      kind: ``comm_log``'s kind: ``all_gather``, ``psum_scatter``, ``psum``, ``pmax``,
        ``send``, ``recv``, ``broadcast``.
      axes: the mesh axes it runs over.
      nbytes: payload per call (the input this rank contributes, as ``comm_log`` counts).
      count: calls.
      what: where it comes from (``"fsdp gather block"``, ``"tp exit"``, ...).
      hide: the compute it may overlap: ``"fwd"`` / ``"bwd"`` (one block's forward or
        backward), or ``None`` (on the critical path).
      pipeline: issued inside the pipeline's per-microbatch actions (its time belongs to
        F, I or W: ``"F"``, ``"I"``, ``"W"``), or ``""``.
      logged: ``comm_log`` sees it (``fs.optim.global_norm``'s scalar all-reduces call
        torch.distributed directly and are not logged).
      peak_nbytes: what the busiest rank of the group moves, when more than ``nbytes``
        (a ragged exchange under routing skew): its time is priced on it; 0: ``nbytes``.
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    count: int = 1
    what: str = ""
    hide: str | None = None
    pipeline: str = ""
    logged: bool = True
    peak_nbytes: int = 0


@attrs.frozen
class LayerShards:
    """One layer's parameter sizes on one rank (rank 0 of every axis: the largest blocks).

    Attributes:
      local: elements this rank stores (its shard over every axis).
      flat: elements this rank contributes to the FSDP all-gather (padded rows); 0 when
        the layer is not sharded over fsdp.
      gathered: elements after the FSDP gather (still split over tp): the flat buffer
        of all fsdp ranks, ``flat * fsdp``; ``local`` when nothing is gathered.
      full: elements of the whole layer (no axis).
      over_ep: elements of this rank's gradient shard (``flat`` under FSDP, else
        ``local``) whose leaves ep does not split: replicated over ep, their gradients
        summed over it (0 when ep = 1).
    """

    local: int
    flat: int
    gathered: int
    full: int
    over_ep: int = 0

    def __add__(self, other: LayerShards) -> LayerShards:
        return LayerShards(*(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other))))

    def __mul__(self, k: int) -> LayerShards:
        return LayerShards(*(a * k for a in attrs.astuple(self)))


@attrs.frozen
class Step:
    """Where in a step a rule is asked for its collectives (see :meth:`AxisRule.collectives`).

    Attributes:
      model, layout: what runs.
      pipeline: a pipeline step (``fs.sched.pipeline_step``) rather than a flat one
        (``scan_layers`` with gradient accumulation).
      layers: ``(layer index, calls)`` run in this phase (forward and backward each).
      shards: flat step: the repeated block's sizes; pipeline: this stage's (all its layers).
      root: flat step: the other layers' sizes, summed (one group); pipeline: None.
      first, last: pipeline: the first / last stage this rank holds, in its list order.
      lowest: pipeline: the lowest-numbered stage this rank holds (its backward ends last).
      pp_rank: pipeline: the rank's position on pp.
    """

    model: ModelDesc
    layout: Layout
    pipeline: bool = False
    layers: tuple[tuple[int, int], ...] = ()
    shards: LayerShards | None = None
    root: LayerShards | None = None
    first: bool = True
    last: bool = True
    lowest: bool = True
    pp_rank: int = 0


def flat_bytes(numel: int, dtype: str) -> int:
    """Bytes of ``numel`` elements of ``dtype`` (a name of ``DTYPE_BYTES``)."""
    return numel * DTYPE_BYTES[dtype]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


class AxisRule:
    """One parallelism's rules for the planner; subclasses override the hooks they need.

    Attributes:
      name: the mesh axis (``fs.parallel.AXES``).
      splits_batch: the axis splits the batch's rows (``fs.parallel.DATA_AXES``).
      shards_params: the spec rules split parameters over it (the global norm sums over it).
      gathers_params: parameters are gathered over it before use (FSDP's flat buffer).
      takes_rest: the search gives it the devices the other axes leave (at most one rule).
    """

    name: str = ""
    splits_batch: bool = False
    shards_params: bool = False
    gathers_params: bool = False
    takes_rest: bool = False

    # -- layout -----------------------------------------------------------------------
    def check(self, layout: Layout, model: ModelDesc) -> None:
        """Raises ``LayoutError`` (naming the field and sizes) if ``layout`` cannot run ``model``."""

    # -- search -----------------------------------------------------------------------
    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        """Sizes the search tries for this axis, given ``rest`` devices left (each divides it)."""
        return [rest] if self.takes_rest else divisors(rest)

    def choices(self, options: Any, mesh: Mapping[str, int]) -> dict[str, list[Any]]:
        """Layout fields the search tries on ``mesh``, each with its values (from the
        search's ``options``, a ``SearchConfig``); ``{}`` when the axis adds none."""
        return {}

    # -- what each rank holds ---------------------------------------------------------
    def param_specs(self, tree: dict, tp_plan: dict, sizes: Mapping[str, int]) -> dict | None:
        """The spec rules' specs of one layer's meta ``tree`` when this axis picks them
        (the first rule in :data:`RULES` that returns some wins), else None."""
        return None

    # -- work and activations ---------------------------------------------------------
    def split_divisor(self, layout: Layout) -> int:
        """What the axis divides a layer's ``*_split`` work, saved and W-gradient bytes by."""
        return 1

    def rest_divisor(self, layout: Layout) -> int:
        """What it divides the rest of a layer's work (and W-gradient and boundary bytes) by."""
        return 1

    def extra_kernels(self, layer: LayerDesc, phase: str, layout: Layout, model: ModelDesc) -> float:
        """Kernels the axis adds to one call of ``layer``'s ``phase`` (``fwd``, ``bwd_input``,
        ``bwd_weight``) on one rank, beyond the ones the layer's trace counted."""
        return 0.0

    def extra_work(self, layer: LayerDesc, phase: str, layout: Layout) -> Work:
        """Work per sample (in the model's dtype) the axis adds to one call of ``layer``'s
        ``phase`` on the busiest rank (ep: the expert rows routing skew sends it beyond the
        mean), not divided by any axis."""
        return Work()

    def saved_divisor(self, layout: Layout) -> int:
        """What it divides the rest of a layer's saved-for-backward bytes by (the split part
        takes :meth:`split_divisor`)."""
        return 1

    def saved_extra(self, layer: LayerDesc, layout: Layout) -> float:
        """Saved-for-backward bytes per sample (model dtype) the axis adds to a layer call."""
        return 0.0

    # -- collectives ------------------------------------------------------------------
    def collectives(self, step: Step, phase: str) -> list[Collective]:
        """What the axis issues in ``phase`` of ``step``, on one rank.

        Phases, in the order a step runs them: a flat step, per microbatch, ``"gather"``,
        ``"layers"``, ``"loss"``, ``"regather"``, then on the last one ``"reduce"``,
        ``"replicas"``; a pipeline step, per held stage ``"gather"``, ``"layers"``, then
        ``"p2p"``, per held stage ``"reduce"``, ``"replicas"``, then ``"broadcast"``, ``"loss"``.
        """
        return []

    # -- memory -----------------------------------------------------------------------
    def gathered(self, step: Step, machine: Machine) -> tuple[float, float, float]:
        """Flat step: bytes of parameter copies made for compute, ``(root layers, one
        block, blocks alive in forward)``."""
        return (0.0, 0.0, 0.0)

    def stage_gathered(self, layout: Layout, shards: LayerShards) -> float:
        """Pipeline: bytes of one held stage's parameter copies made for compute."""
        return 0.0

    def pending_grads(self, step: Step, full_grads: float) -> float:
        """Flat step: full-size gradient bytes waiting for this axis's reduction during the
        last block's backward (``full_grads``: every layer's gathered gradients)."""
        return 0.0

    def reduced_grads(self, step: Step) -> float | None:
        """Flat step: gradient bytes already reduced to shards at the last block's backward,
        or None when the axis does not reduce during backward."""
        return None

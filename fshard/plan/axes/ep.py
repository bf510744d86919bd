"""Expert parallelism (``ep``: dropless experts, ``fs.parallel.moe_ffn(capacity_factor=None)``) in the planner.

- Layout: ``ep`` (times ``fsdp``) divides the model's experts: whole experts per rank
  (a model without experts takes ep = 1). What the recipes do not build is refused: experts
  with tp or cp, and pp x ep with dp or cp but no fsdp.
- The batch: ep splits its rows, as the data axes do (``fs.parallel.DATA_AXES``).
- Holds: ``fs.parallel.ep_specs`` (expert leaves' dim 0 over ep, then fsdp; the rest
  as fsdp's or replicated).
- Work: each rank receives, on average, as many routed rows as it sends (``N k`` for ``N``
  local tokens), so ep divides no work; the busiest rank receives ``skew`` times that
  (:attr:`fshard.plan.model.Experts.skew`), which scales its expert GEMMs and their saved
  bytes.
- Collectives per MoE layer call: one ``all_gather`` of the ``E`` int64 counts (the
  sizes), then ``ragged_all_to_all`` dispatch and combine forward and their transposes
  backward, each moving ``N k D`` rows' bytes (the busiest rank: ``skew`` times that
  where it receives); remat runs the forward's again. Every one is on the critical
  path (its result is the next op's input, and the sizes are read on the host). The
  leaves ep does not split (everything but the experts) have their gradients summed
  over ep (``fs.parallel``'s Groups: one extra all-reduce per block, ``over_ep``
  elements; the root layers with the other replicas, see ``plan/axes/data.py``).
"""

from __future__ import annotations

from typing import Mapping

from fshard.parallel.layout import Layout, LayoutError
from fshard.plan.axes.base import AxisRule, Collective, Step, divisors, flat_bytes
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, LayerDesc, ModelDesc
from fshard.plan.trace import Work

__all__ = ["EP", "COUNT_BYTES"]

COUNT_BYTES = 8  # the dropless dispatch's per-expert counts are int64


class ExpertParallel(AxisRule):
    name = "ep"
    splits_batch = True
    shards_params = True

    def check(self, layout: Layout, model: ModelDesc) -> None:
        ep, label = layout.ep, layout.label()
        if ep > 1 and (not model.n_experts or model.n_experts % ep):
            raise LayoutError(
                f"Layout.mesh['ep']={ep} needs a model whose experts it divides; "
                f"model {model.name!r} has n_experts={model.n_experts}"
            )
        if not any(layer.experts for layer in model.layers):
            return
        if ep > 1 and layout.fsdp > 1 and model.n_experts % (ep * layout.fsdp):
            raise LayoutError(
                f"{label}: ep x fsdp = {ep * layout.fsdp} must divide the {model.n_experts} experts of model "
                f"{model.name!r} (fs.parallel.ep_specs shards each expert leaf's dim 0 over both): use a "
                f"smaller ep or fsdp"
            )
        for axis in ("tp", "cp"):
            if layout.size(axis) > 1:
                raise LayoutError(
                    f"{label}: model {model.name!r} has experts, and the planner (like the recipes) does not "
                    f"model them split over {axis}={layout.size(axis)}: leave {axis} out"
                )
        if ep > 1 and layout.pp > 1 and layout.fsdp == 1 and layout.dp > 1:
            raise LayoutError(
                f"{label}: pp x ep with dp={layout.dp} but no fsdp is not built by the recipes "
                f"(a pipeline leaves leaves split over a data axis to the stage body): add fsdp, or leave dp out"
            )

    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        return [e for e in divisors(rest) if e == 1 or (model.n_experts and model.n_experts % e == 0)]

    def param_specs(self, tree: dict, tp_plan: dict, sizes: Mapping[str, int]) -> dict | None:
        if sizes.get("ep", 1) == 1:
            return None
        from fshard.parallel.ep import ep_specs
        from fshard.parallel.specs import fsdp_specs, replicate_specs

        fsdp = "fsdp" if sizes.get("fsdp", 1) > 1 else None
        base = fsdp_specs(tree, fsdp) if fsdp else replicate_specs(tree)
        return ep_specs(tree, "ep", fsdp_axis=fsdp, base=base)

    def extra_work(self, layer: LayerDesc, phase: str, layout: Layout) -> Work:
        e = layer.experts
        if e is None or layout.ep == 1 or e.skew == 1:
            return Work()
        w = getattr(e, phase)
        return Work(w.flops * (e.skew - 1), w.bytes * (e.skew - 1), 0.0)

    def saved_extra(self, layer: LayerDesc, layout: Layout) -> float:
        e = layer.experts
        return 0.0 if e is None or layout.ep == 1 else e.act_bytes * (e.skew - 1)

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        model, layout = step.model, step.layout
        if layout.ep == 1:
            return []
        if phase == "layers":
            out: list[Collective] = []
            for i, calls in step.layers:
                out += ep_layer(model, layout, i, calls, pipeline=step.pipeline)
            return out
        if phase != "replicas":
            return []
        sh = step.shards
        assert sh is not None
        whole = sh.flat if layout.fsdp > 1 else sh.local
        if sh.over_ep in (0, whole):  # nothing split over ep, or nothing else: summed with the other replicas (data.py)
            return []
        n = 1 if step.pipeline else model.layers[model.repeated].count  # per stage, or per block
        what = "ep all-reduce " + ("stage" if step.pipeline else "block") + " (not experts)"
        return [Collective("psum", ("ep",), flat_bytes(sh.over_ep, layout.master_dtype), n, what)]


def ep_layer(model: ModelDesc, layout: Layout, i: int, calls: int, *, pipeline: bool) -> list[Collective]:
    """The dropless dispatch's collectives of ``calls`` forward + backward calls of layer ``i``."""
    layer = model.layers[i]
    e = layer.experts
    if e is None or not calls:
        return []
    rows = layout.microbatch_size * model.seq_len * e.top_k  # routed rows a rank sends per call
    x = rows * model.hidden * DTYPE_BYTES[layout.dtype]
    busy = int(x * e.skew)  # the busiest rank receives skew times the mean
    fwd = calls * (2 if layout.remat and i == model.repeated else 1)  # remat routes again
    F, I = ("F", "I") if pipeline else ("", "")
    ax = ("ep",)
    what = f"ep {{}} {layer.name}"
    return [
        Collective("all_gather", ax, COUNT_BYTES * e.n_experts, fwd, what.format("sizes"), None, F),
        Collective("ragged_all_to_all", ax, x, fwd, what.format("dispatch"), None, F, peak_nbytes=busy),
        Collective("ragged_all_to_all", ax, busy, fwd, what.format("combine"), None, F, peak_nbytes=busy),
        Collective("ragged_all_to_all", ax, x, calls, what.format("combine grad"), None, I, peak_nbytes=busy),
        Collective("ragged_all_to_all", ax, busy, calls, what.format("dispatch grad"), None, I, peak_nbytes=busy),
    ]


EP = ExpertParallel()

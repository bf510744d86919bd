"""Fully sharded data parallelism (``fsdp``: ``scan_layers``' flat buffers, ``StageFSDP``) in the planner.

- The search: fsdp takes the devices the other axes leave; it tries the reshard choices
  that differ from the step's default (a flat step reshards, a pipeline keeps).
- Holds: ``fs.parallel.fsdp_specs`` when tensor parallelism does not pick the specs;
  parameters are gathered over fsdp into each group's flat buffer (padded rows).
- Collectives: a flat step gathers the root group and each block (the blocks after the
  first overlap the previous block's forward), regathers them in backward (reshard, remat),
  and reduce-scatters each group's gradients; a pipeline gathers each stage once per step
  (or per action with reshard) and reduce-scatters it after its last W.
- Memory: the gathered (or cast) copies alive under prefetch and reshard with the
  backend's gather buffers, and the full-size gradients of the block in backward beside
  one reduce-scatter in flight.
"""

from __future__ import annotations

from typing import Any, Mapping

from fshard.parallel.layout import Layout
from fshard.plan.axes.base import AxisRule, Collective, LayerShards, Step, flat_bytes
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES

__all__ = ["FSDP"]


class FullyShardedDataParallel(AxisRule):
    name = "fsdp"
    splits_batch = True
    shards_params = True
    gathers_params = True
    takes_rest = True

    def choices(self, options: Any, mesh: Mapping[str, int]) -> dict[str, list[Any]]:
        flat = mesh["pp"] == 1
        # reshard=True is a flat step's default (None), reshard=False a pipeline's
        return {"reshard": [r for r in (options.reshard if mesh["fsdp"] > 1 else (None,)) if r is None or r != flat]}

    def param_specs(self, tree: dict, tp_plan: dict, sizes: Mapping[str, int]) -> dict | None:
        if sizes.get("fsdp", 1) == 1:
            return None
        from fshard.parallel.specs import fsdp_specs

        return fsdp_specs(tree, "fsdp")

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        layout = step.layout
        fsdp = layout.fsdp
        if fsdp == 1 or phase not in ("gather", "regather", "reduce"):
            return []
        sh, pdt, rdt, fa = step.shards, layout.dtype, layout.master_dtype, ("fsdp",)
        assert sh is not None
        if step.pipeline:
            if phase == "gather":
                n = 1 if layout.reshard is not True else layout.microbatches * 3
                hide = None if step.first else "fwd"
                return [Collective("all_gather", fa, flat_bytes(sh.flat, pdt), n, "stage fsdp gather", hide)]
            if phase == "reduce":
                hide = None if step.lowest else "bwd"
                full = flat_bytes(sh.flat * fsdp, rdt)
                return [Collective("psum_scatter", fa, full, 1, "stage fsdp reduce-scatter", hide)]
            return []
        root = step.root
        assert root is not None
        L = step.model.layers[step.model.repeated].count
        block = flat_bytes(sh.flat, pdt)
        if phase == "gather":
            return [
                Collective("all_gather", fa, flat_bytes(root.flat, pdt), 1, "fsdp gather root"),
                Collective("all_gather", fa, block, 1, "fsdp gather block"),
                Collective("all_gather", fa, block, L - 1, "fsdp gather block", "fwd"),
            ]
        if phase == "regather":
            out = []
            if layout.resharding and not layout.remat:
                out.append(Collective("all_gather", fa, block, L, "fsdp regather block", "bwd"))
            if layout.remat:  # the recomputation gathers again
                out.append(Collective("all_gather", fa, block, L, "fsdp remat gather block", "bwd"))
            return out
        if phase == "reduce":
            full = flat_bytes(sh.flat * fsdp, rdt)
            return [
                Collective("psum_scatter", fa, full, L - 1, "fsdp reduce-scatter block", "bwd"),
                Collective("psum_scatter", fa, full, 1, "fsdp reduce-scatter block"),
                Collective("psum_scatter", fa, flat_bytes(root.flat * fsdp, rdt), 1, "fsdp reduce-scatter root"),
            ]
        return []

    def gathered(self, step: Step, machine: Machine) -> tuple[float, float, float]:
        layout, sh, root = step.layout, step.shards, step.root
        assert sh is not None and root is not None
        L = step.model.layers[step.model.repeated].count
        pb = DTYPE_BYTES[layout.dtype]
        fsdp, tmp = layout.fsdp, machine.comm_temporaries
        copies = fsdp > 1 or layout.dtype != layout.master_dtype
        gathered_root = root.gathered * pb if copies else 0.0
        block_gathered = sh.gathered * pb if copies else 0.0
        in_flight = min(L, layout.prefetch + 1) if fsdp > 1 else 0  # the regather and its prefetch
        if layout.resharding or layout.remat:
            gathered_fwd = min(L, layout.prefetch + 1) * block_gathered
        else:  # kept from forward to backward
            gathered_fwd = L * block_gathered
        gathered_fwd += tmp * in_flight * sh.gathered * pb  # the backend's gather buffers
        return gathered_root, block_gathered, gathered_fwd

    def stage_gathered(self, layout: Layout, shards: LayerShards) -> float:
        if layout.fsdp > 1 or layout.dtype != layout.master_dtype:
            return shards.gathered * DTYPE_BYTES[layout.dtype]
        return 0.0

    def pending_grads(self, step: Step, full_grads: float) -> float:
        if step.layout.fsdp == 1:
            return 0.0
        assert step.shards is not None
        L = step.model.layers[step.model.repeated].count
        block_grads = step.shards.gathered * DTYPE_BYTES[step.layout.master_dtype]
        # The block in backward makes its full-size gradients while one reduce-scatter, the
        # previous block's, is in flight (fs.parallel's Groups.reduce finishes it when the
        # next one starts), holding one full-size buffer: its input until the wait on NCCL;
        # on gloo the input goes when the all-to-all completes, its receive buffer (as
        # large) at the wait.
        return block_grads + min(1, L - 1) * block_grads

    def reduced_grads(self, step: Step) -> float | None:
        if step.layout.fsdp == 1:
            return None
        assert step.shards is not None
        # At the last block's backward the other blocks' gradients are reduced to shards; the
        # root group's reduction waits until the end of backward.
        L = step.model.layers[step.model.repeated].count
        return (L - 1) * step.shards.local * DTYPE_BYTES[step.layout.master_dtype]


FSDP = FullyShardedDataParallel()

"""Context parallelism (``cp``: each sequence split over the axis, ``fs.parallel.ring_attention``)
in the planner.

- Layout: ``2 x cp`` divides the sequence (the head-tail chunks); the search tries those sizes.
- Holds: the parameters are replicated over cp, as over dp.
- Work: every per-token part of a layer (the split and the rest) and its saved, W-gradient
  and boundary bytes are divided by cp. The balanced ring makes attention's work equal on
  every rank; with a flash kernel per block (the CPU's) that is ``1 / cp`` of one process's
  causal work; with the formula (CUDA here) a rank computes ``(2 cp + 1) c^2`` scores, not the
  ``cp c^2`` a causal kernel would (``c = T / 2 cp``), which this rule does not add.
- Collectives: per block call, ``cp - 1`` transfers of the stacked K/V block over the ring in
  forward (each in flight while the block before it is attended to: hidden behind the
  block's forward); in backward (the explicit one) ``cp - 1`` again, hidden the same way, and
  ``cp`` of the blocks' gradients, one after each step (on the critical path); remat repeats
  the forward's. The loss mean and the gradients' all-reduce
  run over cp with the data axes (``plan/axes/data.py``).
- Kernels: the ring's blocks, merges and transfers are separate kernels, about ``46 cp`` more
  in a block's forward and ``52 cp`` in its backward than one SDPA (each costs the machine's
  per-kernel host time).
"""

from __future__ import annotations

from fshard.parallel.layout import Layout, LayoutError
from fshard.plan.axes.base import AxisRule, Collective, Step, divisors
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, LayerDesc, ModelDesc

__all__ = ["CP", "RING_BWD_KERNELS", "RING_FWD_KERNELS", "ring_payload"]

# Kernels one causal ring_attention call adds on a rank beyond one SDPA, as (per cp rank,
# constant): its blocks, merges and transfers run one by one (fshard's balanced ring with the
# explicit backward; tests/plan/test_plan_axes.py counts them).
RING_FWD_KERNELS = (46, -23)
RING_BWD_KERNELS = (52, -16)


def ring_payload(model: ModelDesc, layout: Layout, layer: LayerDesc) -> int:
    """Bytes of one ring transfer: a microbatch's K and V blocks, ``2 x (b, T / cp, D / tp)``.

    At the queries' width: ``ring_attention`` takes K and V with q's heads (GQA's shared heads
    repeated first), so a GQA model sends ``n_heads / n_kv_heads`` times its K/V projection.
    """
    tokens = model.seq_len // layout.cp
    width = model.hidden // layout.tp
    return int(2 * layout.microbatch_size * tokens * width * DTYPE_BYTES[layout.dtype])


class ContextParallel(AxisRule):
    name = "cp"

    def check(self, layout: Layout, model: ModelDesc) -> None:
        if layout.cp > 1 and model.seq_len % (2 * layout.cp):
            raise LayoutError(
                f"Layout.mesh['cp']={layout.cp} cuts each sequence into 2 x cp = {2 * layout.cp} head-tail "
                f"chunks, but model {model.name!r} has seq_len {model.seq_len}; pick a cp size whose double "
                f"divides it"
            )

    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        return [c for c in divisors(rest) if c == 1 or model.seq_len % (2 * c) == 0]

    def split_divisor(self, layout: Layout) -> int:
        return layout.cp

    def rest_divisor(self, layout: Layout) -> int:
        return layout.cp

    def saved_divisor(self, layout: Layout) -> int:
        return layout.cp

    def extra_kernels(self, layer: LayerDesc, phase: str, layout: Layout, model: ModelDesc) -> float:
        if layout.cp == 1 or layer is not model.layers[model.repeated]:
            return 0.0
        per_rank, base = {"fwd": RING_FWD_KERNELS, "bwd_input": RING_BWD_KERNELS}.get(phase, (0, 0))
        return per_rank * layout.cp + base

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        layout, model = step.layout, step.model
        if phase != "layers" or layout.cp == 1:
            return []
        out: list[Collective] = []
        F, I = ("F", "I") if step.pipeline else ("", "")
        for i, calls in step.layers:
            if i != model.repeated or not calls:  # the blocks attend; embedding and head do not
                continue
            layer = model.layers[i]
            nbytes, hops = ring_payload(model, layout, layer), layout.cp - 1
            fwd_calls = calls * (2 if layout.remat else 1)
            out.append(Collective("ppermute", ("cp",), nbytes, hops * fwd_calls, f"cp ring {layer.name}", "fwd", F))
            # backward: K/V go round again (in flight during each step's blocks), and their
            # gradients travel one hop after each step, the last one home (on the path)
            out.append(Collective("ppermute", ("cp",), nbytes, hops * calls, f"cp ring again {layer.name}", "bwd", I))
            out.append(
                Collective("ppermute", ("cp",), nbytes, layout.cp * calls, f"cp ring grad {layer.name}", None, I)
            )
        return out


CP = ContextParallel()

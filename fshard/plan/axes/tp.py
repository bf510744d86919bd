"""Tensor parallelism (``tp``, Megatron-style, optionally with sequence parallelism) in the planner.

- Layout: ``tp`` divides every ``model.tp_divides`` (heads, KV heads). Sequence parallelism
  splits a microbatch's rows over tp when tp divides them (``fs.parallel.tp_embed``'s
  ``seq_dim=0``, what fshard's recipes run), else the sequence (``seq_dim=1``, Megatron's
  split), which needs ``seq_len`` divisible by tp. The search keeps tp within a node.
- Holds: ``fs.parallel.tp_specs`` (composing FSDP's axis when there is one).
- Work: tp divides each layer's split work, saved and W-gradient bytes; with sequence
  parallelism the rest of the work and W-gradient bytes too. Over the sequence each region
  entry saves half an activation more (the gathered sequence is not contiguous); over the
  rows the gather lands in place.
- Collectives: per region entry and exit a psum (Megatron's f and g), or with sequence
  parallelism an all-gather / reduce-scatter pair; the replicated parameters' gradient
  psum under SP; the vocab-parallel loss's fixed collectives.
"""

from __future__ import annotations

from typing import Any, Mapping

from fshard.parallel.layout import Layout, LayoutError
from fshard.plan.axes.base import AxisRule, Collective, Step, divisors
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, LayerDesc, ModelDesc

__all__ = ["TP", "tp_layer"]


def tp_layer(
    model: ModelDesc, layout: Layout, i: int, samples: int, calls: int, *, remat: bool, pipeline: bool
) -> list[Collective]:
    """Tensor-parallel collectives of ``calls`` forward + backward calls of layer ``i``."""
    layer = model.layers[i]
    tp = layout.tp
    if tp == 1 or not calls:
        return []
    s = DTYPE_BYTES[layout.dtype]
    act = int(samples * (model.seq_len // layout.cp) * model.hidden * s)  # one (b, T, D) activation (T / cp)
    sp = layout.sequence_parallel
    ax = ("tp",)
    F, I = ("F", "I") if pipeline else ("", "")
    fwd_calls = calls * (2 if remat else 1)  # remat runs the forward again in backward ...
    # ... but stops after the last tensor backward needs: the block's final exit is not redone.
    exit_calls = calls * (2 * layer.tp_exit - 1) if remat and layer.tp_exit else layer.tp_exit * fwd_calls
    out: list[Collective] = []

    def add(kind: str, nbytes: int, n: int, what: str, phase: str) -> None:
        if n:
            out.append(Collective(kind, ax, nbytes, n, f"tp {what} {layer.name}", None, phase))

    if sp:
        add("all_gather", act // tp, layer.tp_enter * fwd_calls, "enter", F)
        add("psum_scatter", act, exit_calls, "exit", F)
        add("psum_scatter", act, layer.tp_enter * calls, "enter grad", I)
        add("all_gather", act // tp, layer.tp_exit * calls, "exit grad", I)
        add("psum", layer.sp_param_numel * s, calls if layer.sp_param_numel else 0, "sp params grad", I)
    else:
        add("psum", act, exit_calls, "exit", F)
        add("psum", act, layer.tp_enter * calls, "enter grad", I)
    # Extra collectives are described in float32 (the loss's softmax runs in at least fp32).
    k = max(4, s) / 4
    for kind, phase, per_sample in layer.tp_extra:
        n = fwd_calls if phase == "fwd" else calls
        what = "loss" if layer.loss else "extra"
        add(kind, int(per_sample * samples * k / layout.cp), n, what, F if phase == "fwd" else I)
    return out


class TensorParallel(AxisRule):
    name = "tp"
    shards_params = True

    def check(self, layout: Layout, model: ModelDesc) -> None:
        for d in model.tp_divides:
            if d % layout.tp:
                raise LayoutError(
                    f"Layout.mesh['tp']={layout.tp} must divide {d} (model {model.name!r}: "
                    f"tp_divides {model.tp_divides}, e.g. heads and KV heads)"
                )
        if layout.sequence_parallel and not _sp_over_rows(layout) and model.seq_len % layout.tp:
            raise LayoutError(
                f"Layout.sequence_parallel splits a microbatch's rows or its sequence over tp={layout.tp}, but tp "
                f"divides neither the {layout.microbatch_size} rows (Layout.batch {layout.batch} / "
                f"{layout.microbatches} microbatches / {layout.n_data} data ranks) nor seq_len {model.seq_len}; "
                f"change the batch or the sequence length, or leave sequence_parallel out"
            )

    def sizes(self, model: ModelDesc, machine: Machine, rest: int) -> list[int]:
        return [
            t for t in divisors(rest) if all(d % t == 0 for d in model.tp_divides) and t <= machine.devices_per_node
        ]

    def choices(self, options: Any, mesh: Mapping[str, int]) -> dict[str, list[Any]]:
        return {"sequence_parallel": list(options.sequence_parallel) if mesh["tp"] > 1 else [False]}

    def param_specs(self, tree: dict, tp_plan: dict, sizes: Mapping[str, int]) -> dict | None:
        if sizes.get("tp", 1) == 1:
            return None
        from fshard.parallel.tp import tp_specs

        return tp_specs(tree, tp_plan, "tp", fsdp_axis="fsdp" if sizes.get("fsdp", 1) > 1 else None)

    def split_divisor(self, layout: Layout) -> int:
        return layout.tp

    def rest_divisor(self, layout: Layout) -> int:
        return layout.tp if layout.sequence_parallel else 1

    def saved_extra(self, layer: LayerDesc, layout: Layout) -> float:
        if not layout.sequence_parallel or _sp_over_rows(layout):
            return 0.0
        # Over the sequence autograd keeps about half a whole activation more per region
        # entry: the sequence-dim all-gather's result is not contiguous, so the matmuls save
        # a contiguous copy while the gathered buffer stays alive too. The rows' gather
        # lands (B, T, D) in place. Measured on fshard's TP block at tp=2
        # (tests/plan/test_plan_estimate.py::test_sp_saved_bytes_follow_the_tp_block).
        return layer.tp_enter * layer.out_bytes / 2

    def collectives(self, step: Step, phase: str) -> list[Collective]:
        if phase != "layers":
            return []
        model, layout = step.model, step.layout
        out: list[Collective] = []
        for i, calls in step.layers:
            remat = layout.remat and i == model.repeated
            out += tp_layer(model, layout, i, layout.microbatch_size, calls, remat=remat, pipeline=step.pipeline)
        return out


def _sp_over_rows(layout: Layout) -> bool:
    """Whether sequence parallelism splits each microbatch's rows (else its sequence)."""
    return layout.microbatch_size % layout.tp == 0


TP = TensorParallel()

"""``estimate(model, machine, layout)``: predicted step time and peak memory per rank.

Time, per rank::

    step = compute (forward + backward [+ recompute] of every microbatch)
         + exposed communication (TP collectives on the critical path; FSDP / DDP
           collectives beyond what ``machine.overlap`` hides behind a block's compute;
           the first gathers and last reductions; in a flat step on CPU ranks that
           outnumber their cores, ``sync_overhead_s`` per blocking call)
         + pipeline bubble (fs.sched.simulate of the schedule with this layout's F, I, W
           and point-to-point times; the slowest rank's costs; on CPU nodes each posted
           send or receive costs its rank the point-to-point latency, and the edge the
           bytes' time; CPU ranks that outnumber their cores compute faster by the share
           the bubble leaves idle)
         + optimizer (AdamW + global norm over this rank's shards, traced; its bytes at
           ``optimizer_mem_efficiency`` of the bandwidth, a host time per leaf)

A layer phase costs ``samples * (flops / F + bytes / BW) + kernels * overhead`` (plus the
machine's fixed host cost per forward or backward call, ``layer_overhead_s``; a flat
step's body also costs ``call_overhead_s`` once per microbatch, and a pipeline stage's
forward and backward half of it each), with the
work the model description gives, divided by tp where tensor parallelism splits it
(and the rest by tp too under sequence parallelism).

Memory, per rank, by kind: parameters, gradients and AdamW state (sharded by the spec
rules), gathered parameters alive under the prefetch / reshard settings, activations
(all microbatches a pipeline rank holds at its simulated peak; remat keeps only block
inputs), and the step's full-size gradient buffers (FSDP: the gradients of the block in backward
and one reduce-scatter in flight; gradient accumulation keeps unreduced
gradients between microbatches; a pipeline stage accumulates gathered gradients), and for
schedules that split backward into I and W the gradients I captured for W of the
microbatches between the two (``w_pending``; :func:`held_states` walks each rank's
actions for when they are held).
"""

from __future__ import annotations

import functools
import math
import numbers
from fractions import Fraction
from typing import Any, Callable, Mapping

import attrs

from fshard.plan.axes import RULES
from fshard.plan.axes.pp import held_peak, held_states, held_states_of, schedule_of
from fshard.plan.comm import (
    Collective,
    collective_time,
    flat_step,
    p2p_counts,
    pipeline_payload,
    step_collectives,
)
from fshard.plan.layout import Layout, check_layout, layout_schedule
from fshard.plan.machine import Machine
from fshard.plan.model import DTYPE_BYTES, LayerDesc, ModelDesc
from fshard.plan.shards import layer_shards, stage_layers, stage_shards
from fshard.plan.trace import OptimizerWork, trace_optimizer

__all__ = [
    "MODEL_ERROR",
    "Estimate",
    "estimate",
    "interval",
    "held_peak",
    "held_states",
    "model_flops",
    "pipeline_speedup",
    "simulate_pipeline",
]

TIME_KINDS = ("compute", "exposed_comm", "bubble", "optimizer")
MEMORY_KINDS = ("params", "grads", "optimizer", "gathered", "activations", "grad_buffers", "w_pending")


@attrs.frozen
class Estimate:
    """The prediction for one layout.

    Attributes:
      layout: the layout.
      step_s: predicted seconds per optimizer step.
      peak_bytes: predicted peak bytes per rank (the largest rank).
      breakdown: seconds by kind: ``compute``, ``exposed_comm``, ``bubble``,
        ``optimizer`` (they add up to ``step_s``).
      memory: peak bytes by kind: ``params``, ``grads``, ``optimizer``, ``gathered``,
        ``activations``, ``grad_buffers``, ``w_pending`` (schedules that split backward
        into I and W: the gradients captured for W of the microbatches between the two)
        (at the moment of the peak, on that rank).
      memory_limit: the limit it was checked against (bytes; None: not checked).
      tokens_per_s: global tokens per second.
      mfu: model FLOPs utilisation (6N + 12 L T D per token, against ``machine.flops``).
      bubble_fraction: pipelines: idle share of the pipeline phase, mean over pp ranks
        (``1 - busy / wall`` as ``fs.sched.StepStats`` measures it); 0 without pp.
      comm: the step's collectives (rank 0).
      stage_costs: pipelines: per pp rank ``(F, I, W)`` seconds per microbatch as simulated
        (on CPU cores shared by more ranks: sped up for the simulated busy share; F and I
        each carry half the host time of the transfers the rank posts per microbatch).
      step_lo_s, step_hi_s: the interval the measured step is expected in
        (:func:`interval`: the model's validated error in this regime plus the
        calibration's fit residuals).
      regime: ``"host"`` when fixed host costs are at least half the step, else
        ``"compute"`` (which of :data:`MODEL_ERROR`'s figures the interval takes).
      uncertain: the machine's fits that stayed noisy at calibration
        (:attr:`~fshard.plan.machine.Machine.uncertain`): the step rests on them.
    """

    layout: Layout
    step_s: float
    peak_bytes: float
    breakdown: dict[str, float]
    memory: dict[str, float]
    memory_limit: float | None
    tokens_per_s: float
    mfu: float
    bubble_fraction: float = 0.0
    comm: tuple[Collective, ...] = attrs.field(default=(), repr=False)
    stage_costs: tuple[tuple[float, float, float], ...] = ()
    step_lo_s: float = 0.0
    step_hi_s: float = 0.0
    regime: str = ""
    uncertain: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.memory_limit is None or self.peak_bytes <= self.memory_limit

    def explain(self) -> str:
        """One line: where the time goes and what the memory holds."""
        t = ", ".join(
            f"{k} {v * 1e3:.1f} ms" if self.step_s < 10 else f"{k} {v:.2f} s"
            for k, v in self.breakdown.items()
            if v > 0
        )
        m = ", ".join(
            f"{k} {v / 2**30:.2f} GiB" if self.peak_bytes > 2**30 else f"{k} {v / 2**20:.1f} MiB"
            for k, v in self.memory.items()
            if v > 0
        )
        return f"{self.layout.label()}: step {self.step_s:.4g} s ({t}); peak {self.peak_bytes / 2**30:.3g} GiB ({m})"


def model_flops(model: ModelDesc) -> float:
    """Model FLOPs per sample as published MFU figures count them: ``6 N`` per token for the
    matrices (embedding tables excluded) plus ``12 L T D`` per token for attention
    (torchtitan's and PaLM's formula: causal masking not discounted, no recompute)."""
    rep = model.layers[model.repeated]
    n = sum(layer.numel * layer.count for layer in model.layers if layer.name != "embed")
    attn = 12 * rep.count * model.seq_len * model.hidden if rep.tp_enter else 0
    return (6 * n + attn) * model.seq_len


def _split_div(layout: Layout) -> int:
    return math.prod(r.split_divisor(layout) for r in RULES)


def _rest_div(layout: Layout) -> int:
    return math.prod(r.rest_divisor(layout) for r in RULES)


def _work(layer: LayerDesc, phase: str, layout: Layout, model: ModelDesc) -> tuple[float, float, float]:
    """(flops, bytes, kernels) per sample of one call of ``layer``'s ``phase`` on one rank:
    the axis rules divide its split part and its rest (tensor parallelism; the rest too
    with sequence parallelism)."""
    w, s = getattr(layer, phase), getattr(layer, phase + "_split")
    split_div, rest_div = _split_div(layout), _rest_div(layout)
    k = DTYPE_BYTES[layout.dtype] / model.dtype_bytes
    flops = (w.flops - s.flops) / rest_div + s.flops / split_div
    nbytes = ((w.bytes - s.bytes) / rest_div + s.bytes / split_div) * k
    for r in RULES:
        extra = r.extra_work(layer, phase, layout)
        flops, nbytes = flops + extra.flops, nbytes + extra.bytes * k
    return flops, nbytes, w.ops + sum(r.extra_kernels(layer, phase, layout, model) for r in RULES)


def _ranks_per_node(machine: Machine, layout: Layout) -> int:
    return min(layout.n_devices, machine.devices_per_node)


def _phase_time(
    machine: Machine, layout: Layout, model: ModelDesc, layer: LayerDesc, phase: str, samples: float
) -> float:
    rpn = _ranks_per_node(machine, layout)
    flops, nbytes, ops = _work(layer, phase, layout, model)
    # A layer's backward is one autograd pass (I and W together unless a schedule splits
    # them): its fixed host cost is counted once, on I.
    calls = 1.0 if phase != "bwd_weight" else 0.0
    return (
        samples * (flops / machine.flops_rate(layout.dtype, rpn) + nbytes / machine.bytes_rate(rpn))
        + ops * machine.overhead(rpn)
        + calls * machine.layer_overhead(rpn)
    )


def _act_bytes(layer: LayerDesc, layout: Layout, model: ModelDesc) -> float:
    """Saved-for-backward bytes per sample of one layer call on one rank: the split part
    divided, the rest kept (cp divides it too), plus what the axis rules add (sequence
    parallelism's copies)."""
    k = DTYPE_BYTES[layout.dtype] / model.dtype_bytes
    split = layer.act_split / _split_div(layout)
    rest = (layer.act_bytes - layer.act_split) / math.prod(r.saved_divisor(layout) for r in RULES)
    for r in RULES:
        rest += r.saved_extra(layer, layout)
    return (split + rest) * k


def _wgrad_bytes(layer: LayerDesc, layout: Layout, model: ModelDesc) -> float:
    """Bytes per sample of the gradients a split backward holds from I to W, on one rank
    (tensor parallelism divides the split part; sequence parallelism the rest too)."""
    k = DTYPE_BYTES[layout.dtype] / model.dtype_bytes
    rest = layer.wgrad_bytes - layer.wgrad_split
    return (layer.wgrad_split / _split_div(layout) + rest / _rest_div(layout)) * k


def _boundary_bytes(layer: LayerDesc, layout: Layout, model: ModelDesc) -> float:
    """Bytes per sample of the activation a layer hands on, on one rank (what remat keeps
    and a pipeline sends): sequence parallelism splits it over tp."""
    k = DTYPE_BYTES[layout.dtype] / model.dtype_bytes
    return layer.out_bytes * k / _rest_div(layout)


@functools.lru_cache(maxsize=8)
def _optimizer_work(dtype: str) -> OptimizerWork:
    import torch

    return trace_optimizer(getattr(torch, dtype))


def optimizer_kernels(ow: OptimizerWork, n_leaves: float, cpu: bool) -> float:
    """Kernels of one optimizer step over ``n_leaves`` leaves (``calibrate`` subtracts the
    same count from its timings, so the two agree on what the per-leaf host time is)."""
    kernels = ow.ops - ow.foreach_ops + ow.ops_per_leaf * n_leaves
    # A CPU runs a foreach kernel as one kernel per tensor; a GPU as one per ~dozens of tensors.
    return kernels + ow.foreach_ops * (n_leaves if cpu else max(1, n_leaves / 32))


def _optimizer_time(machine: Machine, layout: Layout, numel: int, n_leaves: int) -> float:
    ow = _optimizer_work(layout.master_dtype)
    rpn = _ranks_per_node(machine, layout)
    k = DTYPE_BYTES[layout.master_dtype] / 4
    kernels = optimizer_kernels(ow, n_leaves, bool(machine.cores_per_node))
    host = n_leaves * machine.optimizer_leaf_overhead(rpn)
    return numel * ow.bytes_per_element * k / machine.optimizer_bytes_rate(rpn) + kernels * machine.overhead(rpn) + host


def _exposed(machine: Machine, layout: Layout, c: Collective, window: dict[str | None, float]) -> float:
    """Seconds of ``c`` (all its calls) the step waits for. ``machine.overlap`` is the share
    of the shorter of a collective and the compute beside it that runs hidden (what
    ``calibrate`` measures: an all-gather beside a loop as long as it); charging it as the
    share of the compute window that hides communication would hide every FSDP collective
    shorter than ``overlap`` times its block, however small ``overlap``."""
    if c.hide is None:
        return _blocking(machine, layout, c)
    t = collective_time(machine, layout, c) * c.count
    return max(0.0, t - machine.overlap * min(t, window[c.hide] * c.count))


def _blocking(machine: Machine, layout: Layout, c: Collective) -> float:
    """Seconds of ``c`` (all its calls) on the critical path: the link's time and, in a
    flat step, the machine's cost per blocking call of peers out of step (CPU ranks
    sharing cores).

    Not in pipelines: on ranks sharing cores (``bench/plan_validate.py``), the flat
    ``fsdp=2,tp=2`` layouts ran well over the estimate without the calibrated cost per
    call, and the ``pp=2,tp=2`` ones close to it without the cost and under it with the
    cost (docs/plan.md, "Figures behind the planner's rules"). (A pipeline's tp ranks start
    each action together on the activation they both receive, and its blocked ranks leave
    their cores to the others; a flat step's FSDP gathers run beside its TP all-reduces on
    gloo's threads.)
    """
    sync = machine.sync_overhead(_ranks_per_node(machine, layout)) if layout.pp == 1 else 0.0
    return c.count * (collective_time(machine, layout, c) + sync)


def estimate(
    model: ModelDesc, machine: Machine, layout: Layout, *, memory_limit: float | None = None, time_unfit: bool = True
) -> Estimate:
    """Predicts step time and peak memory per rank for one layout.

    Args:
      model: the model description.
      machine: the machine description.
      layout: the layout (mesh, batch, microbatches, schedule, remat, reshard, ...).
      memory_limit: bytes per rank to check against (optional; default: the machine's
        memory less its reserve).
      time_unfit: also predict the step time of a layout that does not fit (optional,
        default True; False returns ``step_s = inf`` for those, which is faster).

    Returns:
      An :class:`Estimate`.

    Raises:
      LayoutError: the layout does not fit the model (the field is named).
      DescriptionError: the machine lacks a figure the layout needs (e.g. its dtype).
    """
    check_layout(layout, model)
    limit = memory_limit if memory_limit is not None else machine.memory_bytes - machine.reserved_bytes

    def one(m: Machine) -> Estimate:
        if layout.pp > 1:
            return _estimate_pipeline(model, m, layout, limit, time_unfit)
        return _estimate_flat(model, m, layout, limit)

    est = one(machine)
    if not math.isfinite(est.step_s) or est.step_s <= 0:
        return attrs.evolve(est, step_lo_s=est.step_s, step_hi_s=est.step_s, uncertain=machine.uncertain)
    host_share = 0.0
    host_free: dict[str, Any] = dict.fromkeys(HOST_COSTS, 0.0)
    bare = attrs.evolve(machine, **host_free)
    if bare != machine:  # the step without the fixed host costs: what of it is host time
        host_share = max(0.0, 1.0 - one(bare).step_s / est.step_s)
    regime = "host" if host_share >= 0.5 else "compute"
    shares = {k: _sensitivity(k, r, machine, est.step_s, one) for k, r in machine.fit_residuals.items()}
    lo, hi = interval(est.step_s, regime, machine, shares)
    return attrs.evolve(est, step_lo_s=lo, step_hi_s=hi, regime=regime, uncertain=machine.uncertain)


def _sensitivity(key: str, residual: float, machine: Machine, step_s: float, one: Callable[[Machine], Any]) -> float:
    """How far off the step is when fit ``key``'s rate is off by its residual: the relative
    change of the estimate with that rate slowed by ``residual`` (doubled when the fit is
    marked uncertain). A copy-bandwidth fit that spans the caches has a large residual, but
    a step made of matrix products barely depends on it; a fit this function does not know
    counts whole (its residual)."""
    r = residual * (2.0 if key in machine.uncertain else 1.0)
    if key.startswith("flops[") and key[6:-1] in machine.flops:
        slow = attrs.evolve(machine, flops={**machine.flops, key[6:-1]: machine.flops[key[6:-1]] / (1 + r)})
    elif key == "mem_bandwidth":
        slow = attrs.evolve(machine, mem_bandwidth=machine.mem_bandwidth / (1 + r))
    elif key == "block":  # the block fit sets the matrix products' efficiency
        slow = attrs.evolve(machine, matmul_efficiency=machine.matmul_efficiency / (1 + r))
    else:
        return r
    return max(0.0, one(slow).step_s / step_s - 1.0)


# The machine's fixed host costs (seconds per kernel, layer call, step-body call, optimizer
# leaf, blocking collective): what separates the host-bound regime from the compute-bound one.
HOST_COSTS = ("op_overhead_s", "layer_overhead_s", "call_overhead_s", "optimizer_leaf_overhead_s", "sync_overhead_s")

# The model's relative error per regime, the largest of its validation runs (docs/plan.md,
# "How far to trust a calibration and a prediction": which runs, and that the host-bound
# figure is not yet validated with host costs in the model).
MODEL_ERROR = {"compute": 0.30, "host": 0.51}

# The most an interval's relative error may reach (its low end stays above zero).
MAX_ERROR = 0.9


def interval(
    step_s: float, regime: str, machine: Machine, shares: Mapping[str, float] | None = None
) -> tuple[float, float]:
    """``(lo, hi)`` seconds the measured step is expected in: a relative error ``r`` of the
    model's (:data:`MODEL_ERROR` for ``regime``) plus the calibration's, at most
    :data:`MAX_ERROR`: ``[step / (1 + r), step / (1 - r)]``, the steps the prediction is off
    from by at most ``r`` (prediction over step, less 1).

    The calibration's error is the sum over its fits of what each one's residual moves this
    step (``shares``, from :func:`_sensitivity`); without ``shares``, the largest residual
    (doubled for a fit marked uncertain: its residual after the repeat is a lower bound of
    its error), as if the step depended on that fit alone."""
    if shares is None:
        res = [r * (2.0 if k in machine.uncertain else 1.0) for k, r in machine.fit_residuals.items()]
        fit = max(res, default=0.0)
    else:
        fit = sum(shares.values())
    r = min(MAX_ERROR, MODEL_ERROR[regime] + fit)
    return step_s / (1.0 + r), step_s / (1.0 - r)


def _common(model: ModelDesc, layout: Layout, step_s: float, machine: Machine) -> tuple[float, float]:
    tokens = layout.batch * model.seq_len / step_s
    per_device_flops = model_flops(model) * layout.batch / step_s / layout.n_devices
    peak = machine.flops.get(layout.dtype) or max(machine.flops.values())
    return tokens, per_device_flops / peak


def _persistent(model: ModelDesc, layout: Layout, layers: list[tuple[int, int]]) -> tuple[float, int, int]:
    """(bytes of the master shards, elements, leaves) this rank holds for ``layers``."""
    numel = sum(layer_shards(model.layers[i], layout).local * k for i, k in layers)
    leaves = sum(len(model.layers[i].params) * k for i, k in layers)
    return numel * DTYPE_BYTES[layout.master_dtype], numel, leaves


def _estimate_flat(model: ModelDesc, machine: Machine, layout: Layout, limit: float) -> Estimate:
    rep = model.repeated
    block = model.layers[rep]
    L = block.count
    b = layout.microbatch_size
    K = layout.microbatches
    rb = DTYPE_BYTES[layout.master_dtype]

    fwd = {i: _phase_time(machine, layout, model, layer, "fwd", b) for i, layer in enumerate(model.layers)}
    bwd = {
        i: _phase_time(machine, layout, model, layer, "bwd_input", b)
        + _phase_time(machine, layout, model, layer, "bwd_weight", b)
        for i, layer in enumerate(model.layers)
    }
    if layout.remat:
        bwd[rep] += fwd[rep]
    # One value_and_grad(shard_map(...)) call per microbatch: its fixed host cost once.
    call = machine.call_overhead(_ranks_per_node(machine, layout))
    compute = K * (call + sum((fwd[i] + bwd[i]) * layer.count for i, layer in enumerate(model.layers)))
    colls = step_collectives(model, layout)
    window: dict[str | None, float] = {"fwd": fwd[rep], "bwd": bwd[rep]}
    exposed = sum(_exposed(machine, layout, c, window) for c in colls)

    all_layers = [(i, layer.count) for i, layer in enumerate(model.layers)]
    master_bytes, numel, leaves = _persistent(model, layout, all_layers)
    optimizer_s = _optimizer_time(machine, layout, numel, leaves)
    step = compute + exposed + optimizer_s

    # -- memory ---------------------------------------------------------------------------
    # Three moments: the start of backward (every activation alive), the last block's
    # backward (every other layer's reduction pending), the optimizer (its temporaries).
    roots = [i for i in range(len(model.layers)) if i != rep]
    sh = {i: layer_shards(model.layers[i], layout) for i in range(len(model.layers))}
    step_parts = flat_step(model, layout)
    # parameter copies for compute (FSDP's gathers, a cast), by the axis rules
    gathered_root = block_gathered = gathered_fwd = 0.0
    for r in RULES:
        g_root, g_block, g_fwd = r.gathered(step_parts, machine)
        gathered_root, block_gathered, gathered_fwd = (
            gathered_root + g_root,
            block_gathered + g_block,
            gathered_fwd + g_fwd,
        )
    root_acts = sum(_act_bytes(model.layers[i], layout, model) * b * model.layers[i].count for i in roots)
    block_acts = _act_bytes(block, layout, model) * b
    if layout.remat:
        # Each block keeps its input. Backward recomputes one block at a time, the first
        # after the head's backward: that block's activations belong to the later moment.
        acts = root_acts + L * _boundary_bytes(block, layout, model) * b
    else:
        acts = root_acts + L * block_acts
    full_grads = sum(sh[i].gathered * model.layers[i].count for i in range(len(model.layers))) * rb
    # Accumulation keeps the unreduced gradients of every group between microbatches.
    acc = full_grads if K > 1 else 0.0
    # The full-size gradients waiting for a reduction at the last block's backward (FSDP's
    # block in flight, DDP's whole set), by the axis rules.
    pending = 0.0
    for r in RULES:
        pending += r.pending_grads(step_parts, full_grads)
    persistent = {"params": master_bytes, "optimizer": 2 * master_bytes, "w_pending": 0.0}
    at_bwd_start = {
        **persistent,
        "grads": 0.0,
        "gathered": gathered_root + gathered_fwd,
        "activations": acts,
        "grad_buffers": acc,
    }
    # At the last block's backward the gradients an axis reduces in backward are shards
    # already (FSDP's reduce-scatters); else every gradient exists at full size.
    reduced = next((g for r in RULES if (g := r.reduced_grads(step_parts)) is not None), master_bytes)
    at_bwd_end = {
        **persistent,
        "grads": reduced,
        "gathered": gathered_root + block_gathered,
        "activations": block_acts + (_boundary_bytes(block, layout, model) * b if layout.remat else 0.0),
        "grad_buffers": max(acc, pending),
    }
    ow = _optimizer_work(layout.master_dtype)
    at_opt = {
        **persistent,
        "grads": master_bytes,
        "gathered": 0.0,
        "activations": 0.0,
        "grad_buffers": ow.transient_per_element * numel * DTYPE_BYTES[layout.master_dtype] / 4,
    }
    memory = max((at_bwd_start, at_bwd_end, at_opt), key=lambda d: sum(d.values()))
    peak = sum(memory.values())
    tokens, mfu = _common(model, layout, step, machine)
    return Estimate(
        layout=layout,
        step_s=step,
        peak_bytes=peak,
        breakdown={"compute": compute, "exposed_comm": exposed, "bubble": 0.0, "optimizer": optimizer_s},
        memory={k: memory[k] for k in MEMORY_KINDS},
        memory_limit=limit,
        tokens_per_s=tokens,
        mfu=mfu,
        comm=tuple(colls),
    )


@functools.lru_cache(maxsize=8192)
def _simulate(schedule_key: tuple, f: int, b: int, w: int, comm: int) -> Fraction:
    from fshard.sched.simulate import simulate

    return simulate(_build(schedule_key), f=f, b=b, w=w, comm=comm).makespan


@functools.lru_cache(maxsize=1024)
def _peaks(schedule_key: tuple) -> tuple[int, ...]:
    """Peak (stage, microbatch) activations per rank: each rank runs its actions in list
    order, so the count alive at each point does not depend on the costs."""
    from fshard.sched.simulate import simulate

    return simulate(_build(schedule_key)).peak_activations


def _build(key: tuple) -> Any:
    return schedule_of(key)


# Stage costs are rounded to 1/RESOLUTION of the forward cost before simulating (the
# simulator computes in exact fractions; rounded costs let similar layouts share a run).
RESOLUTION = 200


def simulate_pipeline(
    layout: Layout, costs: list[tuple[float, float, float]], p2p: float
) -> tuple[float, tuple[int, ...]]:
    """``fs.sched.simulate`` of the layout's schedule with per-rank ``(F, I, W)`` seconds.

    The simulator takes one cost per kind for every rank: the slowest rank's forward and
    backward (``F`` and ``I + W``), by their sum (the pipeline runs at the pace of its
    slowest stage), its backward split at the largest ``I`` over the ranks (the chain of
    input gradients between stages is as slow as its slowest link). Not the largest of
    each kind over the ranks: ranks that split their backward differently then add up to a
    rank slower than any. fshard's runtime leaves the first stage's I empty (no input
    gradient to send) and does its whole backward in W: the kind-wise largest of the two
    ranks of a ``pp=2,tp=2 zb`` run was far slower than its slower rank, and simulated a
    bubble far above the one it ran at (docs/plan.md, "Figures behind the planner's
    rules"). Costs are rounded to 1/200 of the forward cost (the simulator computes in
    exact fractions; similar layouts share a run).

    Args:
      layout: a layout with pp > 1.
      costs: per pp rank, seconds per microbatch of F, I (backward-input, remat's
        recomputation included) and W (backward-weight) over the stages it holds.
      p2p: seconds of one activation (or gradient) transfer between stages.

    Returns:
      ``(makespan seconds, peak (stage, microbatch) activations alive per rank)``.
    """
    f, i_slow, w_slow = max(costs, key=lambda c: (sum(c), c))
    i = min(i_slow + w_slow, max(c[1] for c in costs))
    w = i_slow + w_slow - i
    unit = f / RESOLUTION
    key = (layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    makespan = _simulate(key, RESOLUTION, max(1, round(i / unit)), round(w / unit), round(p2p / unit))
    return float(makespan) * unit, _peaks(key)


def _estimate_pipeline(model: ModelDesc, machine: Machine, layout: Layout, limit: float, time_unfit: bool) -> Estimate:
    sch = layout_schedule(layout)
    pp, m = layout.pp, layout.microbatches
    stages = stage_layers(model, sch.n_stages)
    b = layout.microbatch_size
    rep = model.repeated
    pb, rb = DTYPE_BYTES[layout.dtype], DTYPE_BYTES[layout.master_dtype]
    persistent, mems = [], []
    for r in range(pp):
        layers_r = [p for s in sch.stages_of(r) for p in stages[s]]
        persistent.append(_persistent(model, layout, layers_r))
        mems.append(
            _pipeline_memory(model, layout, machine, sch, stages, r, persistent[r][0], persistent[r][1], pb, rb)
        )
    memory = max(mems, key=lambda d: sum(d.values()))
    peak = sum(memory.values())
    if peak > limit and not time_unfit:
        return Estimate(
            layout=layout,
            step_s=math.inf,
            peak_bytes=peak,
            breakdown=dict.fromkeys(TIME_KINDS, 0.0),
            memory={k: memory[k] for k in MEMORY_KINDS},
            memory_limit=limit,
            tokens_per_s=0.0,
            mfu=0.0,
        )

    # Each action is a call of its own (a stage's forward; its backward, one autograd pass):
    # half a step-body call's fixed host cost each.
    half = machine.call_overhead(_ranks_per_node(machine, layout)) / 2

    def stage_cost(parts: list[tuple[int, int]]) -> tuple[float, float, float]:
        F = I = W = 0.0
        for i, k in parts:
            layer = model.layers[i]
            f = _phase_time(machine, layout, model, layer, "fwd", b)
            F += k * f
            recompute = f if layout.remat and i == rep else 0
            I += k * (_phase_time(machine, layout, model, layer, "bwd_input", b) + recompute)
            W += k * _phase_time(machine, layout, model, layer, "bwd_weight", b)
        return F + half, I + half, W

    # TP collectives inside the stage bodies belong to the actions' time.
    compute_costs, tp_costs, colls_by_rank = [], [], []
    for r in range(pp):
        colls = step_collectives(model, layout, pp_rank=r)
        colls_by_rank.append(colls)
        F = I = W = 0.0
        for s in sch.stages_of(r):
            f, i, w = stage_cost(stages[s])
            F, I, W = F + f, I + i, W + w
        tp_f = sum(_blocking(machine, layout, c) for c in colls if c.pipeline == "F") / m
        tp_i = sum(_blocking(machine, layout, c) for c in colls if c.pipeline == "I") / m
        compute_costs.append((F, I, W))
        tp_costs.append((tp_f, tp_i, 0.0))
    p2p, post = pipeline_transfer(machine, layout, model)
    # Outside the schedule: stage gathers before the first F, reductions after the last W.
    blk_f = _phase_time(machine, layout, model, model.layers[rep], "fwd", b)
    blk_b = _phase_time(machine, layout, model, model.layers[rep], "bwd_input", b) + _phase_time(
        machine, layout, model, model.layers[rep], "bwd_weight", b
    )
    window: dict[str | None, float] = {"fwd": blk_f, "bwd": blk_b}
    outside = max(sum(_exposed(machine, layout, c, window) for c in colls if not c.pipeline) for colls in colls_by_rank)
    # CPU nodes: each send and receive the rank posts costs it host time outside its compute
    # actions (gloo runs them from the rank's own thread: the runtime's _post / _prefetch,
    # not in StepStats' busy time): the point-to-point latency per op, on the rank's own
    # timeline, half with F and half with I. Devices post asynchronously (NCCL): their
    # latency is the dependency edge's only, which the simulator charges already.
    ops = p2p_counts(sch)
    host = [(ops[r][0] + ops[r][1]) * post / m for r in range(pp)]
    costs, makespan = _shared_core_pipeline(machine, layout, compute_costs, tp_costs, host, p2p, outside)
    busy = [m * (sum(c) - h) for c, h in zip(costs, host)]
    opt_s = [_optimizer_time(machine, layout, numel, leaves) for _, numel, leaves in persistent]
    wall = makespan + outside
    bubble_fraction = sum(1 - bz / wall for bz in busy) / pp
    compute = max(busy)
    optimizer_s = max(opt_s)
    step = wall + optimizer_s
    comm_exposed = wall - makespan
    bubble = makespan - compute
    tokens, mfu = _common(model, layout, step, machine)
    return Estimate(
        layout=layout,
        step_s=step,
        peak_bytes=peak,
        breakdown={"compute": compute, "exposed_comm": comm_exposed, "bubble": bubble, "optimizer": optimizer_s},
        memory={k: memory[k] for k in MEMORY_KINDS},
        memory_limit=limit,
        tokens_per_s=tokens,
        mfu=mfu,
        bubble_fraction=bubble_fraction,
        comm=tuple(colls_by_rank[0]),
        stage_costs=tuple(costs),
    )


def pipeline_transfer(machine: Machine, layout: Layout, model: ModelDesc) -> tuple[float, float]:
    """``(edge, post)``: seconds an activation (or gradient) transfer between stages adds to
    the dependency from one stage's action to the next's, and host seconds each posted
    send or receive costs its rank outside its compute.

    Devices post asynchronously (NCCL): the whole point-to-point time is the edge's, and
    posting costs nothing. On CPU nodes (gloo) a rank posts its transfers from its own
    thread: the point-to-point latency is its host time per posted op, and the edge carries
    the bytes' time only, as the receive was posted ahead (the runtime's prefetch). Charging
    the latency on both puts it twice on a 1F1B step's critical path per microbatch: fed
    each rank's timed F, I and W, the simulator then put the ``pp=2,tp=2`` runs' bubble
    several points too high (docs/plan.md, "Figures behind the planner's rules").
    """
    full = collective_time(machine, layout, Collective("send", ("pp",), pipeline_payload(model, layout)))
    if not machine.cores_per_node:
        return full, 0.0
    post = collective_time(machine, layout, Collective("send", ("pp",), 0))
    return max(0.0, full - post), post


def pipeline_speedup(machine: Machine, ranks_per_node: int, busy_share: float) -> float:
    """How much faster a rank computes when only ``busy_share`` of a node's ranks compute at
    once than when all do (the speed every compute figure is for): 1 unless the node's ranks
    share CPU cores (``machine.cores_per_node`` fewer than them).

    A rank that waits in a pipeline's bubble (blocked on a receive) leaves its core to the
    ranks that compute; with 4 ranks on 2 cores and a quarter of the pipeline idle, 3 ranks
    share 2 cores: each computes 1.33 times as fast as when all 4 do.

    Args:
      machine: the machine (its ``cores_per_node`` and ``calibrated_ranks``).
      ranks_per_node: ranks on one node, an int >= 1.
      busy_share: the share of them computing at once, in [0, 1].

    Returns:
      The speed-up, >= 1.

    Raises:
      ValueError: ``ranks_per_node`` is not an int >= 1, or ``busy_share`` is not a number
        in [0, 1] (the parameter and its value are named).
    """
    if not isinstance(ranks_per_node, numbers.Integral) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"pipeline_speedup: ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
    if not isinstance(busy_share, numbers.Real) or isinstance(busy_share, bool) or not 0 <= busy_share <= 1:
        raise ValueError(f"pipeline_speedup: busy_share must be a number in [0, 1], got {busy_share!r}")
    busy = max(ranks_per_node * busy_share, 1e-9)
    return machine.share(busy) / machine.share(ranks_per_node)


def _shared_core_pipeline(
    machine: Machine,
    layout: Layout,
    compute: list[tuple[float, float, float]],
    tp: list[tuple[float, float, float]],
    host: list[float],
    p2p: float,
    outside: float,
) -> tuple[list[tuple[float, float, float]], float]:
    """Per pp rank ``(F, I, W)`` and the schedule's makespan, with the compute sped up by
    :func:`pipeline_speedup` for the share of ranks the simulated schedule keeps busy
    (``tp``: collectives in the actions, ``host``: per microbatch, the rank's host time
    outside its actions; neither sped up, and ``host`` not busy).

    The speed depends on the bubble and the bubble on the speed: a fixed point ``s = g(s)``,
    with ``g(s)`` the speed-up at the busy share the schedule simulated at speed ``s`` gives.
    Faster compute leaves more of the step to the fixed costs, so the busy share falls and
    ``g`` grows with ``s``; ``g(1) >= 1`` and ``g`` is at most the speed-up with no rank
    busy, so ``g(s) - s`` changes sign on that interval: bisected to 1e-4 relative (about
    15 simulations). Iterating ``s = g(s)`` converges only linearly when the fixed costs
    nearly match the compute, and the costs' rounding to 1/200 can make it cycle.
    Where the cores stay saturated (busy ranks at least the cores) every busy share is
    consistent, the step comes out at the ranks' work over the cores, and the fixed point
    keeps the bubble shape of the fixed-cost schedule, which is what the measured spans
    showed (docs/plan.md, "Model changes", item 2). On GPUs, or with a core per rank,
    the speed-up is 1: one simulation.
    """
    m, rpn = layout.microbatches, _ranks_per_node(machine, layout)

    def run(speed: float) -> tuple[list[tuple[float, float, float]], float, float]:
        costs = [
            (cs[0] / speed + ts[0] + h / 2, cs[1] / speed + ts[1] + h / 2, cs[2] / speed + ts[2])
            for cs, ts, h in zip(compute, tp, host)
        ]
        makespan, _ = simulate_pipeline(layout, costs, p2p)
        share = sum(m * (sum(c) - h) for c, h in zip(costs, host)) / (len(costs) * (makespan + outside))
        return costs, makespan, pipeline_speedup(machine, rpn, min(1.0, max(0.0, share)))

    costs, makespan, g = run(1.0)
    lo, hi = 1.0, pipeline_speedup(machine, rpn, 0.0)
    if g <= lo or hi <= lo:
        return costs, makespan
    # g(lo) > lo and g(hi) <= hi throughout
    while hi - lo > 1e-4 * lo:
        mid = (lo + hi) / 2
        if run(mid)[2] > mid:
            lo = mid
        else:
            hi = mid
    costs, makespan, _ = run((lo + hi) / 2)
    return costs, makespan


def _pipeline_memory(
    model: ModelDesc,
    layout: Layout,
    machine: Machine,
    sch: Any,
    stages: list,
    r: int,
    master_bytes: float,
    numel: int,
    pb: int,
    rb: int,
) -> dict[str, float]:
    """Pipeline rank ``r`` at the larger of two moments: its activation peak (the most
    bytes of microbatches alive, those between their I and W holding the gradients
    captured for W too; the stages' gathered parameters, the gradients summed so far over
    microbatches and one microbatch's new ones), and the optimizer."""
    b = layout.microbatch_size
    rep = model.repeated
    held = sch.stages_of(r)
    gathered = 0.0
    stage_grads = 0.0
    act_per_chunk = 0.0
    wgrad_per_chunk = 0.0
    for s in held:
        sh = stage_shards(model, layout, stages[s])
        for rule in RULES:  # parameter copies for compute (StageFSDP's gather, a cast)
            gathered += rule.stage_gathered(layout, sh)
        stage_grads += sh.gathered * rb
        a = 0.0
        for i, k in stages[s]:
            layer = model.layers[i]
            if layout.remat and i == rep:
                a += k * _boundary_bytes(layer, layout, model) * b
            else:
                a += k * _act_bytes(layer, layout, model) * b
        act_per_chunk = max(act_per_chunk, a)
        wgrad_per_chunk = max(
            wgrad_per_chunk, sum(k * _wgrad_bytes(model.layers[i], layout, model) * b for i, k in stages[s])
        )
    if layout.remat:  # one block recomputed at a time during backward
        act_per_chunk += _act_bytes(model.layers[rep], layout, model) * b
    key = (layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    peak_chunks, w_pending = held_peak(held_states_of(key)[r], act_per_chunk, wgrad_per_chunk)
    acts = peak_chunks * act_per_chunk
    persistent = {"params": master_bytes, "optimizer": 2 * master_bytes, "w_pending": 0.0}
    # The executor sums each microbatch's gradients (of the gathered parameters, in the
    # reduction dtype) into per-stage sums. At the activation peak one microbatch's new
    # gradients are being made; the sums exist already unless every microbatch is alive
    # at the peak (all forwards before any backward, as GPipe).
    sums = stage_grads if peak_chunks < layout.microbatches * len(held) else 0.0
    at_peak = {
        **persistent,
        "grads": 0.0,
        "gathered": gathered,
        "activations": acts,
        "grad_buffers": sums + stage_grads * pb / rb,
        "w_pending": w_pending * wgrad_per_chunk,
    }
    ow = _optimizer_work(layout.master_dtype)
    at_opt = {
        **persistent,
        "grads": master_bytes,
        "gathered": 0.0,
        "activations": 0.0,
        "grad_buffers": ow.transient_per_element * numel * DTYPE_BYTES[layout.master_dtype] / 4,
    }
    return max((at_peak, at_opt), key=lambda d: sum(d.values()))

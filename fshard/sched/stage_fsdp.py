"""FSDP at stage granularity for :func:`fshard.sched.pipeline_step`.

With ``pipeline_step(..., fsdp=StageFSDP("fsdp"))`` the executor, not the stage body,
gathers a stage's parameters: every leaf whose spec shards it over ``axis`` joins its
stage's group, and the group moves as one flat collective (the engine of
:mod:`fshard.parallel.groups`). ``stage_fn`` then sees the parameters whole over
``axis`` (still split over any other axis, e.g. tp) and needs no FSDP code.

Per stage and step, with ``n`` microbatches (FSDP2's fully_shard on a pipeline stage):

=========================  ===========================  ==============================
reshard_after_forward      all-gathers                  reduce-scatters
=========================  ===========================  ==============================
False (default here)       1, at UNSHARD (async),       1, at REDUCE_GRAD, async,
                           kept until RESHARD           waited before the step returns
True                       1 per F, and 1 per backward  1, as above
                           action that needs a weight
=========================  ===========================  ==============================

Gradients of the gathered parameters are summed over microbatches unreduced (in
``policy.reduce_dtype``, FSDP2's no-sync accumulation) and reduce-scattered once,
right after the stage's last weight gradient, so the reduction overlaps the rest of
the schedule. With ``reshard_after_forward=True`` the gathered parameters are not
kept by autograd: saved tensors that live in their storage become tokens, and the
backward action that unpacks one gathers the group again (no forward recompute).

Why ``False`` is the default here (torchtitan's choice for pipelines too): a stage
runs many microbatches, so resharding after each forward multiplies the all-gathers
by the microbatch count.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import attrs
import torch

from fshard import lax
from fshard.parallel.groups import Groups, saved_as_tokens
from fshard.transforms.policy import Policy
from fshard.transforms.shard_map import input_spec

__all__ = ["StageFSDP"]


def _axes(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class StageFSDP:
    """How :func:`~fshard.sched.pipeline_step` shards stage parameters (FSDP per stage).

    Attributes:
        axis: the mesh axis (or axes) the parameters are sharded over; every one of them
            must also be a data axis of the step (FSDP ranks see different data).
        reshard_after_forward: free the gathered parameters after each forward and gather
            them again in backward (``True``), or keep them from the stage's UNSHARD to
            its RESHARD (``False``, default: one all-gather per stage per step).
        policy: mixed precision: gather in ``param_dtype``, accumulate and reduce
            gradients in ``reduce_dtype`` (default: the parameters' dtypes).
        max_active_stages: with ``reshard_after_forward=False``, how many of a rank's
            stages may be gathered at once (:func:`~fshard.sched.add_unshard_reshard`,
            default 3 as torch's pipelining). A rank with more stages (``n_virtual``
            > 3) regathers a stage that left the window; raise it to gather each stage
            once per step at the cost of holding them all.
    """

    axis: tuple[str, ...] = attrs.field(default=("fsdp",), converter=_axes)
    reshard_after_forward: bool = attrs.field(default=False)
    policy: Policy | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(Policy))
    )
    max_active_stages: int = attrs.field(
        default=3, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)]
    )

    @reshard_after_forward.validator
    def _check_raf(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bool):
            raise ValueError(
                f"StageFSDP.reshard_after_forward={value!r}: use True (gather per microbatch and "
                f"again in backward) or False (once per stage per step); resharding to a smaller "
                f"axis is scan_layers' option, inside the stage body"
            )


class _Gather(torch.autograd.Function):
    """A stage's shards -> its gathered parameters.

    The outputs are not leaves, so autograd keeps no reference to them (with reshard
    after forward only tokens are saved). The executor differentiates w.r.t. their
    ``GradientEdge``s and hands the gradients to :meth:`StageShards.take_grads`, so
    this backward runs only if someone differentiates w.r.t. the shards themselves.
    """

    @staticmethod
    def forward(owner: StageShards, s: int, *leaves: torch.Tensor):
        return tuple(owner.groups.gathered(owner.index[s]))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.owner, ctx.s = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner.accumulate(ctx.s, grads)
        # The shard leaves get their gradient from the reduction at REDUCE_GRAD instead.
        return (None, None) + (None,) * len(grads)


class StageShards:
    """Per-step state of :class:`StageFSDP` on one rank (built inside the step's body).

    Args:
        config: the :class:`StageFSDP`.
        params: per held stage, ``(local leaves, treedef)`` as the executor holds them;
            managed leaves carry their global shape and spec (``set_global_shape``).
        replicate_axes: data axes the managed leaves are replicated over (HSDP): their
            gradients are all-reduced over these after the reduce-scatter.
        paths: per held stage, the pytree path of each leaf (for errors).
    """

    def __init__(
        self,
        config: StageFSDP,
        params: dict[int, tuple[list[Any], Any]],
        replicate_axes: tuple[str, ...],
        paths: dict[int, list[str]],
    ) -> None:
        self.config = config
        self.managed: dict[int, list[int]] = {}
        dims: list[list[int]] = []
        groups: list[list[torch.Tensor]] = []
        bad: list[str] = []
        for s, (leaves, _) in sorted(params.items()):
            idx, ds = [], []
            for k, t in enumerate(leaves):
                d = _shard_dim(t, config.axis)
                if d == -1:
                    bad.append(f"  stage {s} {paths[s][k]!r}: spec {input_spec(t)}, local shape {tuple(t.shape)}")
                elif d is not None:
                    idx.append(k)
                    ds.append(d)
            if idx:
                self.managed[s] = idx
                groups.append([leaves[k] for k in idx])
                dims.append(ds)
        if bad:
            axes = config.axis[0] if len(config.axis) == 1 else config.axis
            raise ValueError(
                f"pipeline_step: StageFSDP gathers each parameter over all of {config.axis} "
                f"(mesh {lax.BODY.get().mesh!r}) along one dim; these leaves are "
                f"sharded over only some of them, or over them on two dims:\n"
                + "\n".join(bad)
                + f"\nShard them with fs.parallel.fsdp_specs(params, {axes!r}), or leave them "
                f"replicated over {config.axis}."
            )
        self.index = {s: i for i, s in enumerate(self.managed)}
        self.groups = Groups(groups, config.axis, replicate_axes, dims, config.policy or Policy()) if groups else None
        self.full: dict[int, tuple[torch.Tensor, ...]] = {}
        self.sums: dict[int, list[torch.Tensor | None]] = {s: [None] * len(idx) for s, idx in self.managed.items()}
        self.reduced: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.managed)

    # --- hooks called by the executor ------------------------------------------------
    def unshard(self, s: int, executor: Any = None) -> None:
        """UNSHARD: start the stage's all-gather (kept-params mode); F waits for it."""
        if s in self.managed and not self.config.reshard_after_forward and s not in self.full:
            self.groups.start_gather(self.index[s])

    def reshard(self, s: int, executor: Any = None) -> None:
        """RESHARD: let the stage's gathered parameters go."""
        self.full.pop(s, None)

    def forward(self, s: int, leaves: list[Any]) -> tuple[list[Any], contextlib.AbstractContextManager]:
        """The leaves ``stage_fn`` sees for F of stage ``s``, and a context to run it in."""
        idx = self.managed.get(s)
        if not idx:
            return leaves, contextlib.nullcontext()
        full = self.full.get(s)
        if full is None:
            full = _Gather.apply(self, s, *(leaves[k] for k in idx))
            if not self.config.reshard_after_forward:
                self.full[s] = full  # until RESHARD (or the end of the step)
        out = list(leaves)
        for k, f in zip(idx, full):
            # One autograd node per parameter (an alias), so that the executor's gradient
            # edges are distinct per parameter: through the shared gather node, autograd
            # would run every path that reaches any of them (I/W split: W would re-run the
            # input path, collectives included, down to the first layer).
            out[k] = f.view_as(f)
        if not self.config.reshard_after_forward:
            return out, contextlib.nullcontext()
        i = self.index[s]
        return out, saved_as_tokens(full, lambda: self.groups.regathered(i))

    def backward_done(self, s: int) -> None:
        """End of one backward action of stage ``s``: free its regathered parameters."""
        if s in self.managed and self.config.reshard_after_forward:
            self.groups.drop(self.index[s])

    def accumulate(self, s: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Adds gradients of stage ``s``'s gathered parameters (in group order)."""
        dtype = (self.config.policy or Policy()).grad_reduce_dtype
        sums = self.sums[s]
        for k, g in enumerate(grads):
            if g is None:
                continue
            g = g.to(dtype) if dtype is not None else g
            # The first gradient may alias another tensor of the graph: copy before adding.
            sums[k] = g.clone() if sums[k] is None else sums[k].add_(g)

    def take_grads(
        self, s: int, wrt: Sequence[int], grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Keeps the gradients of managed leaves (by leaf index); returns the others."""
        idx = self.managed.get(s)
        if not idx:
            return list(wrt), list(grads)
        pos = {k: j for j, k in enumerate(idx)}
        mine: list[torch.Tensor | None] = [None] * len(idx)
        rest_i, rest_g = [], []
        for i, g in zip(wrt, grads):
            if i in pos:
                mine[pos[i]] = g
            else:
                rest_i.append(i)
                rest_g.append(g)
        self.accumulate(s, mine)
        return rest_i, rest_g

    def reduce(self, s: int, executor: Any = None) -> None:
        """REDUCE_GRAD: start the stage's one reduce-scatter (+ all-reduce for HSDP)."""
        if s not in self.managed or s in self.reduced:
            return
        self.reduced.add(s)
        self.groups.reduce(self.index[s], self.sums.pop(s))

    def finish(self, executor: Any) -> None:
        """Reduces what no REDUCE_GRAD reduced, waits, and hands out the shard gradients."""
        if not self.managed:
            return
        for s in self.managed:
            self.reduce(s)
        self.groups.finish()
        for s, idx in self.managed.items():
            shard_grads = self.groups.collect(self.index[s])
            for k, g in zip(idx, shard_grads):
                executor.grads[s][k] = g
        self.full.clear()


def _shard_dim(t: Any, axes: tuple[str, ...]) -> int | None:
    """The dim of ``t`` sharded over ``axes``; None if over none of them, -1 if bad."""
    if not (isinstance(t, torch.Tensor) and t.requires_grad):
        return None
    spec = input_spec(t)
    if spec is None:
        return None
    hits = [d for d in range(len(spec)) if set(spec.dim_axes(d)) & set(axes)]
    if not hits:
        return None
    named = {a for d in hits for a in spec.dim_axes(d)} & set(axes)
    return -1 if len(hits) > 1 or named != set(axes) else hits[0]

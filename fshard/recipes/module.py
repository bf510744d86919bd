"""``ModuleModel``: an ``nn.Module`` you did not write (a Hugging Face model) as the recipes run it.

``fs.nn.functionalize`` turns the module into ``apply(params, inputs)``; the layout's roles
pick the wrappers: ``fs.parallel.tp_apply`` with the model's TP plan over ``tp``, then
``fs.parallel.fsdp_apply`` per block over ``fsdp`` (and ``dp``: DDP, or HSDP with both), as
``fully_shard`` per block and ``parallelize_module`` would. The parameters start from the
module's own values; the step is :func:`~fshard.recipes.step.build_train_step`'s. Validation
(``fs.recipes.train``'s ``val_batch_at``) runs the step's own forward and loss, in eval mode
and without a gradient (``ComposedStep.forward_loss``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch import nn

from fshard import tree as tree_util
from fshard.lax import pmean
from fshard.mesh.sharding import shard
from fshard.mesh.spec import PartitionSpec as P
from fshard.nn import functionalize
from fshard.optim.base import GradientTransformation
from fshard.parallel.layout import Layout, LayoutError
from fshard.parallel.module import fsdp_apply
from fshard.parallel.module_tp import tp_apply
from fshard.parallel.specs import fsdp_specs, replicate_specs
from fshard.parallel.tp import tp_specs
from fshard.recipes.faults import Injection
from fshard.recipes.roles import Roles
from fshard.recipes.step import ComposedStep, TrainStep, jit_train_step, step_from_grads
from fshard.transforms import shard_map, value_and_grad

__all__ = ["ModuleModel"]


@attrs.frozen
class ModuleModel:
    """An ``nn.Module`` for :func:`~fshard.recipes.step.build_train_step`.

    Attributes:
      module: the model, with its initial values (the same on every rank: seed it).
      loss: ``loss(outputs, targets) -> scalar``, the mean over this rank's rows, where
        ``outputs = module(inputs)`` (a Hugging Face causal LM: ``outputs.logits``).
      blocks: the blocks FSDP gathers one at a time (``fs.parallel.fsdp_apply``'s
        ``blocks``: ``"model.layers"`` for Llama, ``"transformer.h"`` for GPT-2).
      tp_plan: a module TP plan (``fs.parallel.HF_LLAMA_TP_PLAN``, ``HF_GPT2_TP_PLAN``)
        for a layout with ``tp``; None: the model runs no TP.
      name: for messages.
    """

    module: nn.Module
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    blocks: str | Sequence[str] = "model.layers"
    tp_plan: Mapping[str, str] | None = None
    name: str = "module"

    def compose(
        self,
        layout: Layout,
        roles: Roles,
        optimizer: GradientTransformation,
        max_norm: float,
        jit_backend: str | None,
        inject: Injection,
    ) -> ComposedStep:
        """The step on ``layout`` (``fs.recipes.compose_train_step`` calls this)."""
        return compose_module_step(self, layout, roles, optimizer, max_norm, jit_backend, inject)


def _refuse(model: ModuleModel, layout: Layout, roles: Roles, params: Any) -> None:
    what = f"ModuleModel {model.name!r} ({type(model.module).__name__})"
    for field, unsupported, fix in (
        ("pp", roles.pp_axis is not None, "cut it into a LayeredModel (embed/block/head) for a pipeline"),
        (
            "cp",
            roles.cp_axis is not None,
            "its attention must be fs.parallel.ring_attention over cp: cut it into a LayeredModel, or leave cp out",
        ),
        ("remat", layout.remat, "enable the module's own checkpointing (HF: gradient_checkpointing_enable())"),
        ("sequence_parallel", layout.sequence_parallel, "leave sequence_parallel out"),
        ("microbatches", layout.microbatches > 1, "give a smaller batch per step"),
    ):
        if unsupported:
            raise LayoutError(f"Layout.{field}: the recipe does not run it for a {what} yet; {fix}")
    if roles.tp_axis is not None and model.tp_plan is None:
        raise LayoutError(
            f"Layout {layout.mesh_text()} has a tp axis but {what} has no TP plan: give ModuleModel(tp_plan="
            f"fs.parallel.HF_LLAMA_TP_PLAN) (or your own plan), or leave tp out"
        )
    dtypes = {str(x.dtype).removeprefix("torch.") for x in tree_util.leaves(params)}
    if dtypes != {str(roles.master_dtype).removeprefix("torch.")}:
        raise LayoutError(
            f"{what}'s parameters are {sorted(dtypes)} but Layout.master_dtype is {layout.master_dtype!r}: "
            f"convert the module (module.to(torch.{layout.master_dtype})) or set the layout's dtype"
        )


def compose_module_step(
    model: ModuleModel,
    layout: Layout,
    roles: Roles,
    optimizer: GradientTransformation,
    max_norm: float,
    jit_backend: str | None,
    inject: Injection,
) -> ComposedStep:
    """The :class:`~fshard.recipes.step.ComposedStep` of ``model`` on ``layout``'s ``roles``."""
    apply, params, buffers = functionalize(model.module)
    _refuse(model, layout, roles, params)
    shard_axis = roles.shard_axis
    if roles.tp_axis is not None:
        assert model.tp_plan is not None  # _refuse's check
        apply = tp_apply(apply, model.tp_plan, roles.tp_axis)
        specs = tp_specs(params, model.tp_plan, roles.tp_axis, fsdp_axis=shard_axis)
    elif shard_axis is not None:
        specs = fsdp_specs(params, shard_axis)
    else:
        specs = replicate_specs(params)
    if roles.data_axes:  # per-block FSDP over fsdp, gradients all-reduced over dp (HSDP with both)
        apply = fsdp_apply(
            apply,
            blocks=model.blocks,
            axis=shard_axis,
            replicate_axis=roles.replicate_axis,
            reshard_after_forward=True if roles.reshard is None else roles.reshard,
            prefetch=roles.prefetch,
            policy=roles.policy,
        )

    # The buffers (rotary tables, masks) are arguments, not closed over: fs.jit traces
    # its inputs only. Replicated: the same on every rank.
    in_specs = (specs, roles.batch_spec, roles.batch_spec, replicate_specs(buffers))

    def global_loss(wrap: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
        def loss_fn(p: Any, inputs: torch.Tensor, targets: torch.Tensor, b: Any) -> torch.Tensor:
            loss = wrap(model.loss(apply(p, inputs, buffers=b), targets))
            return pmean(loss, roles.data_axes) if roles.data_axes else loss

        return shard_map(loss_fn, mesh=roles.mesh, in_specs=in_specs, out_specs=P())

    def grads_fn(wrap: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
        return value_and_grad(global_loss(wrap))

    grads_of = grads_fn(inject.loss)
    paths = tree_util.zip_with_path(params)[0]
    order = {path: i for i, path in enumerate(paths)}

    eager = step_from_grads(grads_of, optimizer, roles, max_norm, inject, order, buffers)
    step: TrainStep = eager
    if jit_backend is not None:
        # The graph is traced without the fault injection: a step with one runs eagerly.
        step = jit_train_step(
            grads_fn(lambda loss: loss), eager, optimizer, roles, max_norm, inject, jit_backend, (buffers,)
        )

    def init_state(seed: int) -> tuple[Any, Any]:
        del seed  # the module's own values: seed the module
        # Copies: the step updates its params in place, and the module's stay as they were.
        sharded = shard(tree_util.tree_map(lambda x: x.detach().clone(), params), specs, roles.mesh, uneven=True)
        return sharded, optimizer.init(sharded)

    forward = global_loss(lambda loss: loss)

    def forward_loss(params: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The training step's forward in eval mode (dropout off, as HF's Trainer evaluates),
        # each submodule's own train/eval flag given back afterwards.
        modes = [(m, m.training) for m in model.module.modules()]
        model.module.eval()
        try:
            with torch.no_grad():
                return forward(params, inputs, targets, buffers)
        finally:
            for m, training in modes:
                m.train(training)

    return ComposedStep(step, init_state, model, roles, specs, None, order, forward_loss)

"""Validation loss: the composed step's loss on held-out batches, with no update.

:func:`make_eval_loss` gives ``eval_loss(params, inputs, targets) -> float`` for a
:class:`~fshard.recipes.step.ComposedStep`, the same on every rank and on every mesh (to
the rounding of the reductions, as the training loss):

- without a pipeline: forward only, :func:`~fshard.recipes.step.per_device_loss` under
  ``shard_map`` and ``torch.no_grad()`` (the training step's gathers and loss, no backward,
  no gradient reduction), one slice of the batch at a time for a layout with
  ``microbatches`` (the activations stay those of one training microbatch);
- with a pipeline: the training step's own pipeline (``fs.sched.pipeline_step``: forward
  and backward, every schedule, StageFSDP) with its gradients discarded: the simplest
  correct way on every schedule, at a training step's cost;
- a ``ModuleModel`` (an ``nn.Module``): the step's own forward and loss under its wrappers
  (``tp_apply``, ``fsdp_apply``), without a gradient and with the module in eval mode
  (:attr:`~fshard.recipes.step.ComposedStep.forward_loss`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fshard.mesh.spec import PartitionSpec as P
from fshard.recipes.errors import ConfigError
from fshard.recipes.faults import Injection
from fshard.recipes.model import LayeredModel
from fshard.recipes.pipeline import make_pipeline_grads
from fshard.recipes.step import ComposedStep, per_device_loss
from fshard.transforms import shard_map

__all__ = ["make_eval_loss"]

EvalLoss = Callable[[Any, torch.Tensor, torch.Tensor], float]


def _value(loss: Any) -> float:
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def make_eval_loss(composed: ComposedStep, microbatches: int = 1) -> EvalLoss:
    """``eval_loss(params, inputs, targets) -> float``: the mean loss of a global batch under
    ``composed``'s layout (collective: every rank calls it with the same batch).

    Args:
      composed: the composed train step (its model, roles, specs and pipeline).
      microbatches: the layout's microbatches (without a pipeline: the batch is evaluated
        in this many slices).

    Raises:
      ConfigError: the model is neither a ``LayeredModel`` nor one whose composed step has
        a ``forward_loss`` (a ``ModuleModel``'s has).
    """
    model, roles = composed.model, composed.roles
    if composed.forward_loss is not None:
        return _sliced(composed.forward_loss, microbatches)
    if not isinstance(model, LayeredModel):
        raise ConfigError(
            f"validation (val_batch_at, --val-every) runs on a LayeredModel or a ModuleModel; "
            f"{type(model).__name__} {getattr(model, 'name', '')!r} composes a step without a forward_loss: "
            f"give its ComposedStep one, evaluate it in your own loop, or leave validation off"
        )
    if composed.pipe is not None:
        grads_of = make_pipeline_grads(model, roles, composed.pipe, Injection())

        def pipeline_loss(params: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
            loss, _ = grads_of(params, inputs, targets)  # the gradients are dropped: no update
            return _value(loss)

        return pipeline_loss

    def body(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return per_device_loss(params, tokens, targets, None, True, model=model, roles=roles)

    forward = shard_map(
        body, mesh=roles.mesh, in_specs=(composed.specs, roles.batch_spec, roles.batch_spec), out_specs=P()
    )
    return _sliced(forward, microbatches)


def _sliced(forward: Callable[[Any, torch.Tensor, torch.Tensor], Any], microbatches: int) -> EvalLoss:
    """``forward``'s mean loss over ``microbatches`` slices of the batch, without a gradient."""

    def eval_loss(params: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with torch.no_grad():
            losses = [
                _value(forward(params, x, y)) for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches))
            ]
        return sum(losses) / len(losses)

    return eval_loss

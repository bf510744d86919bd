"""The train step of a :class:`~fshard.recipes.model.LayeredModel` on a layout, and its parts.

:func:`build_train_step` is the entry point: ``(init_state, step)`` for a model, a
``fs.parallel.Layout`` and an optimizer. The parts it composes are public too, for a script
that wants one of them (``examples/train_lm.py`` uses them all):

- :func:`per_device_loss` (inside ``shard_map``): FSDP/HSDP/DDP through
  ``fs.parallel.scan_layers`` per block and ``gather_params`` for the root, TP by the model's
  own pieces, the loss's mean over the data axes;
- :func:`make_grad_fn` and :func:`microbatch_grads` (gradient accumulation);
- :func:`make_train_step`, :func:`make_pipeline_step` (with pp) and
  :func:`make_jit_train_step` (``fs.jit``), all of the form
  ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss, grad_norm, report)``,
  where ``report`` is a :class:`~fshard.recipes.faults.NonFinite` for a step that was not
  finite (not applied), else None.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.jit import jit
from fshard.lax import pmean
from fshard.mesh.mesh import Mesh
from fshard.mesh.sharded_init import init_sharded
from fshard.mesh.spec import PartitionSpec as P
from fshard.optim.base import GradientTransformation, apply_updates
from fshard.optim.clipping import global_norm as optim_global_norm
from fshard.optim.fused import step as optim_step
from fshard.parallel.accumulate import GradAccumulator
from fshard.parallel.layout import Layout
from fshard.parallel.scan import ScanConfig, gather_params, scan_layers
from fshard.recipes.faults import Injection, NonFinite, first_nonfinite
from fshard.recipes.model import LayeredModel, ModelLike, resolve_model
from fshard.recipes.pipeline import Pipeline, make_pipeline_grads
from fshard.recipes.roles import Roles, check_batch, check_sp_rows
from fshard.transforms import shard_map, value_and_grad

__all__ = [
    "ComposedStep",
    "TrainStep",
    "apply_gradients",
    "build_train_step",
    "clip_by_global_norm",
    "compose_train_step",
    "global_norm",
    "init_params",
    "jit_train_step",
    "make_grad_fn",
    "make_jit_train_step",
    "make_pipeline_step",
    "make_train_step",
    "microbatch_grads",
    "param_order",
    "split_rows",
    "step_from_grads",
    "per_device_loss",
]

# step(params, opt_state, inputs, targets) -> (params, opt_state, loss, grad_norm, non-finite report or None)
TrainStep = Callable[[Any, Any, torch.Tensor, torch.Tensor], tuple[Any, Any, torch.Tensor, float, "NonFinite | None"]]


def per_device_loss(
    params: Any,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    acc: GradAccumulator | None,
    sync: bool,
    *,
    model: LayeredModel,
    roles: Roles,
) -> torch.Tensor:
    """The model's mean loss over the global batch, computed from this rank's rows.

    Runs inside ``shard_map``: ``params`` are local shards and ``tokens``/``targets``
    this rank's rows. The embeddings and head (the "root" group) are gathered once and
    kept; each block is gathered just before use with the next one prefetched, and its
    gradients are reduce-scattered as soon as backward produces them (or, with
    ``sync=False``, summed into ``acc`` for one reduction at the last microbatch).
    """
    axes = roles.group_axes(acc, sync)
    root = gather_params({k: v for k, v in params.items() if k != "layers"}, **axes)
    x = model.embed(root, tokens)  # (b, T, D)
    x = scan_layers(
        model.block,
        params["layers"],
        x,
        axis=roles.shard_axis,
        replicate_axis=roles.replicate_axes,
        config=ScanConfig(policy=roles.policy, **roles.layer_loop()),
        accumulate=acc,
        sync=sync,
    )
    loss = model.loss(model.head(root, x), targets)
    if not roles.loss_axes:  # e.g. tp only: every rank holds the whole batch
        return loss
    return pmean(loss, roles.loss_axes)  # every data (and cp) rank holds the same number of tokens


def init_params(model: LayeredModel, roles: Roles, seed: int, pipe: Pipeline | None = None) -> tuple[Any, Any]:
    """The parameters of ``model.init(seed, roles.master_dtype)``, built directly as shards.

    With a pipeline, only this rank's stages are built.

    Returns:
      ``(params, specs)``: a pytree of DTensors equal, on every mesh, to the one-process
      init; and their specs.
    """

    def init_fn(s: int) -> Any:
        params = model.init(s, roles.master_dtype)
        return params if pipe is None else pipe.keep_held(params)

    with torch.device("meta"):  # shapes only, for the spec rules: no memory, no RNG
        shapes = init_fn(seed)
    specs = model.specs(shapes, roles)
    return init_sharded(init_fn, specs, roles.mesh, seed, uneven=True), specs


def global_norm(grads: Any, roles: Roles) -> float:
    """The norm of all gradients, as if every DTensor were gathered (the same on every rank).

    With a pipeline each pp rank holds other layers, so their squared norms are added
    over pp (``sum_over``).
    """
    return float(optim_global_norm(grads, sum_over=roles.pp_axis or ()))


def clip_by_global_norm(grads: Any, max_norm: float, norm: float) -> Any:
    """Scales the gradients by ``min(1, max_norm / (norm + 1e-6))``.

    ``fs.optim.chain(fs.optim.clip_by_global_norm(max_norm, sum_over=...), adamw)`` does
    the same inside the optimizer; here the norm is also wanted for the log and the
    finiteness check. ``max_norm <= 0`` leaves them as they are.
    """
    if max_norm <= 0 or norm + 1e-6 <= max_norm:
        return grads
    coef = max_norm / (norm + 1e-6)
    return tree_util.tree_map(lambda g: g * coef, grads)


def apply_gradients(
    params: Any,
    opt_state: Any,
    grads: Any,
    loss: torch.Tensor,
    opt: GradientTransformation,
    roles: Roles,
    max_norm: float,
    order: dict[str, int],
) -> tuple[Any, Any, float, NonFinite | None]:
    """Clip, then one optimizer step; nothing at all when the loss or a gradient is not finite.

    The loss and the global norm are the same on every rank, so every rank takes the same
    branch (a NaN or inf anywhere makes the norm non-finite).

    Returns:
      ``(params, opt_state, grad_norm, report)``: the report is None after an update; else
      the params and state are the ones given, unchanged, and the report says what was
      not finite.
    """
    norm = global_norm(grads, roles)
    loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    if not (math.isfinite(norm) and math.isfinite(loss_value)):
        leaf, rank = first_nonfinite(grads, order)
        return params, opt_state, norm, NonFinite(loss_value, norm, leaf, rank)
    grads = clip_by_global_norm(grads, max_norm, norm)
    # The old params and state are not used again: donated (updated in place), on torch's
    # fused kernel for an optimizer made with fused=True.
    params, opt_state = optim_step(opt, grads, opt_state, params)
    return params, opt_state, norm, None


def make_grad_fn(
    model: LayeredModel, roles: Roles, specs: Any, wrap_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[..., Any]:
    """``grad_fn(params, tokens, targets, acc, sync) -> (loss, grads)`` on global values.

    Args:
      wrap_loss: applied to each rank's loss inside the body (the eager step's fault
        injection); None: the loss as it is.
    """

    def loss_fn(params, tokens, targets, acc, sync):
        loss = per_device_loss(params, tokens, targets, acc, sync, model=model, roles=roles)
        return loss if wrap_loss is None else wrap_loss(loss)

    # None in in_specs: the accumulator and the sync flag pass through as they are.
    return value_and_grad(
        shard_map(
            loss_fn, mesh=roles.mesh, in_specs=(specs, roles.batch_spec, roles.batch_spec, None, None), out_specs=P()
        )
    )


def microbatch_grads(
    grad_fn: Callable[..., Any], params: Any, tokens: torch.Tensor, targets: torch.Tensor, microbatches: int
) -> tuple[torch.Tensor, Any]:
    """The mean loss and gradients of the global batch ``(B, T)``, cut into ``microbatches`` slices.

    The slices are the same on every mesh; their gradients are accumulated and only the
    last slice reduces them, once, as FSDP2's ``set_requires_gradient_sync(False)`` would.
    The eager step runs this loop as it is; ``fs.jit`` unrolls it into one graph.

    Returns:
      ``(loss, grads)``: the mean over the microbatches of each.
    """
    acc = GradAccumulator() if microbatches > 1 else None
    losses = []
    for k, (tok, tgt) in enumerate(zip(split_rows(tokens, microbatches), split_rows(targets, microbatches))):
        loss, grads = grad_fn(params, tok, tgt, acc, k == microbatches - 1)
        losses.append(loss)
    if microbatches > 1:  # the last call's gradients are the sum over the microbatches
        grads = tree_util.tree_map(lambda g: g / microbatches, grads)
    return sum(losses) / microbatches, grads


def split_rows(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``x`` cut into ``n`` equal slices of dim 0, one per microbatch.

    A DTensor batch holds each rank's own rows (``fs.recipes.data.rank_batches``: microbatch
    ``k``'s rows of this rank are the ``k``-th slice of its block) and is cut locally, so no
    rank gathers the batch; ``Tensor.chunk`` on it would all-gather it first.
    """
    if n == 1:
        return [x]
    if not isinstance(x, DTensor):
        return list(x.chunk(n))
    shape = torch.Size((x.shape[0] // n, *x.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return [
        DTensor.from_local(c, x.device_mesh, x.placements, run_check=False, shape=shape, stride=stride)
        for c in x.to_local().chunk(n)
    ]


def step_from_grads(
    grads_of: Callable[..., tuple[torch.Tensor, Any]],
    opt: GradientTransformation,
    roles: Roles,
    max_norm: float,
    inject: Injection,
    order: dict[str, int],
    *extra: Any,
) -> TrainStep:
    """The eager train step around ``grads_of(params, inputs, targets, *extra) -> (loss, grads)``:
    the injected gradient fault, then :func:`apply_gradients` (clip, one optimizer step, or
    nothing at all for a step that is not finite)."""

    def step(params: Any, opt_state: Any, inputs: torch.Tensor, targets: torch.Tensor):
        loss, grads = grads_of(params, inputs, targets, *extra)
        params, opt_state, norm, bad = apply_gradients(
            params, opt_state, inject.grads(grads), loss, opt, roles, max_norm, order
        )
        return params, opt_state, loss, norm, bad

    return step


def make_train_step(
    model: LayeredModel,
    roles: Roles,
    specs: Any,
    opt: GradientTransformation,
    microbatches: int,
    max_norm: float,
    inject: Injection,
    order: dict[str, int],
) -> TrainStep:
    """The train step on global values (DTensor params, the whole batch on every rank).

    With ``microbatches > 1`` the gradients are accumulated over that many slices of the
    batch (:func:`microbatch_grads`).
    """
    grad_fn = make_grad_fn(model, roles, specs, inject.loss)

    def grads_of(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return microbatch_grads(grad_fn, params, tokens, targets, microbatches)

    return step_from_grads(grads_of, opt, roles, max_norm, inject, order)


def make_pipeline_step(
    model: LayeredModel,
    roles: Roles,
    pipe: Pipeline,
    opt: GradientTransformation,
    max_norm: float,
    inject: Injection,
    order: dict[str, int],
) -> TrainStep:
    """The train step with the layers spread over the pp axis: ``fs.sched.pipeline_step``.

    Every rank runs its row of the schedule: forward and backward of its stages for each
    microbatch, activations and their gradients sent to the neighbouring stages. Inside
    a stage the blocks run as without a pipeline (TP collectives included). FSDP is the
    executor's (``fsdp=StageFSDP``): each stage's shards are gathered in one flat
    all-gather per step, kept over the microbatches, and their gradients reduce-scattered
    once per step (then all-reduced over dp for HSDP).
    """
    return step_from_grads(make_pipeline_grads(model, roles, pipe, inject), opt, roles, max_norm, inject, order)


def make_jit_train_step(
    model: LayeredModel,
    roles: Roles,
    specs: Any,
    opt: GradientTransformation,
    microbatches: int,
    max_norm: float,
    inject: Injection,
    order: dict[str, int],
    backend: str,
    pipe: Pipeline | None = None,
) -> TrainStep:
    """``--jit``: :func:`make_train_step`'s step (with ``pipe``, :func:`make_pipeline_step`'s)
    as one graph compiled by ``fs.jit``. A pipeline's point-to-point transfers run eagerly
    in program order between compiled regions (``fshard/jit/p2p.py``).

    ``fs.jit`` traces without values, so what the eager step decides on the host moves:

    - clipping multiplies by ``min(1, max_norm / (norm + 1e-6))`` computed in float64
      tensors (the eager step's Python floats, so the same values), also when it is 1;
    - the graph always updates; the host then reads the loss and the norm it returned,
      and for a non-finite step keeps the params and state it had and runs that step
      eagerly, which reports the first non-finite gradient (and does not update);
    - a step with an injected fault (``--inject-nonfinite``, host-side Python) runs eagerly.

    The graph does not update in place (no ``donate()``): the old params must
    survive a non-finite step.

    Gradient accumulation (``microbatches > 1``) is the eager step's loop, unrolled in the
    graph: one trace holds every microbatch's forward and backward and the one reduction.
    """
    if pipe is not None:
        eager = make_pipeline_step(model, roles, pipe, opt, max_norm, inject, order)
        grads_of = make_pipeline_grads(model, roles, pipe, Injection())  # a fault step runs eagerly
    else:
        eager = make_train_step(model, roles, specs, opt, microbatches, max_norm, inject, order)
        grad_fn = make_grad_fn(model, roles, specs)

        def grads_of(params, tokens, targets):
            return microbatch_grads(grad_fn, params, tokens, targets, microbatches)

    return jit_train_step(grads_of, eager, opt, roles, max_norm, inject, backend)


def jit_train_step(
    grads_of: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]],
    eager: TrainStep,
    opt: GradientTransformation,
    roles: Roles,
    max_norm: float,
    inject: Injection,
    backend: str,
    extra: tuple[Any, ...] = (),
) -> TrainStep:
    """The step ``grads_of`` -> clip -> ``opt`` as one ``fs.jit`` graph, falling back to the
    ``eager`` step (the same step, uncompiled) for a step with an injected fault and to
    report a non-finite one (see :func:`make_jit_train_step`).

    Args:
      grads_of: ``(params, inputs, targets, *extra) -> (loss, grads)`` on global values.
      eager: the eager train step of the same model and layout.
      extra: more arguments of ``grads_of`` (a module's buffers): the graph takes them as
        inputs, since it bakes in no tensor as a constant.
    """

    def compiled(params: Any, opt_state: Any, tokens: torch.Tensor, targets: torch.Tensor, *more: Any):
        loss, grads = grads_of(params, tokens, targets, *more)
        # With a pipeline each pp rank holds other layers: their squared norms add over pp.
        norm = optim_global_norm(grads, sum_over=roles.pp_axis or ())
        if max_norm > 0:
            # Float64 tensors, and max_norm divided (not multiplied by a reciprocal, as
            # `float / tensor` would): the eager step's Python arithmetic, bit for bit.
            wide = norm.to(torch.float64)
            coef = torch.clamp(torch.full((), max_norm, dtype=torch.float64).div(wide + 1e-6), max=1.0)
            grads = tree_util.tree_map(lambda g: g * coef, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss, norm

    jitted = jit(compiled, backend=None if backend == "none" else backend)

    def step(params: Any, opt_state: Any, tokens: torch.Tensor, targets: torch.Tensor):
        if inject.active:
            return eager(params, opt_state, tokens, targets)
        new_params, new_state, loss, norm = jitted(params, opt_state, tokens, targets, *extra)
        norm_value = float(norm)
        loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        if not (math.isfinite(norm_value) and math.isfinite(loss_value)):
            return eager(params, opt_state, tokens, targets)  # no update, and the report
        return new_params, new_state, loss, norm_value, None

    return step


def param_order(model: LayeredModel, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Parameter path -> its place in the model's tree (the order "the first non-finite
    gradient" is counted in); from shapes only."""
    with torch.device("meta"):
        paths, _, _ = tree_util.zip_with_path(model.init(0, dtype))
    return {p: i for i, p in enumerate(paths)}


@attrs.frozen
class ComposedStep:
    """What :func:`compose_train_step` built: the step and the pieces a training loop needs
    around it (the trainer in :mod:`fshard.recipes.trainer` uses them all).

    Attributes:
      step: ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss,
        grad_norm, report)`` (see :func:`build_train_step`).
      init_state: ``init_state(seed) -> (params, opt_state)``: the parameters as shards
        (equal on every mesh to the one-process values) and the optimizer's state for them.
      model: the model (a ``LayeredModel`` resolved for ``roles``, or a ``ModuleModel``).
      roles: the layout's roles on the mesh.
      specs: the parameters' specs (on a pipeline: of the blocks this rank holds).
      pipe: the pipeline (schedule, stage placement), or None without a ``pp`` axis.
      order: parameter path -> place in the model's tree.
      forward_loss: ``forward_loss(params, inputs, targets) -> loss``, the mean loss of a
        global batch by the step's own forward (no gradient, no update), for a model that
        composes its own step (a ``ModuleModel``); None: :mod:`fshard.recipes.validate`
        builds it from the ``LayeredModel``.
    """

    step: TrainStep
    init_state: Callable[[int], tuple[Any, Any]]
    model: Any
    roles: Roles
    specs: Any
    pipe: Pipeline | None
    order: dict[str, int]
    forward_loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def compose_train_step(
    model: ModelLike,
    layout: Layout,
    optimizer: GradientTransformation,
    *,
    mesh: Mesh | None = None,
    max_norm: float = 0.0,
    jit_backend: str | None = None,
    inject: Injection | None = None,
) -> ComposedStep:
    """:func:`build_train_step`, returning the pieces too (a :class:`ComposedStep`).

    ``inject`` is a testing aid (:class:`~fshard.recipes.faults.Injection`): the step makes
    the loss or one gradient non-finite at the step it names. The other arguments, and the
    errors, are :func:`build_train_step`'s.
    """
    layout.validate()
    check_sp_rows(layout)
    mesh = layout.mesh() if mesh is None else mesh
    roles = Roles.of(layout, mesh)
    check_batch(layout.batch, layout.microbatches, mesh, roles)
    inject = inject or Injection()
    if hasattr(model, "compose"):  # a model that composes its own step (fs.recipes.ModuleModel)
        return model.compose(layout, roles, optimizer, max_norm, jit_backend, inject)
    model = resolve_model(model, roles)
    with torch.device("meta"):
        shapes = model.init(0, roles.master_dtype)
    pipe = None
    if roles.pp_axis is not None:
        pipe = Pipeline.build(layout.schedule, mesh, len(shapes["layers"]), layout.microbatches, layout.virtual, model)
        shapes = pipe.keep_held(shapes)
    specs = model.specs(shapes, roles)
    order = param_order(model, roles.master_dtype)
    if jit_backend is not None:
        step = make_jit_train_step(
            model, roles, specs, optimizer, layout.microbatches, max_norm, inject, order, jit_backend, pipe
        )
    elif pipe is not None:
        step = make_pipeline_step(model, roles, pipe, optimizer, max_norm, inject, order)
    else:
        step = make_train_step(model, roles, specs, optimizer, layout.microbatches, max_norm, inject, order)

    def init_state(seed: int) -> tuple[Any, Any]:
        params, _ = init_params(model, roles, seed, pipe)
        return params, optimizer.init(params)

    return ComposedStep(step, init_state, model, roles, specs, pipe, order)


def build_train_step(
    model: ModelLike,
    layout: Layout,
    optimizer: GradientTransformation,
    *,
    mesh: Mesh | None = None,
    max_norm: float = 0.0,
    jit_backend: str | None = None,
) -> tuple[Callable[[int], tuple[Any, Any]], TrainStep]:
    """The composed train step of ``model`` on ``layout``: FSDP, HSDP, DDP, TP (with sequence
    parallelism), pipelines and their products, gradient accumulation, remat, mixed
    precision and clipping, as ``layout`` says.

    Args:
      model: a :class:`~fshard.recipes.model.LayeredModel`, or ``roles -> LayeredModel`` for
        a model whose pieces depend on the layout (``fs.recipes.transformer(cfg)``).
      layout: the ``fs.parallel.Layout``; its ``batch`` is the global batch the step takes.
      optimizer: an ``fs.optim`` transformation; its state is sharded like the parameters.
      mesh: the mesh to run on (default ``layout.mesh()``); its axis names give the roles
        (``pp``, ``dp``, ``fsdp``, ``tp``).
      max_norm: clip the gradients' global norm to this (0: no clipping).
      jit_backend: compile the whole step with ``fs.jit`` and this ``torch.compile`` backend
        (``"inductor"``, ``"aot_eager"``; ``"none"`` runs the captured graph uncompiled).

    Returns:
      ``(init_state, step)``: ``init_state(seed) -> (params, opt_state)`` builds the
      parameters as shards (equal on every mesh to ``model.init(seed, ...)`` in one process)
      and the optimizer state; ``step(params, opt_state, inputs, targets) -> (params,
      opt_state, loss, grad_norm, report)`` on global values (the whole batch on every
      rank); ``report`` is None, or the :class:`~fshard.recipes.faults.NonFinite` of a step
      that was not finite and was not applied. The eager step updates the parameters and
      the optimizer state in place (``fs.optim.donate()``): use the ones it returns, not the
      ones passed in; a step that was not finite leaves both as they were.

    Raises:
      LayoutError: the layout does not fit the mesh, the model or the batch; the message
        names the field and the sizes.
    """
    composed = compose_train_step(model, layout, optimizer, mesh=mesh, max_norm=max_norm, jit_backend=jit_backend)
    return composed.init_state, composed.step

"""Gradient transformations: scaling, weight decay, momentum, Adam, global-norm clipping.

The moment arithmetic is torch.optim's own (``torch.optim.sgd.sgd`` and
``torch.optim.adam.adam`` with ``foreach=True``), run on this rank's local shards. The
kernels update their arguments in place, so each step hands them fresh copies of the
state and a zero buffer that receives the update; the inputs are never touched.

Sign convention (optax's): ``trace`` and ``scale_by_adam`` return a *descent direction
with the gradient's sign*; ``scale_by_learning_rate`` multiplies by ``-lr``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adam import adam as _torch_adam
from torch.optim.sgd import sgd as _torch_sgd

from fshard import tree as tree_util
from fshard.optim.base import (
    EmptyState,
    GradientTransformation,
    Params,
    ScalarOrSchedule,
    Schedule,
    Updates,
    all_private,
    flatten_matching,
    identity,
    map_updates,
    mark_private,
    new_count,
    state_for_kernel,
    to_locals,
    wrap_like,
    zeros_like_tree,
)

__all__ = [
    "scale",
    "ScaleByScheduleState",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "TraceState",
    "trace",
    "ScaleByAdamState",
    "scale_by_adam",
    "global_norm",
    "clip_by_global_norm",
]

_STATE = "the optimizer state"  # how errors name the tree that init built from the params


def _check_hparam(what: str, name: str, value: Any, lo: float, hi: float = math.inf, *,
                  lo_open: bool = False, hi_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{what}: {name}={value!r} must be a number in {lb}{lo}, {hi}{hb}.")


def scale(step_size: float) -> GradientTransformation:
    """Multiplies every update by a constant: ``u <- step_size * u``.

    Args:
      step_size: the factor (a Python number, or a 0-dim tensor).

    Returns:
      A stateless :class:`GradientTransformation` (:class:`EmptyState`).

    Example:
      >>> opt = fs.optim.chain(fs.optim.trace(0.9), fs.optim.scale(-0.1))  # doctest: +SKIP
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        return map_updates(updates, lambda xs: torch._foreach_mul(xs, step_size),
                           lambda xs: torch._foreach_mul_(xs, step_size)), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`."""

    count: torch.Tensor  # shape=(), dtype=int64, on CPU: updates done so far.


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiplies the updates of step ``t`` (from 0) by ``step_size_fn(t)``.

    Args:
      step_size_fn: ``step -> factor``, e.g. a schedule from :mod:`fshard.optim.schedules`.

    Returns:
      A :class:`GradientTransformation` with :class:`ScaleByScheduleState`.

    Raises:
      TypeError: ``step_size_fn`` is not callable.
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be callable, got {step_size_fn!r}.")

    def init_fn(params: Params) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(count=new_count())

    def update_fn(updates: Updates, state: ScaleByScheduleState, params: Params | None = None):
        del params
        factor = step_size_fn(int(state.count))
        new = map_updates(updates, lambda xs: torch._foreach_mul(xs, factor),
                          lambda xs: torch._foreach_mul_(xs, factor))
        return new, ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiplies the updates by ``-learning_rate`` (by ``+learning_rate`` if not ``flip_sign``).

    Args:
      learning_rate: a number, or a schedule ``step -> number``.
      flip_sign: negate, so that a gradient-signed direction becomes a descent step
        (optional, default True).

    Returns:
      :func:`scale` for a number, :func:`scale_by_schedule` for a schedule.

    Raises:
      ValueError: a negative number.
    """
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda step: sign * learning_rate(step))
    _check_hparam("scale_by_learning_rate", "learning_rate", learning_rate, 0.0)
    return scale(sign * learning_rate)


def add_decayed_weights(weight_decay: float = 0.0,
                        mask: Any | Callable[[Params], Any] | None = None) -> GradientTransformation:
    """Adds the decayed parameters: ``u <- u + weight_decay * p``.

    Placed before the momentum/Adam transform this is L2 regularization (torch's
    ``SGD``/``Adam`` ``weight_decay``); placed after it, decoupled decay (``AdamW``).

    Args:
      weight_decay: the factor, >= 0 (optional, default 0: the transform does nothing).
      mask: which leaves to decay (optional, default all): a pytree of bools with the
        params' structure, or a function ``params -> such a pytree`` (e.g. to skip
        biases and norms).

    Returns:
      A stateless :class:`GradientTransformation`; its ``update`` needs ``params``.

    Raises:
      ValueError: a negative ``weight_decay``; (from ``update``) missing ``params``, or
        ``params``/``mask`` whose structure or sharding differs from the updates.
    """
    _check_hparam("add_decayed_weights", "weight_decay", weight_decay, 0.0)
    if weight_decay == 0.0:
        return identity()

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None):
        if params is None:
            raise ValueError("add_decayed_weights needs the params: call update(grads, state, params).")
        p, u, treedef = flatten_matching("add_decayed_weights", ("params", params), ("grads", updates))
        keep = [True] * len(p)
        if mask is not None:
            m = mask(params) if callable(mask) else mask
            keep, td = tree_util.tree_flatten(m)
            if td != tree_util.structure(tree_util.tree_map(lambda _: True, params)):
                raise ValueError(f"add_decayed_weights: mask must have the params' structure "
                                 f"{treedef} with bool leaves, got {td}.")
        idx = [i for i, k in enumerate(keep) if k]
        out = list(u)
        with torch.no_grad():
            ul, pl = to_locals([u[i] for i in idx]), to_locals([p[i] for i in idx])
            if ul and all_private(ul):
                torch._foreach_add_(ul, pl, alpha=weight_decay)
            elif ul:
                decayed = torch._foreach_add(ul, pl, alpha=weight_decay)
                mark_private(decayed)
                for i, d in zip(idx, decayed):
                    out[i] = wrap_like(d, u[i])
        return tree_util.tree_unflatten(treedef, out), state

    return GradientTransformation(init_fn, update_fn)


class TraceState(NamedTuple):
    """State of :func:`trace`."""

    trace: Params  # momentum buffers: like the params (same shapes, dtypes, sharding)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum, by ``torch.optim.sgd.sgd`` (``dampening=0``) on local shards.

    ``b <- decay * b + g``; the update is ``b``, or ``g + decay * b`` with ``nesterov``
    (torch's rule; ``b`` starts at zero, so step 1 gives ``b = g`` as torch does).

    Args:
      decay: the momentum, >= 0.
      nesterov: use Nesterov momentum (optional, default False).

    Returns:
      A :class:`GradientTransformation` with :class:`TraceState`.

    Raises:
      ValueError: a negative ``decay``; (from ``update``) grads whose structure or
        sharding differs from the state, naming the path.
    """
    _check_hparam("trace", "decay", decay, 0.0)

    def init_fn(params: Params) -> TraceState:
        return TraceState(trace=zeros_like_tree(params, "trace.init"))

    def update_fn(updates: Updates, state: TraceState, params: Params | None = None):
        del params
        b, g, treedef = flatten_matching("trace.update", (_STATE, state.trace), ("grads", updates))
        with torch.no_grad():
            gl = to_locals(g)
            if nesterov and not all_private(gl):
                gl = [x.clone() for x in gl]  # the kernel adds decay * b into the grads in place
            bl = state_for_kernel(to_locals(b))
            out = [torch.zeros_like(x) for x in gl]  # receives 0 - lr * step with lr = -1
            mark_private(out)
            if gl:
                _torch_sgd(out, gl, bl, foreach=True, weight_decay=0.0, momentum=decay,
                           lr=-1.0, dampening=0.0, nesterov=nesterov, maximize=False)
        new_updates = tree_util.tree_unflatten(treedef, [wrap_like(o, x) for o, x in zip(out, g)])
        new_trace = tree_util.tree_unflatten(treedef, [wrap_like(o, x) for o, x in zip(bl, b)])
        return new_updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`."""

    count: torch.Tensor  # shape=(), dtype=int64, on CPU: steps done so far.
    mu: Params  # first moments: like the params (same shapes, dtypes, sharding)
    nu: Params  # second moments: like the params


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction, by ``torch.optim.adam.adam`` on local shards.

    With ``t`` the step (from 1)::

      m <- b1 * m + (1 - b1) * g          v <- b2 * v + (1 - b2) * g^2
      u  = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Args:
      b1: decay of the first moment, in [0, 1) (optional, default 0.9).
      b2: decay of the second moment, in [0, 1) (optional, default 0.999).
      eps: added to the denominator, >= 0 (optional, default 1e-8).

    Returns:
      A :class:`GradientTransformation` with :class:`ScaleByAdamState`; the moments are
      sharded like the params (global shape ``S``, per rank the local shard of ``S``).

    Raises:
      ValueError: a hyperparameter out of range; (from ``update``) grads whose structure
        or sharding differs from the state, naming the path.
    """
    _check_hparam("scale_by_adam", "b1", b1, 0.0, 1.0, hi_open=True)
    _check_hparam("scale_by_adam", "b2", b2, 0.0, 1.0, hi_open=True)
    _check_hparam("scale_by_adam", "eps", eps, 0.0)

    def init_fn(params: Params) -> ScaleByAdamState:
        mu = zeros_like_tree(params, "scale_by_adam.init")
        return ScaleByAdamState(count=new_count(), mu=mu, nu=zeros_like_tree(params, "scale_by_adam.init"))

    def update_fn(updates: Updates, state: ScaleByAdamState, params: Params | None = None):
        del params
        mu, nu, g, treedef = flatten_matching(
            "scale_by_adam.update", (_STATE, state.mu), ("the second moments", state.nu), ("grads", updates))
        with torch.no_grad():
            gl = to_locals(g)
            ml = state_for_kernel(to_locals(mu))
            vl = state_for_kernel(to_locals(nu))
            out = [torch.zeros_like(x) for x in gl]  # receives 0 - lr * step with lr = -1
            mark_private(out)
            # One step counter per leaf, as the kernel increments each of them.
            steps = [torch.tensor(float(state.count), dtype=torch.float64) for _ in gl]
            if gl:
                _torch_adam(
                    out, gl, ml, vl, [], steps, foreach=True, capturable=False, differentiable=False,
                    has_complex=any(torch.is_complex(x) for x in gl), amsgrad=False, beta1=b1,
                    beta2=b2, lr=-1.0, weight_decay=0.0, eps=eps, maximize=False)
        unflat = tree_util.tree_unflatten
        return unflat(treedef, [wrap_like(o, x) for o, x in zip(out, g)]), ScaleByAdamState(
            count=state.count + 1,
            mu=unflat(treedef, [wrap_like(o, x) for o, x in zip(ml, mu)]),
            nu=unflat(treedef, [wrap_like(o, x) for o, x in zip(vl, nu)]),
        )

    return GradientTransformation(init_fn, update_fn)


# --- global norm --------------------------------------------------------------------


def global_norm(updates: Updates) -> torch.Tensor:
    """The 2-norm of all leaves together, as if every DTensor were gathered first.

    For DTensor leaves each rank squares and sums its local shards, and one scalar
    all-reduce sums over the mesh axes that any leaf is sharded on (one per axis when
    those axes do not span every rank); none when every leaf is replicated. A leaf
    counts only on the ranks at index 0 of the reduced axes it is replicated over, so
    replicas are never counted twice. Plain tensors are taken as they are: outside
    ``shard_map`` they are whole values; inside, local shards (the norm is then local).

    Args:
      updates: a pytree of tensors / DTensors (e.g. gradients), global shape ``S`` each.

    Returns:
      A 0-dim tensor, the same on every rank: float64 if any leaf is float64, else
      float32.

    Raises:
      ValueError: a leaf with a ``Partial`` placement (reduce it first), naming the path.

    Example:
      >>> norm = fs.optim.global_norm(grads)  # doctest: +SKIP
    """
    paths, leaves, _ = tree_util.zip_with_path(updates)
    if not leaves:
        return torch.zeros(())
    acc = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
    by_mesh: dict[Any, list[tuple[str, DTensor]]] = {}
    plain = []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            by_mesh.setdefault(id(x.device_mesh), []).append((path, x))
        else:
            plain.append(x)
    with torch.no_grad():
        device = to_locals(leaves[:1])[0].device
        total = torch.zeros((), dtype=acc, device=device)
        if plain:
            total = total + _sum_squares(plain, acc).to(device)
        for group in by_mesh.values():
            total = total + _mesh_sum_squares(group, acc).to(device)
    return total.sqrt()


def _sum_squares(locals_: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    norms = torch._foreach_norm(locals_, 2, dtype=acc)
    return torch.stack(norms).square().sum()


def _mesh_sum_squares(group: list[tuple[str, DTensor]], acc: torch.dtype) -> torch.Tensor:
    mesh = group[0][1].device_mesh
    sizes, coord = mesh.mesh.shape, mesh.get_coordinate()
    sharded_on = []
    for path, x in group:
        dims = set()
        for i, p in enumerate(x.placements):
            if isinstance(p, Partial):
                raise ValueError(
                    f"global_norm: {path} has a Partial placement on mesh dim {i} (a pending sum); "
                    "its local values are not its shards. Reduce it first, e.g. "
                    "x.redistribute(placements=[Replicate() if p.is_partial() else p for p in x.placements]).")
            if isinstance(p, (Shard, _StridedShard)) and sizes[i] > 1:  # no subclass of Shard
                dims.add(i)
        sharded_on.append(dims)
    reduce_dims = sorted(set().union(*sharded_on))
    # A leaf counts where it is at index 0 of every reduced dim it is replicated over.
    counted = [x for (_, x), dims in zip(group, sharded_on)
               if all(coord[d] == 0 for d in reduce_dims if d not in dims)]
    local = to_locals(counted)
    device = to_locals([group[0][1]])[0].device
    total = _sum_squares(local, acc).to(device) if local else torch.zeros((), dtype=acc, device=device)
    for pg in _groups_over(mesh, reduce_dims):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pg)
    return total


def _groups_over(mesh: Any, dims: list[int]) -> list[Any]:
    """Process groups whose successive all-reduces sum over the mesh dims ``dims``."""
    if not dims:
        return []
    if math.prod(mesh.mesh.shape[d] for d in dims) == dist.get_world_size():
        return [dist.group.WORLD]  # these dims span every rank: one collective does it
    return [mesh.get_group(d) for d in dims]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` = :func:`global_norm`.

    Same rule as ``torch.nn.utils.clip_grad_norm_``; the norm is the global one on
    any mesh (see :func:`global_norm`), so clipping sharded grads equals clipping
    the gathered grads. Never synchronizes the device with the host. Inside a
    ``shard_map`` body the leaves are plain local shards and the norm is the local one:
    clip outside the body, on the DTensors it returns.

    Args:
      max_norm: the largest norm let through, > 0.

    Returns:
      A stateless :class:`GradientTransformation`.

    Raises:
      ValueError: ``max_norm <= 0``; (from ``update``) a leaf with a ``Partial``
        placement.

    Example:
      >>> opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=3e-4))  # doctest: +SKIP
    """
    _check_hparam("clip_by_global_norm", "max_norm", max_norm, 0.0, lo_open=True)

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        coef = torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0)

        factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

        def factor(x: torch.Tensor) -> torch.Tensor:
            key = (x.device, x.dtype)
            if key not in factors:
                factors[key] = coef.to(device=x.device, dtype=x.dtype)
            return factors[key]

        def out_of_place(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            if len({(x.device, x.dtype) for x in xs}) == 1:
                return torch._foreach_mul(xs, factor(xs[0]))
            return [x * factor(x) for x in xs]

        new = map_updates(updates, out_of_place, lambda xs: [x.mul_(factor(x)) for x in xs])
        return new, state

    return GradientTransformation(init_fn, update_fn)

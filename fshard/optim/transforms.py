"""Gradient transformations: scaling, schedules, weight decay, momentum, Adam.

The moment arithmetic is torch.optim's own (``torch.optim.sgd.sgd`` and
``torch.optim.adam.adam`` with ``foreach=True``), run on this rank's local shards. The
kernels update their arguments in place, so each step hands them fresh copies of the
state and a zero buffer that receives the update; the inputs are never touched.

Sign convention (optax's): ``trace`` and ``scale_by_adam`` return a *descent direction
with the gradient's sign*; ``scale_by_learning_rate`` multiplies by ``-lr``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
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
    check_hparam,
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
]

_STATE = "the optimizer state"  # how errors name the tree that init built from the params


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
        return map_updates(
            updates, lambda xs: torch._foreach_mul(xs, step_size), lambda xs: torch._foreach_mul_(xs, step_size)
        ), state

    return GradientTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`."""

    count: torch.Tensor  # shape=(), dtype=int64, on CPU: updates done so far.


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiplies the updates of step ``t`` (from 0) by ``step_size_fn(t)``.

    Eagerly ``t`` is a Python int (the count is read on the host). Under :func:`fshard.jit`
    it is the count itself, a 0-dim int64 tensor, so that the schedule becomes tensor ops
    in the one compiled graph instead of a trace-time constant (reading the count there
    cannot be traced, and passing it as a Python int would compile once per step).

    Args:
      step_size_fn: ``step -> factor``, e.g. a schedule from :mod:`fshard.optim.schedules`;
        to be jitted it must accept a tensor step (see that module).

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
        count = state.count
        if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(count) is not None:
            factor = step_size_fn(count)  # traced (fs.jit): no value to read
            if isinstance(factor, torch.Tensor):
                (factor,) = _computed_once(factor)  # a cosine per leaf and element otherwise
        else:
            factor = step_size_fn(int(count))

        def by(xs: list[torch.Tensor]):
            # A tensor factor lives where the count does (the CPU); the updates may not.
            return factor.to(xs[0].device) if isinstance(factor, torch.Tensor) else factor

        new = map_updates(
            updates, lambda xs: torch._foreach_mul(xs, by(xs)), lambda xs: torch._foreach_mul_(xs, by(xs))
        )
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
    check_hparam("scale_by_learning_rate", "learning_rate", learning_rate, 0.0)
    return scale(sign * learning_rate)


def add_decayed_weights(
    weight_decay: float = 0.0, mask: Any | Callable[[Params], Any] | None = None
) -> GradientTransformation:
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
    check_hparam("add_decayed_weights", "weight_decay", weight_decay, 0.0)
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
                raise ValueError(
                    f"add_decayed_weights: mask must have the params' structure {treedef} with bool leaves, got {td}."
                )
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
    check_hparam("trace", "decay", decay, 0.0)

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
            # receives 0 - lr * step with lr = -1
            out = _zeros_like_each(gl, bool(gl) and torch._guards.detect_fake_mode(gl[0]) is not None)
            mark_private(out)
            if gl:
                _torch_sgd(
                    out,
                    gl,
                    bl,
                    foreach=True,
                    weight_decay=0.0,
                    momentum=decay,
                    lr=-1.0,
                    dampening=0.0,
                    nesterov=nesterov,
                    maximize=False,
                )
        new_updates = tree_util.tree_unflatten(treedef, [wrap_like(o, x) for o, x in zip(out, g)])
        new_trace = tree_util.tree_unflatten(treedef, [wrap_like(o, x) for o, x in zip(bl, b)])
        return new_updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`."""

    count: torch.Tensor  # shape=(), dtype=int64, on CPU: steps done so far.
    mu: Params  # first moments: like the params (same shapes, dtypes, sharding)
    nu: Params  # second moments: like the params


def _adam_traced(out, g, m, v, count: torch.Tensor, b1: float, b2: float, eps: float) -> None:
    """Adam's step with the step count kept a tensor, for :func:`fshard.jit` (which traces
    without values: torch's non-capturable kernel reads the count in Python, and its
    capturable one refuses CPU tensors).

    The operations of torch's non-capturable foreach kernel in its order, so that a
    float32 step rounds exactly as eager does: the bias corrections are float64 0-dim
    tensors where torch has Python floats (the same IEEE double arithmetic, cast to the
    moments' dtype where they meet them), and the step size multiplies ``m`` before the
    division, as ``addcdiv``'s kernel computes ``out + value * m / denom``. Dividing by
    the bias correction afterwards instead differs by an ulp, which compounds into
    float32 losses 1e-7 apart after a few steps."""
    t = count.to(torch.float64) + 1
    step_size, bc2_sqrt = _computed_once(1 / (1 - torch.pow(b1, t)), (1 - torch.pow(b2, t)).sqrt())
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, 1 - b2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(out, torch._foreach_mul(m, step_size), denom)


def _computed_once(*scalars: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The 0-dim tensors ``scalars``, unchanged, each computed once per call of a compiled
    graph (fs.jit).

    Inductor inlines a pointwise scalar computation into every kernel that reads it, and
    into the loop body there: Adam's two bias corrections (a ``pow`` each) would be computed
    again for every 16 elements of every leaf, which makes the compiled AdamW step more than
    twice as slow (``bench/README.md``, "Host costs behind the code"). Stacked with zeros
    into a ``(k, 2)`` buffer, the scalars are computed once (Inductor realizes that buffer:
    in the generated code the kernels load it), and read
    back through a sum with 0 (exact), which Inductor unrolls into the loads. This relies
    on how Inductor lowers the stack; it changes no value whatever it does. Eagerly the
    scalars come back as given.
    """
    if not scalars or torch._guards.detect_fake_mode(scalars[0]) is None:
        return scalars
    s = torch.stack(scalars)  # (k,)
    s = torch.stack([s, torch.zeros_like(s)], 1).sum(1)  # (k, 2) -> (k,): a reduction, realized
    return tuple(s.unbind())


def _zeros_like_each(xs: list[torch.Tensor], traced: bool = False) -> list[torch.Tensor]:
    """New zero tensors like ``xs``: allocations, then one multi-tensor kernel (a GPU
    launch per leaf otherwise, which a small model's step is bound by).

    Traced (fs.jit), one ``zeros_like`` per leaf instead: Inductor folds those zeros into
    the kernel that reads them, while ``_foreach_zero_`` is an aten call that writes every
    buffer once more before the update reads it back."""
    if traced:
        return [torch.zeros_like(x) for x in xs]
    out = [torch.empty_like(x) for x in xs]
    if out:
        torch._foreach_zero_(out)
    return out


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
    check_hparam("scale_by_adam", "b1", b1, 0.0, 1.0, hi_open=True)
    check_hparam("scale_by_adam", "b2", b2, 0.0, 1.0, hi_open=True)
    check_hparam("scale_by_adam", "eps", eps, 0.0)

    def init_fn(params: Params) -> ScaleByAdamState:
        mu = zeros_like_tree(params, "scale_by_adam.init")
        return ScaleByAdamState(count=new_count(), mu=mu, nu=zeros_like_tree(params, "scale_by_adam.init"))

    def update_fn(updates: Updates, state: ScaleByAdamState, params: Params | None = None):
        del params
        mu, nu, g, treedef = flatten_matching(
            "scale_by_adam.update", (_STATE, state.mu), ("the second moments", state.nu), ("grads", updates)
        )
        with torch.no_grad():
            gl = to_locals(g)
            ml = state_for_kernel(to_locals(mu))
            vl = state_for_kernel(to_locals(nu))
            traced = bool(gl) and torch._guards.detect_fake_mode(state.count) is not None
            out = _zeros_like_each(gl, traced)  # receives 0 - lr * step with lr = -1
            mark_private(out)
            if traced:
                _adam_traced(out, gl, ml, vl, state.count, b1, b2, eps)  # fs.jit: no value to read
            elif gl:
                # One step counter per leaf, as the kernel increments each of them: views of
                # one tensor, made in one call rather than a torch.tensor per leaf.
                steps = list(torch.full((len(gl),), float(state.count), dtype=torch.float64).unbind())
                _torch_adam(
                    out,
                    gl,
                    ml,
                    vl,
                    [],
                    steps,
                    foreach=True,
                    capturable=False,
                    differentiable=False,
                    has_complex=any(torch.is_complex(x) for x in gl),
                    amsgrad=False,
                    beta1=b1,
                    beta2=b2,
                    lr=-1.0,
                    weight_decay=0.0,
                    eps=eps,
                    maximize=False,
                )
        unflat = tree_util.tree_unflatten
        return unflat(treedef, [wrap_like(o, x) for o, x in zip(out, g)]), ScaleByAdamState(
            count=state.count + 1,
            mu=unflat(treedef, [wrap_like(o, x) for o, x in zip(ml, mu)]),
            nu=unflat(treedef, [wrap_like(o, x) for o, x in zip(vl, nu)]),
        )

    return GradientTransformation(init_fn, update_fn)

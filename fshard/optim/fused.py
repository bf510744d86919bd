"""One optimizer step in one call: :func:`step`, on torch's fused kernels where it can.

``fs.optim.step(opt, grads, state, params)`` is ``opt.update`` then ``apply_updates`` with
the old params and state donated (:func:`~fshard.optim.donate`). For an optimizer built
by :func:`~fshard.optim.sgd`, :func:`~fshard.optim.adam` or :func:`~fshard.optim.adamw`
with ``fused=True`` it instead runs ``torch._fused_sgd_`` / ``_fused_adam_`` /
``_fused_adamw_`` on every rank's local shards: one pass over each parameter, its gradient
and its state, in place, where the chain makes several (and the updates a temporary the
size of the parameters). The state it returns is the chain's, so the two paths can be
mixed step by step, and checkpoints do not know which ran.

The fused kernels round differently from the chain (their bias corrections are computed
in the kernel, in float32 step counts): the results agree to rounding, and equal
``torch.optim``'s ``fused=True`` optimizers bit for bit
(tests/optim/test_optim_fused.py). Where a kernel cannot run (under ``fs.jit``'s trace,
under ``fs.simulate``, or leaves whose dtypes or devices it does not take) the chain runs;
:func:`fusable` says which and why.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple
from weakref import WeakKeyDictionary

import attrs
import torch

from fshard import tree as tree_util
from fshard.optim.base import (
    _BEFORE_APPLY,
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    ScalarOrSchedule,
    Updates,
    apply_updates,
    donate,
    flatten_matching,
    to_locals,
)

__all__ = ["Fused", "fusable", "step"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@attrs.frozen
class Fused:
    """What :func:`step` needs to run ``opt`` as one fused kernel.

    Attributes:
      kind: ``"adam"`` (L2 decay, added to the gradient), ``"adamw"`` (decoupled decay)
        or ``"sgd"``.
      lr: the learning rate, or a schedule ``step -> lr`` (step from 0).
      hparams: the kernel's other arguments (``beta1``, ``eps``, ``momentum``, ...).
      weight_decay: the decay factor; ``mask``: adamw's leaves to decay (None: all).
      slots: positions in the chain's state tuple: ``"adam"`` / ``"trace"`` (the moment
        state) and ``"lr"`` (the schedule's count, when ``lr`` is a schedule).
    """

    kind: str
    lr: ScalarOrSchedule
    hparams: dict[str, Any]
    weight_decay: float
    mask: Any
    slots: dict[str, int]


# opt.update -> Fused, for the optimizers made with fused=True (weak: a dropped optimizer
# takes its entry with it).
_FUSED: WeakKeyDictionary[Callable[..., Any], Fused] = WeakKeyDictionary()


def register(opt: GradientTransformation, fused: Fused) -> GradientTransformation:
    """Marks ``opt`` (a chain made by ``fs.optim.sgd/adam/adamw``) as runnable by ``fused``."""
    _FUSED[opt.update] = fused
    return opt


def fusable(opt: GradientTransformation, grads: Updates, state: OptState, params: Params) -> str | None:
    """None if :func:`step` would run ``opt`` fused on these trees; else why not, in words."""
    spec = _FUSED.get(opt.update)
    if spec is None:
        return "the optimizer was not made with fused=True by fs.optim.sgd, adam or adamw"
    from fshard.runtime import simulation

    if simulation.active() is not None:
        return "fs.simulate runs the chain (the kernels take no simulated tensors)"
    p, g = tree_util.leaves(params), tree_util.leaves(grads)
    if not p or not all(isinstance(x, torch.Tensor) for x in p + g):
        return "the params and grads must be non-empty pytrees of tensors"
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(p + g) is not None:
        return "fs.jit traces the chain"
    for x, y in zip(to_locals(p), to_locals(g)):
        if x.dtype not in _KERNEL_DTYPES or y.dtype != x.dtype or x.device != y.device:
            return f"a parameter of {x.dtype} on {x.device} with a gradient of {y.dtype} on {y.device}"
        if x.device.type not in ("cpu", "cuda"):
            return f"no fused kernel on {x.device.type}"
    if not isinstance(state, tuple) or any(i >= len(state) for i in spec.slots.values()):
        return "the state is not this optimizer's"
    return None


def step(opt: GradientTransformation, grads: Updates, state: OptState, params: Params) -> tuple[Params, OptState]:
    """One step of ``opt``: the new ``(params, state)``; the ones given are donated.

    Fused (see the module docstring) when :func:`fusable` says so, else
    ``opt.update`` and ``apply_updates`` under :func:`~fshard.optim.donate`. Either way the
    params and state given must not be used again: their buffers hold the new values
    (the returned trees may be the very same objects).

    Args:
      opt: any ``GradientTransformation``.
      grads: like ``params`` (the same structure, shapes, dtypes and sharding).
      state: ``opt``'s state for ``params``.
      params: a pytree of tensors or DTensors.

    Returns:
      ``(params, state)`` after the step, structured and sharded like the ones given.

    Raises:
      ValueError: trees whose structures or sharding differ, naming the path.
      RuntimeError: a ``GradAccumulator`` holds unsynchronized microbatch gradients.
    """
    if fusable(opt, grads, state, params) is not None:
        with donate():
            updates, state = opt.update(grads, state, params)
            return apply_updates(params, updates), state
    for check in _BEFORE_APPLY:
        check("fs.optim.step")
    spec = _FUSED[opt.update]
    slot = spec.slots["trace" if spec.kind == "sgd" else "adam"]
    moments = state[slot]
    lr = _lr(spec, state)
    if spec.kind == "sgd":
        new_moments = _sgd(spec, grads, moments, params, lr)
    else:
        new_moments = _adam(spec, grads, moments, params, lr)
    new_state = list(state)
    new_state[slot] = new_moments
    if "lr" in spec.slots:
        sched = state[spec.slots["lr"]]
        new_state[spec.slots["lr"]] = type(sched)(count=sched.count + 1)
    return params, tuple(new_state)


def _lr(spec: Fused, state: tuple[Any, ...]) -> float:
    if callable(spec.lr):
        return float(spec.lr(int(state[spec.slots["lr"]].count)))
    return float(spec.lr)


def _groups(spec: Fused, params: Params, locals_: list[torch.Tensor]) -> dict[tuple[Any, ...], list[int]]:
    """Leaf indices by what one kernel call needs alike: device, dtype and decay."""
    decay = [spec.weight_decay] * len(locals_)
    if spec.mask is not None:
        keep = tree_util.leaves(spec.mask(params) if callable(spec.mask) else spec.mask)
        decay = [spec.weight_decay if k else 0.0 for k in keep]
    out: dict[tuple[Any, ...], list[int]] = {}
    for i, x in enumerate(locals_):
        out.setdefault((x.device, x.dtype, decay[i]), []).append(i)
    return out


class _Moments(NamedTuple):
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: list[list[torch.Tensor]]


def _flat(what: str, params: Params, grads: Updates, *state: tuple[str, Any]) -> _Moments:
    leaves = flatten_matching(what, ("params", params), ("grads", grads), *state)
    *trees, _ = leaves
    p, g, *s = (to_locals(t) for t in trees)
    return _Moments(p, g, s)


def _adam(spec: Fused, grads: Updates, moments: Any, params: Params, lr: float) -> Any:
    m = _flat("fs.optim.step", params, grads, ("the first moments", moments.mu), ("the second moments", moments.nu))
    kernel = torch._fused_adamw_ if spec.kind == "adamw" else torch._fused_adam_
    count = int(moments.count) + 1
    with torch.no_grad():
        for (device, _, decay), idx in _groups(spec, params, m.params).items():
            # The kernel reads each leaf's step (torch.optim increments it just before).
            steps = list(torch.full((len(idx),), float(count), dtype=torch.float32, device=device).unbind())
            kernel(
                [m.params[i] for i in idx],
                [m.grads[i] for i in idx],
                [m.state[0][i] for i in idx],
                [m.state[1][i] for i in idx],
                [],
                steps,
                lr=lr,
                weight_decay=decay,
                amsgrad=False,
                maximize=False,
                **spec.hparams,
            )
    return type(moments)(count=moments.count + 1, mu=moments.mu, nu=moments.nu)


def _sgd(spec: Fused, grads: Updates, moments: Any, params: Params, lr: float) -> Any:
    buffers = () if isinstance(moments, EmptyState) else (("the momentum buffers", moments.trace),)
    m = _flat("fs.optim.step", params, grads, *buffers)
    # The chain's buffers start at zero, so the kernel's usual update (b = momentum * b + g,
    # dampening 0) gives b = g at step 1, as its is_first_step would: no flag to derive.
    with torch.no_grad():
        for (_, _, decay), idx in _groups(spec, params, m.params).items():
            torch._fused_sgd_(
                [m.params[i] for i in idx],
                [m.grads[i] for i in idx],
                [m.state[0][i] for i in idx] if buffers else [],
                weight_decay=decay,
                lr=lr,
                is_first_step=False,
                maximize=False,
                **spec.hparams,
            )
    return moments

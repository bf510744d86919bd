"""The usual optimizers, each one :func:`~fshard.optim.chain` of transforms.

Their updates equal torch.optim's ``SGD``, ``Adam`` and ``AdamW`` (same defaults,
same weight-decay conventions) up to float rounding, on one process and on any mesh.
"""

from __future__ import annotations

from fshard.optim.base import GradientTransformation, ScalarOrSchedule, chain, identity
from fshard.optim.fused import Fused, register
from fshard.optim.transforms import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = ["sgd", "adam", "adamw"]


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    fused: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with optional momentum, as ``torch.optim.SGD``.

    With ``d = g + weight_decay * p`` (L2 regularization) and ``b`` the momentum
    buffer (zero at first)::

      b <- momentum * b + d
      p <- p - lr * (d + momentum * b)   if nesterov
      p <- p - lr * b                    otherwise (with momentum = 0: p - lr * d)

    Args:
      lr: learning rate, >= 0, or a schedule ``step -> lr`` (step from 0).
      momentum: momentum factor, >= 0 (optional, default 0).
      nesterov: Nesterov momentum; needs ``momentum > 0`` (optional, default False).
      weight_decay: L2 penalty added to the gradient, >= 0 (optional, default 0).
      fused: let :func:`fshard.optim.step` run the step as ``torch._fused_sgd_`` where the
        leaves allow (:mod:`fshard.optim.fused`; optional, default False).

    Returns:
      A :class:`GradientTransformation`: ``chain(add_decayed_weights, trace,
      scale_by_learning_rate)``; the momentum state is sharded like the params.

    Raises:
      ValueError: a hyperparameter out of range, or ``nesterov`` without momentum.

    Example:
      >>> import torch, fshard as fs
      >>> params = {"w": torch.ones(3)}
      >>> opt = fs.optim.sgd(lr=0.1, momentum=0.9)
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
      >>> fs.optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 0.9000, 0.9000])

    References:
      Sutskever et al., On the importance of initialization and momentum in deep
      learning, 2013.
    """
    if nesterov and momentum <= 0:
        raise ValueError(f"sgd: nesterov=True needs momentum > 0, got momentum={momentum!r}.")
    opt = chain(
        add_decayed_weights(weight_decay),
        trace(momentum, nesterov) if momentum else identity(),
        scale_by_learning_rate(lr),
    )
    hparams = {"momentum": float(momentum), "dampening": 0.0, "nesterov": nesterov}
    return _fused(opt, fused, Fused("sgd", lr, hparams, weight_decay, None, _slots(lr, trace=1)))


def adam(
    lr: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    fused: bool = False,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` (weight decay is L2, added to the gradient).

    With ``g = grad + weight_decay * p`` and ``t`` the step (from 1)::

      m <- b1 * m + (1 - b1) * g        v <- b2 * v + (1 - b2) * g^2
      p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Args:
      lr: learning rate, >= 0, or a schedule ``step -> lr`` (optional, default 1e-3).
      b1: first-moment decay, in [0, 1) (optional, default 0.9).
      b2: second-moment decay, in [0, 1) (optional, default 0.999).
      eps: added to the denominator (optional, default 1e-8).
      weight_decay: L2 penalty, >= 0 (optional, default 0).
      fused: let :func:`fshard.optim.step` run the step as ``torch._fused_adam_`` where the
        leaves allow (:mod:`fshard.optim.fused`; optional, default False).

    Returns:
      A :class:`GradientTransformation`: ``chain(add_decayed_weights, scale_by_adam,
      scale_by_learning_rate)``; ``m`` and ``v`` are sharded like the params (ZeRO).

    Raises:
      ValueError: a hyperparameter out of range.

    Example:
      >>> import torch, fshard as fs
      >>> params = {"w": torch.ones(2)}
      >>> opt = fs.optim.adam(lr=0.1)
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, state, params)
      >>> fs.optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 1.1000])

    References:
      Kingma and Ba, Adam: A Method for Stochastic Optimization, 2014.
    """
    opt = chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(b1, b2, eps),
        scale_by_learning_rate(lr),
    )
    hparams = {"beta1": b1, "beta2": b2, "eps": eps}
    return _fused(opt, fused, Fused("adam", lr, hparams, weight_decay, None, _slots(lr, adam=1)))


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask=None,
    *,
    fused: bool = False,
) -> GradientTransformation:
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    With ``t`` the step (from 1)::

      m <- b1 * m + (1 - b1) * g        v <- b2 * v + (1 - b2) * g^2
      p <- p - lr * ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p)

    Args:
      lr: learning rate, >= 0, or a schedule ``step -> lr`` (optional, default 1e-3).
      b1: first-moment decay, in [0, 1) (optional, default 0.9).
      b2: second-moment decay, in [0, 1) (optional, default 0.999).
      eps: added to the denominator (optional, default 1e-8).
      weight_decay: decoupled decay, >= 0 (optional, default 0.01).
      mask: which params to decay: a pytree of bools like the params, or a function
        ``params -> such a pytree`` (optional, default all).
      fused: let :func:`fshard.optim.step` run the step as ``torch._fused_adamw_`` where the
        leaves allow (:mod:`fshard.optim.fused`; optional, default False).

    Returns:
      A :class:`GradientTransformation`: ``chain(scale_by_adam, add_decayed_weights,
      scale_by_learning_rate)``; ``m`` and ``v`` are sharded like the params (ZeRO).

    Raises:
      ValueError: a hyperparameter out of range.

    Example:
      >>> import torch, fshard as fs
      >>> params = {"w": torch.ones(2)}
      >>> opt = fs.optim.adamw(lr=0.1, weight_decay=0.5)
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, state, params)
      >>> fs.optim.apply_updates(params, updates)["w"]
      tensor([0.8500, 1.0500])

    References:
      Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019.
    """
    opt = chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
    )
    hparams = {"beta1": b1, "beta2": b2, "eps": eps}
    return _fused(opt, fused, Fused("adamw", lr, hparams, weight_decay, mask, _slots(lr, adam=0)))


def _slots(lr: ScalarOrSchedule, **moments: int) -> dict[str, int]:
    # Every chain here ends in scale_by_learning_rate: its state (a schedule's count) is last.
    return {**moments, "lr": 2} if callable(lr) else dict(moments)


def _fused(opt: GradientTransformation, fused: bool, spec: Fused) -> GradientTransformation:
    return register(opt, spec) if fused else opt

"""Learning-rate schedules: plain functions ``step -> value`` (step counts from 0).

Pass one wherever a learning rate is taken (``fs.optim.adamw(lr=schedule)``); the
optimizer counts its own steps and calls the schedule once per update.

Every schedule here takes the step as a Python int (eagerly: the optimizer reads its
count on the host and gets a float back) or as a 0-dim integer tensor (under
:func:`fshard.jit`, which traces the step without values: it gets a float64 0-dim tensor
back, computed with tensor ops, so that one compiled graph serves every step). Both give
the same IEEE double values. A schedule of your own must do the same to be jitted:
``torch.where``/``torch.clamp`` instead of ``if``/``min``/``max`` on the step, no
``int(step)``; otherwise ``fs.jit`` raises a ``JitCaptureError`` naming its line.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence, Union

import torch

from fshard.optim.base import Schedule

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "join_schedules",
]


Step = Union[int, torch.Tensor]  # a Python int, or a 0-dim integer tensor (fs.jit)


def _traced(step: Step) -> bool:
    return isinstance(step, torch.Tensor)


def _f64(step: torch.Tensor) -> torch.Tensor:
    """The step as a float64 0-dim tensor (exact for any step below 2**53)."""
    return step.to(torch.float64)


def _check_steps(what: str, name: str, value: object, *, positive: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
        kind = "a positive int" if positive else "an int >= 0"
        raise ValueError(f"{what}: {name}={value!r} must be {kind}.")


def constant_schedule(value: float) -> Schedule:
    """``step -> value``.

    Args:
      value: the value at every step.

    Returns:
      The schedule.

    Example:
      >>> constant_schedule(0.1)(1000)
      0.1
    """
    return lambda step: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Goes linearly from ``init_value`` to ``end_value``, then stays there.

    ``value(t) = init + (end - init) * clip((t - transition_begin) / transition_steps, 0, 1)``.

    Args:
      init_value: the value up to ``transition_begin``.
      end_value: the value from ``transition_begin + transition_steps`` on.
      transition_steps: length of the ramp, > 0.
      transition_begin: step where the ramp starts (optional, default 0).

    Returns:
      The schedule.

    Raises:
      ValueError: ``transition_steps <= 0`` or ``transition_begin < 0``.

    Example:
      >>> warmup = linear_schedule(0.0, 1e-3, transition_steps=100)
      >>> warmup(0), warmup(50), warmup(500)
      (0.0, 0.0005, 0.001)
    """
    _check_steps("linear_schedule", "transition_steps", transition_steps, positive=True)
    _check_steps("linear_schedule", "transition_begin", transition_begin, positive=False)

    def schedule(step: Step) -> float | torch.Tensor:
        if _traced(step):
            frac = torch.clamp(_f64(step) - transition_begin, 0, transition_steps) / transition_steps
        else:
            frac = min(max(step - transition_begin, 0), transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """Half a cosine from ``init_value`` down to ``alpha * init_value`` over ``decay_steps``.

    ``value(t) = init * ((1 - alpha) * c^exponent + alpha)``,
    ``c = (1 + cos(pi * min(t, decay_steps) / decay_steps)) / 2``.

    Args:
      init_value: the value at step 0.
      decay_steps: steps to reach the final value, > 0.
      alpha: the final value as a fraction of ``init_value`` (optional, default 0).
      exponent: power of the cosine factor (optional, default 1).

    Returns:
      The schedule.

    Raises:
      ValueError: ``decay_steps <= 0``.

    Example:
      >>> s = cosine_decay_schedule(1.0, decay_steps=10)
      >>> s(0), s(5), s(10)
      (1.0, 0.5, 0.0)
    """
    _check_steps("cosine_decay_schedule", "decay_steps", decay_steps, positive=True)

    def schedule(step: Step) -> float | torch.Tensor:
        return init_value * ((1.0 - alpha) * _cosine(step, decay_steps) ** exponent + alpha)

    return schedule


def _cosine(step: Step, n: int) -> float | torch.Tensor:
    """``(1 + cos(pi * t / n)) / 2`` for ``t = clip(step, 0, n)``: 1 at 0, 0 at ``n``."""
    if _traced(step):
        t = torch.clamp(_f64(step), 0, n)
        return torch.where(2 * t == n, 0.5, 0.5 * (1.0 + torch.cos(math.pi * t / n)))
    t = min(max(step, 0), n)
    # Halfway, cos(pi/2) comes out as 6e-17; give the exact 0.5 the formula means.
    return 0.5 if 2 * t == n else 0.5 * (1.0 + math.cos(math.pi * t / n))


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[i]`` from ``boundaries[i-1]`` on, each restarted from step 0.

    Args:
      schedules: ``n`` schedules.
      boundaries: ``n - 1`` increasing steps where the next schedule takes over.

    Returns:
      The schedule.

    Raises:
      ValueError: ``len(boundaries) != len(schedules) - 1`` or boundaries not
        increasing.

    Example:
      >>> s = join_schedules([constant_schedule(1.0), constant_schedule(2.0)], [3])
      >>> s(2), s(3)
      (1.0, 2.0)
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {max(len(schedules) - 1, 0)} "
            f"boundaries, got {len(boundaries)}."
        )
    if any(b < a for a, b in zip(boundaries, boundaries[1:])) or any(b < 0 for b in boundaries):
        raise ValueError(f"join_schedules: boundaries {boundaries} must be >= 0 and increasing.")

    def schedule(step: Step) -> float | torch.Tensor:
        if _traced(step):
            # Every piece is evaluated (each clamps its own step) and the last one whose
            # boundary the step has reached is selected: no Python branch on the step.
            out = torch.as_tensor(schedules[0](step), dtype=torch.float64)
            for b, s in zip(boundaries, schedules[1:]):
                out = torch.where(step >= b, torch.as_tensor(s(step - b), dtype=torch.float64), out)
            return out
        i = bisect.bisect_right(boundaries, step)
        return schedules[i](step - (boundaries[i - 1] if i else 0))

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    Steps ``[0, warmup_steps]`` ramp linearly; steps ``[warmup_steps, decay_steps]``
    follow :func:`cosine_decay_schedule` from ``peak_value`` down to ``end_value``;
    later steps stay at ``end_value``. ``decay_steps`` counts the warmup (optax's
    convention).

    Args:
      init_value: the value at step 0.
      peak_value: the value at ``warmup_steps``.
      warmup_steps: length of the warmup, >= 0.
      decay_steps: the step where ``end_value`` is reached, > ``warmup_steps``.
      end_value: the final value (optional, default 0).
      exponent: power of the cosine factor (optional, default 1).

    Returns:
      The schedule.

    Raises:
      ValueError: ``warmup_steps < 0`` or ``decay_steps <= warmup_steps``.

    Example:
      >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
      >>> s(0), s(5), s(10), s(60), s(110)
      (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    _check_steps("warmup_cosine_decay_schedule", "warmup_steps", warmup_steps, positive=False)
    _check_steps("warmup_cosine_decay_schedule", "decay_steps", decay_steps, positive=True)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps={decay_steps} must exceed "
            f"warmup_steps={warmup_steps} (decay_steps counts the warmup)."
        )
    n = decay_steps - warmup_steps

    def decay(step: Step) -> float | torch.Tensor:
        return end_value + (peak_value - end_value) * _cosine(step, n) ** exponent

    if warmup_steps == 0:
        return decay
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warmup, decay], [warmup_steps])

"""Non-finite steps: what was not finite, and the testing aid that makes a step so.

A NaN or inf loss or gradient stops the run (``NonFiniteError``) or skips the step; the
report names the first non-finite gradient's parameter path and the rank that holds it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.distributed as dist

from fshard import tree as tree_util

__all__ = ["Injection", "NonFinite", "NonFiniteError", "first_nonfinite"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were NaN or infinite (and the run does not skip such steps)."""


@attrs.frozen
class NonFinite:
    """What was not finite in one step.

    Attributes:
      loss: the step's loss.
      grad_norm: the global norm of its gradients.
      leaf: the path of the first non-finite gradient in the parameter tree's order
        (``layers.1.feed_forward.w2.weight``), or None when every gradient is finite.
      rank: the lowest rank holding a non-finite part of that gradient.
    """

    loss: float
    grad_norm: float
    leaf: str | None
    rank: int | None

    def __str__(self) -> str:
        finite = math.isfinite(self.loss)
        text = f"the loss is finite ({self.loss:.4f})" if finite else f"the loss is {self.loss:g}"
        if self.leaf is None:
            return f"{text} and every gradient is finite (global norm {self.grad_norm:g})"
        return f"{text} and the first non-finite gradient is '{self.leaf}' (on rank {self.rank})"


def first_nonfinite(grads: Any, order: dict[str, int]) -> tuple[str | None, int | None]:
    """The first gradient (in ``order``) with a NaN or inf on any rank, and the lowest such rank.

    Collective over every rank: each looks at its own shards. Returns ``(None, None)``
    when every gradient is finite.
    """
    paths, leaves, _ = tree_util.zip_with_path(grads)
    local_of = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731 (this rank's shard)
    mine = [
        p for p, g in zip(paths, leaves) if isinstance(g, torch.Tensor) and not bool(torch.isfinite(local_of(g)).all())
    ]
    local = min(mine, key=lambda p: order.get(p, len(order))) if mine else None
    found = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)
    hits = sorted((order.get(p, len(order)), r, p) for r, p in enumerate(found) if p is not None)
    return (hits[0][2], hits[0][1]) if hits else (None, None)


@attrs.define
class Injection:
    """Testing aid (train_lm's ``--inject-nonfinite STEP[:WHERE[:VALUE]]``): a NaN or inf at one step.

    ``where`` is ``"loss"`` (the loss is multiplied by the value before backward, so the
    gradients follow) or a parameter path (one element of that gradient is set, on every
    rank that holds part of it). ``current`` is set by the train loop to the step being
    computed (counted from 1, as printed).
    """

    step: int = 0
    where: str = "loss"
    value: float = math.nan
    current: int = 0

    @classmethod
    def parse(cls, text: str | None) -> "Injection":
        """``"3"``, ``"3:loss:inf"``, ``"3:layers.0.attention.wq.weight"``; None: never."""
        if text is None:
            return cls()
        step, _, rest = text.partition(":")
        where, _, value = rest.partition(":")
        if not step.isdigit() or int(step) < 1:
            raise ValueError(f"{text!r}: STEP must be a step number >= 1")
        if value not in ("", "nan", "inf", "-inf"):
            raise ValueError(f"{text!r}: VALUE must be nan, inf or -inf")
        return cls(int(step), where or "loss", float(value or "nan"))

    @property
    def active(self) -> bool:
        return self.step > 0 and self.current == self.step

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value if self.active and self.where == "loss" else loss

    def grads(self, grads: Any) -> Any:
        if self.active and self.where != "loss":
            for path, g in zip(*tree_util.zip_with_path(grads)[:2]):
                local = g.to_local() if hasattr(g, "to_local") else g
                if path == self.where and local.numel():
                    with torch.no_grad():
                        local[(0,) * local.dim()] = self.value
        return grads

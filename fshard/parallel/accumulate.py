"""Gradient accumulation without gradient sync (FSDP2's ``set_requires_gradient_sync(False)``).

Microbatches run with ``sync=False`` skip the reduce-scatter / all-reduce: each group's
unreduced (full, padded) gradient is summed into the :class:`GradAccumulator`, and the
shard gradients those calls return are zeros. The microbatch run with ``sync=True`` adds
what was accumulated to its own gradient before the one reduction, so its returned
gradients are the sum over all microbatches. Applying updates while an accumulator still
holds unsynced gradients raises instead of silently stepping on partial gradients::

    acc = fs.parallel.GradAccumulator()
    for k, mb in enumerate(microbatches):
        loss, grads = step(params, mb, accumulate=acc, sync=k == len(microbatches) - 1)
    params = fs.optim.apply_updates(params, opt_update(grads))
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fshard.optim.base import register_before_apply

__all__ = ["GradAccumulator", "check_no_pending"]

_PENDING: "weakref.WeakSet[GradAccumulator]" = weakref.WeakSet()


class GradAccumulator:
    """Unreduced gradients carried between microbatches that skip the reduction."""

    def __init__(self) -> None:
        self._bufs: dict[Any, torch.Tensor] = {}

    def add(self, key: Any, flat: torch.Tensor) -> None:
        prev = self._bufs.get(key)
        self._bufs[key] = flat.clone() if prev is None else prev.add_(flat)
        _PENDING.add(self)

    def take(self, key: Any) -> torch.Tensor | None:
        out = self._bufs.pop(key, None)
        if not self._bufs:
            _PENDING.discard(self)
        return out

    @property
    def pending(self) -> bool:
        """True while some group holds gradients not yet reduced."""
        return bool(self._bufs)

    def clear(self) -> None:
        """Drops accumulated gradients (e.g. after a skipped step)."""
        self._bufs.clear()
        _PENDING.discard(self)


def check_no_pending(what: str) -> None:
    """Raises if any accumulator holds gradients that were never reduced.

    Raises:
      RuntimeError: names how many groups are pending and how to finish them.
    """
    pending = [a for a in _PENDING if a.pending]
    if pending:
        n = sum(len(a._bufs) for a in pending)
        raise RuntimeError(
            f"{what}: {n} parameter group(s) hold gradients from microbatches run with sync=False "
            f"that were never reduced, so the gradients in hand are partial. Run the last "
            f"microbatch with sync=True (or call GradAccumulator.clear() to drop them)."
        )


register_before_apply(check_no_pending)

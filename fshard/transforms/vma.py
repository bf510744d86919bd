"""Checked mode: track which mesh axes each value varies over, and insert ``pvary``.

JAX types every value in a shard_map body with the set of mesh axes it varies over
("vma"). Where an invariant value meets a varying one, JAX inserts ``pvary``, whose
transpose is ``psum``: that is where a data-parallel gradient all-reduce comes from,
with no user code. This module does the same in eager PyTorch with one
``TorchFunctionMode``: every torch call inside the body tags its outputs with the union
of its inputs' axes, and an operand that needs gradients and misses some of those
axes is passed through ``pvary`` first.

Why not meta-pytorch's spmd_types: it checks explicitly typed Megatron-style
collectives (``all_reduce(x, src=P, dst=R)``) and reports mismatches, while fshard
needs inference plus implicit insertion under jax.lax's untyped signatures; what is
needed is this ~60-line rule, not a second collective API.

Unchecked mode installs nothing, so it adds no per-op cost.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from fshard import lax
from fshard import tree as tree_util

__all__ = ["VmaMode"]


class VmaMode(TorchFunctionMode):
    """Propagates varying-axes tags and inserts implicit ``pvary`` (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if lax._IN_LAX.get():
            return func(*args, **kwargs)
        leaves = [x for x in tree_util.leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not leaves:
            out = func(*args, **kwargs)
            return out
        tags = [lax.vma(x) for x in leaves]
        union = frozenset().union(*tags)
        if union and any(t != union for t in tags):
            inplace_self = args[0] if getattr(func, "__name__", "").endswith("_") and args else None
            args, kwargs = tree_util.tree_map(
                lambda x: _lift(x, union) if isinstance(x, torch.Tensor) and x is not inplace_self else x,
                (args, kwargs),
            )
        out = func(*args, **kwargs)
        if union:
            for o in tree_util.leaves(out):
                if isinstance(o, torch.Tensor):
                    lax.set_vma(o, union)
        return out


def _lift(x: torch.Tensor, union: frozenset) -> torch.Tensor:
    missing = union - lax.vma(x)
    if not missing or not x.requires_grad:
        return x  # values are equal either way; only gradients need the psum
    axes = tuple(a for a in lax.BODY.get().mesh.axis_names if a in missing)
    return lax.pvary(x, axes)

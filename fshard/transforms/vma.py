"""Checked mode: track which mesh axes each value varies over, and insert ``pvary``.

JAX types every value in a shard_map body with the set of mesh axes it varies over
("vma"). Where an invariant value meets a varying one, JAX inserts ``pvary``, whose
transpose is ``psum``: that is where a data-parallel gradient all-reduce comes from,
with no user code. This module does the same in eager PyTorch with one
``TorchFunctionMode``: every torch call inside the body tags its outputs with the union
of its inputs' axes, and an operand that needs gradients and misses some of those
axes is passed through ``pvary`` first. The tags are the ``vma`` field of the one
per-value metadata record in :mod:`fshard.meta`, which says how they survive
``detach``, ``torch.func`` wrappers, ``fs.value_and_grad`` and ``fs.remat``.

Autograd entry points (``torch.autograd.grad``/``backward``, ``Tensor.backward``) are
never rewritten: differentiating an invariant loss with respect to a varying value is
JAX's ``grad`` inside ``shard_map``, and its transposes already do every reduction.

Why not meta-pytorch's spmd_types: it checks explicitly typed Megatron-style
collectives (``all_reduce(x, src=P, dst=R)``) and reports mismatches, while fshard
needs inference plus implicit insertion under jax.lax's untyped signatures; what is
needed is this ~60-line rule, not a second collective API.

Unchecked mode installs nothing, so it adds no per-op cost.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fshard import lax
from fshard import meta as meta_util
from fshard import tree as tree_util

__all__ = ["VmaMode"]

# Autograd entry points are not computations on values: they pass through untouched. (A
# "lift" of an invariant loss to varying before differentiating it added a pvary, hence a
# psum in backward: gradients came out axis_size times too large, or zero.)
_AUTOGRAD_ENTRY = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})

# Ops whose output is the input's value in the same layout (up to dtype or device): it
# keeps the input's global shape and spec, not only its varying axes.
_GRAD_GETTER = torch.Tensor.grad.__get__

_SAME_VALUE = frozenset({
    torch.Tensor.detach, torch.detach, torch.Tensor.clone, torch.clone, torch.Tensor.contiguous,
    torch.Tensor.requires_grad_, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
    torch.Tensor.double, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
    torch.Tensor.type_as, torch.Tensor.view_as, torch.Tensor.data.__get__,
})


class VmaMode(TorchFunctionMode):
    """Propagates per-value metadata and inserts implicit ``pvary`` (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if lax._IN_LAX.get():
            return func(*args, **kwargs)
        if func in _AUTOGRAD_ENTRY:
            out = func(*args, **kwargs)
            if func is torch.autograd.grad:
                _tag_cotangents(args, kwargs, out)
            return out
        if func == _GRAD_GETTER:
            g = func(*args, **kwargs)
            return g if g is None else meta_util.copy_meta(args[0], g)  # x.grad has x's type
        everything = tree_util.leaves((args, kwargs))
        leaves = [x for x in everything if isinstance(x, torch.Tensor)]
        if not leaves:
            return func(*args, **kwargs)
        metas = [meta_util.meta_of(x) for x in leaves]
        # An axis_index (an int typed varying, as in JAX) makes the result vary too.
        indices = [x.axes for x in everything if isinstance(x, lax.AxisIndex)]
        union = frozenset().union(*(m.vma for m in metas), *indices)
        if union and (indices or any(m.vma != union for m in metas)):
            inplace_self = args[0] if getattr(func, "__name__", "").endswith("_") and args else None
            args, kwargs = tree_util.tree_map(
                lambda x: _lift(x, union) if isinstance(x, torch.Tensor) and x is not inplace_self else x,
                (args, kwargs),
            )
        out = func(*args, **kwargs)
        first, x0 = metas[0], leaves[0]
        keep = first.global_shape is not None
        for o in tree_util.leaves(out):
            if not isinstance(o, torch.Tensor):
                continue
            if any(o is x for x in leaves):
                meta_util.set_vma(o, union)  # in place or returned as is: keep its layout
            elif keep and o.shape == x0.shape and (func in _SAME_VALUE or _same_memory(o, x0)):
                meta_util.set_meta(o, meta_util.Meta(union, first.global_shape, first.spec))
            else:
                # Tagged even when invariant, so that later lookups stop at the attribute.
                meta_util.set_meta(o, meta_util.Meta(union) if union else meta_util.EMPTY)
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """An alias of ``b`` with its geometry (``b[:]``, ``b.view(b.shape)``): the same value."""
    try:
        return (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype
                and a.device == b.device)
    except RuntimeError:
        return False  # tensors without storage (functorch wrappers, fake tensors)


def _tag_cotangents(args: tuple, kwargs: dict, grads: Any) -> None:
    """``torch.autograd.grad``'s results have the types of its inputs, as in JAX."""
    inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
    if inputs is None or grads is None:
        return
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    for x, g in zip(inputs, grads):
        if isinstance(g, torch.Tensor):
            meta_util.copy_meta(x, g)


def _lift(x: torch.Tensor, union: frozenset) -> torch.Tensor:
    missing = union - lax.vma(x)
    if not missing or not x.requires_grad:
        return x  # values are equal either way; only gradients need the psum
    axes = tuple(a for a in lax.BODY.get().mesh.axis_names if a in missing)
    return lax.pvary(x, axes) if axes else x

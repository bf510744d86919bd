"""What a shard_map body knows: its context, and the per-device metadata of its values.

A body's local tensors are plain torch tensors. Three facts about them are not in the
tensor itself, and fshard needs all three:

- ``vma``: the mesh axes the value varies over (checked mode; JAX's varying manual axes);
- ``global_shape``: for a body input's local block, the shape of the global value
  (FSDP shards may be uneven, so it cannot be derived from the local shape);
- ``spec``: for a body input, its ``in_spec``.

They live in one frozen :class:`Meta` record, found by :func:`meta_of` in this order:

1. on the tensor object (one attribute, ``_fshard_meta``);
2. on the tensor a ``torch.func`` wrapper wraps (``grad``/``vjp``: the same value;
   ``vmap``: only ``vma``, as the batched shape differs);
3. in the body's table of its inputs, keyed by storage address, offset, shape, stride,
   dtype and device: any alias of an input, however it was made (``detach()``,
   ``.data``, ``requires_grad_``, a full-slice view) is the same value, so it has the
   same metadata, even where no mode watched it being made (unchecked mode). The table
   holds the inputs themselves, so their memory cannot be reused by another tensor
   while the body (or a recomputation that replays it) can still look it up;
4. otherwise: no metadata, i.e. invariant everywhere with no global shape (a tensor
   closed over from outside the body is invariant, as in JAX).

Who writes it: ``shard_map`` for its inputs; checked mode's ``TorchFunctionMode`` for
every op's outputs (``vma`` = the union of the inputs'; the global shape and spec too
for ops that keep the value and layout: detach, clone, contiguous, dtype/device moves,
``requires_grad_``, ``.data``); ``fs.value_and_grad`` for its fresh leaves and for the
gradients (a cotangent has its primal's type, as in JAX); ``fs.remat`` replays the body
in the recomputation; the pipeline executor for stage parameters.
"""

from __future__ import annotations

import contextvars
import itertools
from typing import Any

import attrs
import torch

__all__ = [
    "Body",
    "BODY",
    "Meta",
    "EMPTY",
    "meta_of",
    "set_meta",
    "set_vma",
    "tag_fresh",
    "copy_meta",
    "register_input",
]


@attrs.frozen
class Meta:
    """Per-device metadata of one local value (see the module doc)."""

    vma: frozenset = frozenset()
    global_shape: tuple[int, ...] | None = None
    spec: Any = None  # a PartitionSpec, for a body input and its aliases
    scope: int = 0  # serial of the body that wrote it (0: none); other bodies ignore it


EMPTY = Meta()
_ATTR = "_fshard_meta"
_SERIALS = itertools.count(1)


@attrs.frozen
class Body:
    """What a shard_map body knows: its mesh, whether varying axes are tracked, which
    parameter group owns each local leaf (``fs.parallel`` refuses a leaf in two groups),
    its inputs by storage (for :func:`meta_of`'s alias lookup), and where checked mode's
    types stopped proving replication: storages written in place with values varying over
    more axes than the written tensor had (``written``: storage address -> (storage, axes)), and
    varying values converted to Python objects (``escaped``: axes -> the op)."""

    mesh: Any
    check: bool
    owners: dict = attrs.field(factory=dict, eq=False, repr=False)
    inputs: dict = attrs.field(factory=dict, eq=False, repr=False)
    written: dict = attrs.field(factory=dict, eq=False, repr=False)
    escaped: dict = attrs.field(factory=dict, eq=False, repr=False)
    fresh: dict = attrs.field(factory=dict, eq=False, repr=False)  # axes -> Meta(axes), scoped here
    serial: int = attrs.field(factory=lambda: next(_SERIALS), eq=False, repr=False)


BODY: contextvars.ContextVar[Body | None] = contextvars.ContextVar("fshard_body", default=None)

_functorch = torch._C._functorch


def _storage_key(x: torch.Tensor) -> tuple | None:
    try:
        ptr = x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # wrappers and tensors without storage (fake, meta, functorch)
    if ptr == 0:
        return None  # empty: every empty tensor has address 0
    return (ptr, x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)


def meta_of(x: torch.Tensor) -> Meta:
    """The metadata of a body value (:data:`EMPTY` when it has none).

    Metadata written in another body does not count inside this one: a value made by an
    earlier ``shard_map`` call and closed over by this one is invariant here, as in JAX.
    """
    body = BODY.get()
    m = getattr(x, _ATTR, None)
    if m is not None:
        return m if not m.scope or body is None or m.scope == body.serial else EMPTY
    if _functorch.is_functorch_wrapped_tensor(x):
        inner = _functorch.get_unwrapped(x)
        m = meta_of(inner)
        return m if tuple(inner.shape) == tuple(x.shape) else Meta(m.vma, scope=m.scope)
    if body is not None and body.inputs:
        key = _storage_key(x)
        if key is not None:
            hit = body.inputs.get(key)
            if hit is not None:
                return hit[1]
    return EMPTY


def _scoped(m: Meta) -> Meta:
    body = BODY.get()
    serial = body.serial if body is not None else 0
    return m if m.scope == serial else attrs.evolve(m, scope=serial)


def set_meta(x: torch.Tensor, m: Meta) -> torch.Tensor:
    """Attaches ``m`` (scoped to the current body) to ``x``; returns ``x``."""
    setattr(x, _ATTR, _scoped(m))
    return x


def tag_fresh(x: torch.Tensor, axes: frozenset) -> torch.Tensor:
    """Gives a value made by an op in the current body the varying ``axes`` and no layout
    (one shared record per axes and body: checked mode tags every op's output)."""
    body = BODY.get()
    if not axes or body is None:
        setattr(x, _ATTR, EMPTY)
        return x
    m = body.fresh.get(axes)
    if m is None:
        m = body.fresh[axes] = Meta(axes, scope=body.serial)
    setattr(x, _ATTR, m)
    return x


def set_vma(x: torch.Tensor, axes: frozenset) -> torch.Tensor:
    """Sets ``x``'s varying axes, keeping its other metadata; returns ``x``."""
    m = meta_of(x)
    if m.vma != axes or getattr(x, _ATTR, None) is not m:
        setattr(x, _ATTR, _scoped(attrs.evolve(m, vma=axes)))
    return x


def copy_meta(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Gives ``dst`` the metadata of ``src`` (same value or its cotangent); returns ``dst``."""
    m = meta_of(src)
    if m is not EMPTY or getattr(dst, _ATTR, None) is not None:
        setattr(dst, _ATTR, _scoped(m) if m is not EMPTY else m)
    return dst


def register_input(body: Body, local: torch.Tensor, m: Meta) -> None:
    """Records a body input's metadata on it and in the body's alias table."""
    m = attrs.evolve(m, scope=body.serial)
    setattr(local, _ATTR, m)
    key = _storage_key(local)
    if key is not None:
        body.inputs[key] = (local, m)  # the tensor is held so that its address stays its own

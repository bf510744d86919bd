"""Live aliases of a donated buffer: other tensors and NumPy arrays on its memory.

A donated argument's memory receives the call's result. A view of it (``x[1:]``), a NumPy
array from ``x.numpy()``, ``x.data`` or a DLPack capsule taken before the call would then
silently show the result's values. ``jax.jit`` (0.10.2, CPU, checked) does not donate a
buffer with such an external reference: the output goes to new memory, the input is not
deleted and the NumPy array keeps the old values. fs.jit does the same for that call, and
warns (JAX says nothing): see :func:`fshard.jit.jit`'s ``donate_argnums``.

How: a tensor's storage counts its users (``torch._C._storage_Use_Count``): one per tensor
on it (every view, ``.data``, ``detach()``, the tensor a ``.numpy()`` array keeps as its
base, a DLPack capsule) plus each Python storage object. The users the call accounts for
are the call's own tensor arguments on that storage and the tensors they are views of
(``_base``: the owner of the buffer, e.g. a flat parameter buffer that disjoint donated
views write into, as an in-place update of those views would). Any user beyond those is a
live alias. Not seen: memory torch does not own (a tensor made by ``torch.from_numpy``:
the NumPy array is no storage user) and a DTensor's local tensor object itself, held
since a ``to_local()`` under ``no_grad`` (which returns it, not a view).

Cost: one storage use count per donated tensor and call (about a microsecond), more only when a
donated tensor shares its storage.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["foreign_users", "detects"]

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _users(t: torch.Tensor) -> int:
    """The storage's users, less the storage object this call makes to ask (held while
    asking: ``_cdata`` is a raw pointer)."""
    storage = t.untyped_storage()
    return _use_count(storage._cdata) - _TEMP


def _temp_users() -> int:
    """What holding ``untyped_storage()``'s Python object adds to the count, measured on a
    fresh tensor (its only other user): a torch that counts differently is not misread."""
    t = torch.empty(1)
    storage = t.untyped_storage()
    return _use_count(storage._cdata) - 1


_TEMP = _temp_users() if _use_count is not None else 0


def detects() -> bool:
    """Whether this torch lets fs.jit count a storage's users (torch 2.x has it)."""
    return _use_count is not None


def foreign_users(local: torch.Tensor, call_locals: Iterable[torch.Tensor]) -> int:
    """How many users of ``local``'s storage the call does not account for (0: none, or
    this torch cannot tell). ``call_locals``: the call's tensor arguments (DTensors' local
    tensors)."""
    if _use_count is None or local.layout is not torch.strided:
        return 0
    try:
        n = _users(local)
        if n <= 1 and local._base is None:  # the usual case: its own storage, no view, no alias
            return 0
        key = local.untyped_storage()._cdata
        known: dict[int, torch.Tensor] = {}  # id -> tensor: held, so no id is reused meanwhile
        for t in call_locals:
            if t.layout is torch.strided and t.untyped_storage()._cdata == key:
                known[id(t)] = t
                if t._base is not None:
                    known[id(t._base)] = t._base
        return max(n - len(known), 0)
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor without a storage to ask
        return 0

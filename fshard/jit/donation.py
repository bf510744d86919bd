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

import inspect
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from fshard.jit.capture import _tensor_sig

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


_POS_OR_KW = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _resolve_donation(
    f: Callable, nums: tuple[int, ...] | None, names: tuple[str, ...] | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``jax.jit``'s ``resolve_argnums`` for donation: completes and checks the donated
    positions and names against ``f``'s signature.

    Given one of the two, the other is inferred from the positional-or-keyword parameters
    (so an argument is donated however it is passed); given both, each is used as given.
    Returns ``(positions, names)``: positions apply to positional arguments, names to
    keyword ones."""
    if not nums and not names:
        return (), ()
    label = getattr(f, "__name__", type(f).__name__)
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        sig = None
    if sig is None:
        if names:
            raise ValueError(
                f"fs.jit({label}): donate_argnames={names} but the function's signature cannot be "
                f"inspected to check them; pass donate_argnums instead."
            )
        return tuple(sorted(set(nums or ()))), ()
    params = list(sig.parameters.values())
    if nums is None or names is None:
        if names is None:
            names = tuple(p.name for i, p in enumerate(params) if p.kind is _POS_OR_KW and i in nums)
        else:
            nums = tuple(i for i, p in enumerate(params) if p.kind is _POS_OR_KW and p.name in names)
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        n_pos = sum(p.kind in (p.POSITIONAL_ONLY, _POS_OR_KW) for p in params)
        if nums and max(nums) >= n_pos:
            raise ValueError(
                f"fs.jit({label}): donate_argnums={tuple(nums)} but the function takes {n_pos} "
                f"positional argument(s) {sig}."
            )
    positional_only = {p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)}
    if bad := sorted(positional_only & set(names)):
        raise ValueError(
            f"fs.jit({label}): donate_argnames={tuple(names)}: {bad} cannot be passed by keyword "
            f"{sig}; use donate_argnums for them."
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        keyword = {p.name for p in params if p.kind in (_POS_OR_KW, p.KEYWORD_ONLY)}
        if bad := sorted(set(names) - keyword):
            raise ValueError(
                f"fs.jit({label}): donate_argnames={tuple(names)}: the function takes no argument "
                f"named {', '.join(bad)} {sig}."
            )
    return tuple(sorted(set(nums))), tuple(dict.fromkeys(names))


class DonatedTensorError(RuntimeError):
    """A tensor donated to an ``fs.jit`` call was used after it (JAX: a deleted array)."""


# The argument types whose objects fs.jit can make unusable after a donating call.
_CONSUMABLE = (torch.Tensor, torch.nn.Parameter, DTensor)


def _deleted_message(self) -> str:
    d = object.__getattribute__(self, "_fshard_donated")
    return (
        f"fs.jit({d[0]}): this tensor was donated ({d[1]}, shape {d[2]}, {d[3]}) and its memory now "
        f"holds the call's result: use the result instead (JAX deletes a donated array too)."
    )


class _DonatedTensor(torch.Tensor):
    """The class of a plain tensor after it was donated: every torch operation raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        for a in tree_leaves((args, kwargs or {})):  # lists too: torch.cat, the _foreach_ ops
            if isinstance(a, (_DonatedTensor, _DonatedDTensor)):
                raise DonatedTensorError(_deleted_message(a))
        raise DonatedTensorError("fs.jit: a donated tensor was used after the call.")


class _DonatedDTensor(DTensor):
    """The class of a DTensor after it was donated: every torch operation, and DTensor's
    own methods, raise."""

    __torch_function__ = _DonatedTensor.__torch_function__

    def __getattribute__(self, name):
        if name in ("to_local", "full_tensor", "redistribute", "_local_tensor", "__repr__", "__str__"):
            raise DonatedTensorError(_deleted_message(self))
        return object.__getattribute__(self, name)


def _consume(arg: torch.Tensor, fn_name: str, leaf: str) -> torch.Tensor:
    """The result that was computed into donated ``arg``: a new tensor object on ``arg``'s
    memory; ``arg`` itself becomes unusable (a torch operation on it raises), as JAX deletes
    a donated array."""
    arg._fshard_donated = (fn_name, leaf, tuple(arg.shape), arg.dtype)
    if isinstance(arg, DTensor):
        # The local tensor moves to the result: the donated DTensor keeps none.
        local = arg._local_tensor
        out = DTensor(local, arg._spec, requires_grad=False)
        arg._local_tensor = local.new_empty(0)
        arg.__class__ = _DonatedDTensor
    else:
        if arg._base is not None:
            # A view of the same memory whose _base is arg's: the buffer's owner (a flat
            # parameter buffer) stays the result's base, so the next call, donating the
            # result, accounts for it (fshard/jit/donation.py) as it did for arg.
            with torch.no_grad():
                out = arg._base.as_strided(arg.size(), arg.stride(), arg.storage_offset())
        else:
            out = arg.detach()  # a new tensor on the same memory, no view of arg
        # No memory left either: torch's own C++ code (autograd accumulating into a donated
        # .grad) does not go through __torch_function__, and must not write into the result.
        try:
            with torch.no_grad():
                arg.set_()
        except RuntimeError:  # a tensor made by .detach() or .data may not change its storage
            pass
        arg.__class__ = _DonatedTensor
    return out


def _rewrap(arg: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The result computed into ``local``, a copy of donated ``arg``'s local tensor that
    was kept from donation (:meth:`Jitted._keep_aliased_donations`), typed as ``arg``."""
    return DTensor(local, arg._spec, requires_grad=False) if isinstance(arg, DTensor) else local


def _take_donor(o: Any, free: list, memory: "_Memory") -> int | None:
    """The leaf index of the first donated tensor in ``free`` with ``o``'s layout, removed
    from ``free``; ``None`` if there is none or ``o`` is not a fresh result. An argument
    returned as it is (or any alias of one) is not computed into another (``free`` holds no
    returned argument either): copying argument into argument at the end of the graph
    would make the order of the copies matter."""
    if not isinstance(o, torch.Tensor) or memory.aliased(o):
        return None
    sig = _tensor_sig(o)
    for k, (j, s) in enumerate(free):
        if s == sig:
            del free[k]
            return j
    return None


class _Memory:
    """Which traced inputs a traced tensor's memory overlaps. Fake tensors keep their real
    inputs' storage sharing and offsets, so this sees views, ``detach()``, ``set_`` and
    ``as_strided`` aliases alike (a ``_base`` check sees views only)."""

    def __init__(self, by_leaf: dict[int, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._spans: dict[Any, list[tuple[int, int, int]]] = {}
        for j, t in by_leaf.items():
            if t.numel():
                self._spans.setdefault(StorageWeakRef(t.untyped_storage()), []).append((*_storage_span(t), j))

    def aliased(self, o: torch.Tensor) -> list[int]:
        """The leaf indices of the inputs whose memory ``o`` (a tensor or DTensor) overlaps."""
        loc = o._local_tensor if isinstance(o, DTensor) else o
        if not loc.numel():
            return []
        spans = self._spans.get(self._ref(loc.untyped_storage()))
        if not spans:
            return []
        start, stop = _storage_span(loc)
        return [j for a, b, j in spans if a < stop and start < b]


def _nbytes_spanned(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (``numel() > 0``)."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s byte range within its storage."""
    start = t.storage_offset() * t.element_size()
    return start, start + _nbytes_spanned(t)

"""Checked mode: type every op of a shard_map body by the mesh axes it varies over.

JAX types every value in a shard_map body with the set of mesh axes it varies over
("vma"). Where an invariant value meets a varying one, JAX inserts ``pvary``, whose
transpose is ``psum``: that is where a data-parallel gradient all-reduce comes from,
with no user code. This module does the same in eager PyTorch with one
``TorchFunctionMode`` and one rule that no op can miss:

- **Any op** (``torch.*``, ``Tensor.*``, ``F.*``, dunders, indexing, reversed and
  in-place operators alike): the result varies over the union of the axes of every
  tensor the call receives, including tensors inside slices (``x[i:i + 2]``). Each
  operand that needs gradients and misses some of those axes is first passed through
  ``pvary``, visible to autograd.
- **In-place ops** are known from the op's schema (an argument annotated as written,
  ``Tensor(a!)``), never from its name. A written operand that needs gradients and misses
  axes is made varying *in place* first (its history rebased onto ``pvary``), so
  ``y += x`` sums ``y``'s gradient as JAX's ``y = y + x`` does. Whatever the schema says,
  every tensor whose version counter moved during the call is retyped to the union, and
  so is the tensor it is a view of.
- **Values that leave the types** (``.item()``, ``.tolist()``, ``bool``/``int``/``float``
  of a varying tensor) make the body's replication promises unprovable over those axes:
  ``shard_map`` then verifies them at run time instead of trusting the types.
- An in-place op that torch refuses on a ``pvary``'d operand (a callable with no schema
  to consult) raises naming the op and its out-of-place form: nothing is guessed.

The tags are the ``vma`` field of the one per-value metadata record in
:mod:`fshard.meta`, which says how they survive ``detach``, ``torch.func`` wrappers,
``fs.value_and_grad`` and ``fs.remat``. Autograd entry points
(``torch.autograd.grad``/``backward``, ``Tensor.backward``) are never rewritten:
differentiating an invariant loss with respect to a varying value is JAX's ``grad``
inside ``shard_map``, and its transposes already do every reduction.

Unchecked mode installs nothing, so it adds no per-op cost.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fshard import lax
from fshard import meta as meta_util
from fshard import tree as tree_util

__all__ = ["VmaMode", "written_arguments", "storage_address"]

# Autograd entry points are not computations on values: they pass through untouched. (A
# "lift" of an invariant loss to varying before differentiating it added a pvary, hence a
# psum in backward: gradients came out axis_size times too large, or zero.)
_AUTOGRAD_ENTRY = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})

# Ops whose output is the input's value in the same layout (up to dtype or device): it
# keeps the input's global shape and spec, not only its varying axes.
_GRAD_GETTER = torch.Tensor.grad.__get__

_SAME_VALUE = frozenset(
    {
        torch.Tensor.detach,
        torch.detach,
        torch.Tensor.clone,
        torch.clone,
        torch.Tensor.contiguous,
        torch.Tensor.requires_grad_,
        torch.Tensor.to,
        torch.Tensor.cpu,
        torch.Tensor.cuda,
        torch.Tensor.double,
        torch.Tensor.float,
        torch.Tensor.half,
        torch.Tensor.bfloat16,
        torch.Tensor.type_as,
        torch.Tensor.view_as,
        torch.Tensor.data.__get__,
    }
)

# Python's conversions of a tensor's values to Python objects (the protocol methods and
# their spelled-out forms): what they return carries no type, so a varying value that
# goes through one can reach a replicated output unseen.
_LEAVES_TYPES = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__complex__,
        torch.equal,
        torch.Tensor.equal,
        torch.allclose,
        torch.Tensor.allclose,
        torch.is_nonzero,
        torch.Tensor.is_nonzero,
    }
)

# Python entry points with no aten op of their own: the aten op whose schema they follow.
_LOWERS_TO = {torch.Tensor.__setitem__: "index_put_"}

_NO_WRITES: tuple = ()
_WRITES: dict[Any, tuple] = {}


def written_arguments(func: Any) -> tuple:
    """The arguments ``func`` writes: positions and keyword names, from its aten schema.

    Every overload of the aten op that ``func`` binds (``Tensor.add_`` -> ``aten::add_``)
    contributes the arguments its schema marks as written (``Tensor(a!)``: ``self``, or a
    keyword-only ``out``). A Python function with an ``inplace`` parameter (``F.relu``)
    also writes its first argument when called with ``inplace=True``, listed as
    ``("inplace", i)`` (``i``: the parameter's position). Cached per callable.
    """
    hit = _WRITES.get(func)
    if hit is None:
        hit = _WRITES[func] = _schema_writes(func) + _inplace_param(func)
    return hit


def _schema_writes(func: Any) -> tuple:
    name = _LOWERS_TO.get(func) or getattr(func, "__name__", None)
    if not isinstance(name, str):
        return _NO_WRITES
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return _NO_WRITES  # no aten op binds it: the version counters decide after the call
    out: set = set()
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out.add(arg.name if arg.kwarg_only else i)
    return tuple(sorted(out, key=str))


def _inplace_param(func: Any) -> tuple:
    if not inspect.isfunction(func):
        return _NO_WRITES  # builtins: their schema says it all
    params = list(inspect.signature(func).parameters)
    return (("inplace", params.index("inplace")),) if "inplace" in params else _NO_WRITES


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for k in written_arguments(func):
        if isinstance(k, tuple):  # ("inplace", i): the first argument, when asked
            on = kwargs.get("inplace", args[k[1]] if len(args) > k[1] else False)
            x = args[0] if on and args else None
        elif isinstance(k, int):
            x = args[k] if k < len(args) else None
        else:
            x = kwargs.get(k)
        out.extend(t for t in tree_util.leaves(x) if isinstance(t, torch.Tensor))
    return out


def _tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call receives, including slice bounds (``x[i:i + 1]``).

    torch's signatures take tensors alone, in lists or tuples (``cat``, indices), in slices,
    or by keyword; a plain loop over those is several times cheaper per op than a pytree
    flatten, which matters because it runs for every op of a checked body.
    """
    out: list[torch.Tensor] = []
    _collect(args, out)
    if kwargs:
        _collect(kwargs.values(), out)
    return out


def _collect(seq: Any, out: list) -> None:
    for x in seq:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            _collect(x, out)
        elif type(x) is slice:
            out.extend(b for b in (x.start, x.stop, x.step) if isinstance(b, torch.Tensor))
        elif type(x) is dict:
            _collect(x.values(), out)


def _map_tensors(fn: Any, x: Any) -> Any:
    """``x`` with ``fn`` applied to each tensor :func:`_tensor_leaves` finds (the same
    object where nothing changed)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        new = [_map_tensors(fn, y) for y in x]
        if all(a is b for a, b in zip(new, x)):
            return x
        if type(x) is list or type(x) is tuple:
            return type(x)(new)
        return type(x)(*new) if hasattr(x, "_fields") else type(x)(new)
    if type(x) is slice:
        new = [_map_tensors(fn, b) for b in (x.start, x.stop, x.step)]
        return slice(*new)
    if type(x) is dict:
        return {k: _map_tensors(fn, v) for k, v in x.items()}
    return x


class VmaMode(TorchFunctionMode):
    """Types every op of a checked body and inserts implicit ``pvary`` (see module doc)."""

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
        leaves = _tensor_leaves(args, kwargs)
        if not leaves:
            return func(*args, **kwargs)
        metas = [meta_util.meta_of(x) for x in leaves]
        union = frozenset().union(*(m.vma for m in metas))
        if union and any(m.vma != union for m in metas):
            out = _mixed_call(func, args, kwargs, leaves, metas, union)
        else:
            out = func(*args, **kwargs)
        if union and func in _LEAVES_TYPES:
            _leaves_types(func, union)
        _tag_outputs(func, out, leaves, metas, union)
        return out


def _mixed_call(func, args: tuple, kwargs: dict, leaves: list, metas: list, union: frozenset) -> Any:
    """Runs ``func`` on operands of different types: lifts them, retypes what it wrote."""
    body = lax.BODY.get()
    written = _written_tensors(func, args, kwargs)
    for w in written:
        if _needs_lift(w, union):
            _lift_in_place(func, w, union, body)
    lifted = []

    def lift(x):
        if not isinstance(x, torch.Tensor) or any(x is w for w in written):
            return x
        y = _lift(x, union, body)
        if y is not x:
            lifted.append(y)
        return y

    args, kwargs = _map_tensors(lift, args), _map_tensors(lift, kwargs)
    versions = [_version(x) for x in leaves]
    try:
        out = func(*args, **kwargs)
    except RuntimeError as e:
        if lifted and "modified inplace" in str(e):
            raise RuntimeError(_inplace_message(func, union)) from e
        raise
    for x, v, m in zip(leaves, versions, metas):
        if _version(x) != v or any(x is w for w in written):  # written, by its counter or its schema
            _retype_written(x, m, union, body)
    return out


def _version(x: torch.Tensor) -> int:
    """``x``'s version counter; -1 for inference tensors, which keep none (and, made under
    ``inference_mode``, are never differentiated: their type only matters for values)."""
    try:
        return x._version
    except RuntimeError:
        return -1


def _needs_lift(x: torch.Tensor, union: frozenset) -> bool:
    return x.requires_grad and torch.is_grad_enabled() and bool(union - lax.vma(x))


def _mesh_order(body: Any, axes: frozenset) -> tuple[str, ...]:
    return tuple(a for a in body.mesh.axis_names if a in axes)


def _lift(x: torch.Tensor, union: frozenset, body: Any) -> torch.Tensor:
    missing = union - lax.vma(x)
    if not missing or not x.requires_grad:
        return x  # values are equal either way; only gradients need the psum
    axes = _mesh_order(body, missing)
    return lax.pvary(x, axes) if axes else x


def _lift_in_place(func: Any, w: torch.Tensor, union: frozenset, body: Any) -> None:
    """Rebases ``w``'s history onto ``pvary(w)``: an in-place op on an invariant value that
    makes it varying then sums its gradient, as JAX's out-of-place form does."""
    axes = _mesh_order(body, union - lax.vma(w))
    if not axes:
        return
    src = lax.pvary(w, axes).clone()
    try:
        w.copy_(src)
    except RuntimeError as e:
        raise RuntimeError(_inplace_message(func, union)) from e
    meta_util.set_vma(w, lax.vma(w) | frozenset(axes))


def _retype_written(x: torch.Tensor, m: meta_util.Meta, union: frozenset, body: Any) -> None:
    meta_util.set_vma(x, union)
    base = x._base
    if base is not None and not union <= lax.vma(base):
        meta_util.set_vma(base, lax.vma(base) | union)
    key = storage_address(x)
    if union - m.vma and key:
        # Other aliases of this memory keep their old types: a replication promise on any
        # of them is verified at run time (shard_map's exit reads this table).
        # The storage is held so that its address stays its own until the body ends.
        held = body.written.get(key)
        body.written[key] = (x.untyped_storage(), (held[1] if held else frozenset()) | union)


def storage_address(x: torch.Tensor) -> int:
    """The address of ``x``'s memory (0 for tensors without storage)."""
    try:
        return x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _leaves_types(func: Any, union: frozenset) -> None:
    body = lax.BODY.get()
    body.escaped[union] = getattr(func, "__qualname__", repr(func))


def _inplace_message(func: Any, union: frozenset) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return (
        f"fshard checked mode: {name} writes in place into a value that is invariant over mesh axes "
        f"{sorted(union)} while another operand varies over them. Its gradient must then be summed over "
        f"those axes (JAX's implicit pvary), which torch cannot attach to an in-place write here. Write it "
        f"out of place (y = y + x instead of y += x; y = torch.where(mask, v, y) or y.index_put((i,), v) "
        f"instead of y[i] = v), or make the value varying first with fs.lax.pvary(y, axes)."
    )


def _tag_outputs(func: Any, out: Any, leaves: list, metas: list, union: frozenset) -> None:
    if isinstance(out, torch.Tensor):
        _tag_output(func, out, leaves, metas, union)
        return
    for o in out if isinstance(out, (list, tuple)) else tree_util.leaves(out):
        if isinstance(o, torch.Tensor):
            _tag_output(func, o, leaves, metas, union)


def _tag_output(func: Any, o: torch.Tensor, leaves: list, metas: list, union: frozenset) -> None:
    first, x0 = metas[0], leaves[0]
    if any(o is x for x in leaves):
        meta_util.set_vma(o, union)  # in place or returned as is: keep its layout
    elif first.global_shape is not None and o.shape == x0.shape and (func in _SAME_VALUE or _same_memory(o, x0)):
        meta_util.set_meta(o, meta_util.Meta(union, first.global_shape, first.spec))
    else:
        # Tagged even when invariant, so that later lookups stop at the attribute.
        meta_util.tag_fresh(o, union)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """An alias of ``b`` with its geometry (``b[:]``, ``b.view(b.shape)``): the same value."""
    try:
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
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

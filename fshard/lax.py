"""Named-axis collectives with jax.lax's signatures, differentiable with exact transposes.

Call them inside a :func:`fshard.shard_map` body, on local tensors (or pytrees of them).
``axis_name`` is a mesh axis or a tuple of axes (their product, major to minor).

Transposes (autograd), as in JAX with varying/invariant types:

=================  ==============================================================
forward            backward
=================  ==============================================================
``psum``           identity: the cotangent of an invariant value is invariant
``pvary``          ``psum``: an invariant value used in varying code sums its grads
``pmean``          identity / n
``all_gather``     ``psum_scatter`` (same axis, same tiling)
``psum_scatter``   ``all_gather``
``ppermute(perm)`` ``ppermute(inverse perm)``
``all_to_all``     ``all_to_all`` with split and concat axes swapped
``all_gather(to=   this rank's slice of the cotangent (invariant -> varying), free
"invarying")``
``pbroadcast``     ``psum`` of the cotangent, kept at ``source`` (zeros elsewhere)
``pshuffle``       ``ppermute`` (it is one); ``pswapaxes``: ``all_to_all`` (it is one)
``pcast(to=        ``psum`` (it is ``pvary``)
"varying")``
``pmax``/``pmin``  not differentiable: backward raises (detach the input)
``ragged_all_to_   the exchange back (split sizes swapped), scatter-added to the
all``              operand's rows; output: the cotangent, received rows zeroed
=================  ==============================================================

The autograd functions use ``setup_context``, so ``torch.func.grad``/``vjp`` of a body
work as well as ``torch.autograd``. In checked mode (``shard_map(check=True)``) every
value carries the set of axes it varies over, and an invariant operand of a collective
is first made varying (``pvary``), exactly like JAX; see :mod:`fshard.transforms.vma`.
As in JAX 0.10.2, ``psum``, ``pmean``, ``psum_scatter`` and ``pvary`` over several axes
take a value that varies over all of them or none (docs/jax.md has the measured table).
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from fshard import _contract, _ragged, comm
from fshard import meta as _meta
from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh
from fshard.runtime import simulation

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pbroadcast",
    "pcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pswapaxes",
    "pvary",
    "ragged_all_to_all",
]

_MSG_OUTSIDE = (
    "fs.lax.{what} was called outside a shard_map body. Collectives need the mesh and "
    "run per device: wrap the function,\n"
    "    step = fs.shard_map(f, mesh=mesh, in_specs=..., out_specs=...)\n"
    "and call fs.lax.{what} inside f."
)


# The body context and per-value metadata (varying axes, global shape, spec) live in
# fshard.meta; the names below are kept here for the collectives and their callers.
Body = _meta.Body
BODY = _meta.BODY


def vma(x: torch.Tensor) -> frozenset:
    """The mesh axes ``x`` varies over (checked mode; empty = invariant everywhere)."""
    return _meta.meta_of(x).vma


def set_vma(x: torch.Tensor, axes: frozenset) -> torch.Tensor:
    """Tags ``x`` as varying over ``axes`` (other metadata kept); returns ``x``."""
    return _meta.set_vma(x, axes)


# --- axis groups ----------------------------------------------------------------------
@attrs.frozen
class _Axes:
    names: tuple[str, ...]  # user order, major to minor
    n: int
    group: Any
    me: int  # this rank's index in user order
    g_of_u: tuple[int, ...] | None  # group rank of user index u (None: identity)
    u_of_g: tuple[int, ...] | None


def _axes(what: str, axis_name: str | Sequence[str]) -> tuple[Body, _Axes]:
    body = BODY.get()
    if body is None:
        raise RuntimeError(_MSG_OUTSIDE.format(what=what))
    mesh = body.mesh
    names = mesh.check_axes(axis_name, what=f"fs.lax.{what}: axis_name")
    info = mesh._lax_axes.get(names)
    if info is None:
        info = mesh._lax_axes[names] = _build_axes(mesh, names)
    return body, info


def _build_axes(mesh: Mesh, names: tuple[str, ...]) -> _Axes:
    n = mesh.axis_size(names)
    in_mesh = mesh.sub_axes_in_mesh_order(names)
    g_of_u = u_of_g = None
    if in_mesh != names:
        sizes = [mesh.shape[a] for a in names]
        g_list = []
        for u in range(n):  # coordinates of user index u, then its row-major mesh-order index
            coord, rest = {}, u
            for a, s in reversed(list(zip(names, sizes))):
                coord[a], rest = rest % s, rest // s
            g = 0
            for a in in_mesh:
                g = g * mesh.shape[a] + coord[a]
            g_list.append(g)
        g_of_u = tuple(g_list)
        u_of_g = tuple(sorted(range(n), key=lambda u: g_list[u]))
    return _Axes(names, n, mesh.group(names), mesh.axis_index(names), g_of_u, u_of_g)


def _reorder(stacked: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """Reorders dim 0 (n chunks) so that position i holds chunk ``order[i]``."""
    if order is None:
        return stacked
    return stacked[list(order)]


# --- local (tensor-level) implementations, shared by forward and backward --------------
def _psum_raw(x, ax: _Axes, op: str = "sum"):
    return comm.all_reduce(x, ax.group, op, axes=ax.names)


def _gather_raw(x, ax: _Axes, axis: int, tiled: bool):
    if tiled:
        xt = x.movedim(axis, 0)
        out = comm.all_gather(xt, ax.group, ax.n, axes=ax.names)  # (n*s, ...)
        out = _reorder(out.view(ax.n, *xt.shape), ax.g_of_u)  # (n, s, ...), user order
        return out.reshape(ax.n * xt.shape[0], *xt.shape[1:]).movedim(0, axis)
    out = comm.all_gather(x.unsqueeze(0), ax.group, ax.n, axes=ax.names)  # (n, *x.shape)
    return _reorder(out, ax.g_of_u).movedim(0, axis)


def _scatter_raw(x, ax: _Axes, dim: int, tiled: bool):
    xt = x.movedim(dim, 0)
    if tiled:
        chunks = xt.reshape(ax.n, xt.shape[0] // ax.n, *xt.shape[1:])  # (n, s/n, ...)
        chunks = _reorder(chunks, ax.u_of_g)  # group order
        out = comm.reduce_scatter(chunks.reshape(xt.shape), ax.group, ax.n, axes=ax.names)
        return out.movedim(0, dim)
    out = comm.reduce_scatter(_reorder(xt, ax.u_of_g), ax.group, ax.n, axes=ax.names)  # (1, ...)
    return out.squeeze(0)


def _all_to_all_raw(x, ax: _Axes, split_axis: int, concat_axis: int, tiled: bool):
    xt = x.movedim(split_axis, 0)
    chunks = xt.reshape(ax.n, xt.shape[0] // ax.n, *xt.shape[1:])  # (n, s/n, ...) by dest
    chunks = _reorder(chunks, ax.u_of_g)
    got = comm.all_to_all(chunks.reshape(xt.shape), ax.group, ax.n, axes=ax.names)
    got = _reorder(got.view(chunks.shape), ax.g_of_u)  # (n, s/n, ...) by source
    got = got.movedim(1, split_axis + 1)  # (n, *chunk shape)
    if tiled:
        got = got.movedim(0, concat_axis)  # n just before concat dim
        shape = list(got.shape)
        return got.reshape(*shape[:concat_axis], shape[concat_axis] * shape[concat_axis + 1], *shape[concat_axis + 2 :])
    return got.squeeze(split_axis + 1).movedim(0, concat_axis)


def _permute_raw(x, ax: _Axes, perm: Sequence[tuple[int, int]]):
    return _permute_start_raw(x, ax, perm).wait()


def _permute_start_raw(x, ax: _Axes, perm: Sequence[tuple[int, int]]) -> comm.Handle:
    if ax.g_of_u is None:
        sends, me = list(perm), ax.me
    else:
        sends = [(ax.g_of_u[s], ax.g_of_u[d]) for s, d in perm]
        me = ax.g_of_u[ax.me]
    return comm.permute_async(x, ax.group, sends, me, axes=ax.names)


def _apply(fn: type[torch.autograd.Function], t: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn.apply`` when autograd (or a torch.func transform) will need it; the raw forward
    otherwise (apply is not free)."""
    if (t.requires_grad and torch.is_grad_enabled()) or _functorch.is_functorch_wrapped_tensor(t):
        return fn.apply(t, *args)
    return fn.forward(t, *args)


_functorch = torch._C._functorch


def _batched(fn: type[torch.autograd.Function], shift: tuple[int, ...]):
    """A ``vmap`` rule: the batch dim moves to the front and the collective runs once on the
    stacked values (each is elementwise over the leading dims, or takes a dim argument,
    shifted by one). ``shift`` = the positions of ``fn``'s dim arguments."""

    def vmap(info, in_dims, x, *args):
        if in_dims[0] is None:
            return fn.apply(x, *args), None
        args = tuple(a + 1 if i in shift else a for i, a in enumerate(args, start=1))
        return fn.apply(x.movedim(in_dims[0], 0), *args), 0

    return staticmethod(vmap)


# --- autograd functions (setup_context style: torch.func-compatible) --------------------
class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x, ax):
        return _psum_raw(x, ax)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax = inputs[1]

    @staticmethod
    def backward(ctx, g):
        # JAX's transpose of psum is pvary: the identity on values, and (when this backward
        # is itself differentiated: grad of grad) a psum of what flows back through it.
        return _apply(_Pvary, g, ctx.ax), None

    @staticmethod
    def jvp(ctx, t, _):
        return _apply(_Psum, t, ctx.ax)  # linear: the tangent of a psum is the psum of the tangent


class _Pvary(torch.autograd.Function):
    @staticmethod
    def forward(x, ax):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _apply(_Psum, g, ctx.ax), None  # (_apply: a torch.func-wrapped g needs the Function)

    @staticmethod
    def jvp(ctx, t, _):
        return _apply(_Pvary, t, ctx.ax)


class _PReduceNoGrad(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, op):
        # Over axes of size 1 the value is its own max, but still not differentiable (JAX's
        # rule does not depend on the size).
        return _psum_raw(x, ax, op) if ax.n > 1 else x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[2]

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError(
            f"fs.lax.p{ctx.op} has no gradient (as in JAX). Use it on a value that needs none: "
            f"fs.lax.p{ctx.op}(x.detach(), axis_name)."
        )


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, axis, tiled):
        return _gather_raw(x, ax, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.axis, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, g):
        return _apply(_PsumScatter, g, ctx.ax, ctx.axis, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_AllGather, t, ctx.ax, ctx.axis, ctx.tiled)


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, dim, tiled):
        return _scatter_raw(x, ax, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, g):
        return _apply(_AllGather, g, ctx.ax, ctx.dim, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_PsumScatter, t, ctx.ax, ctx.dim, ctx.tiled)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, split_axis, concat_axis, tiled):
        return _all_to_all_raw(x, ax, split_axis, concat_axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.split, ctx.concat, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, g):
        return _apply(_AllToAll, g, ctx.ax, ctx.concat, ctx.split, ctx.tiled), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_AllToAll, t, ctx.ax, ctx.split, ctx.concat, ctx.tiled)


class _Ppermute(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, perm):
        return _permute_raw(x, ax, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.perm = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        inverse = tuple((d, s) for s, d in ctx.perm)
        return _apply(_Ppermute, g, ctx.ax, inverse), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_Ppermute, t, ctx.ax, ctx.perm)


class _PpermuteDone(torch.autograd.Function):
    """The result of a ppermute started by :func:`ppermute_start`: forward waits for the
    transfer in flight; the transposes are ppermute's (backward: the inverse perm)."""

    @staticmethod
    def forward(x, ax, perm, handle):
        return handle.wait()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.perm = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):  # ppermute's rules, one copy of them
        return (*_Ppermute.backward(ctx, g), None)

    @staticmethod
    def jvp(ctx, t, *_):
        return _Ppermute.jvp(ctx, t)


class _AllGatherInvariant(torch.autograd.Function):
    """``all_gather(to="invarying")``: the same values, typed invariant; its transpose is
    this rank's slice of the (invariant) cotangent, no collective."""

    @staticmethod
    def forward(x, ax, axis, tiled):
        return _gather_raw(x, ax, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.axis, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, g):
        return _apply(_SliceMine, g, ctx.ax, ctx.axis, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_AllGatherInvariant, t, ctx.ax, ctx.axis, ctx.tiled)


def _slice_mine_raw(g, ax: _Axes, axis: int, tiled: bool):
    size = g.shape[axis] // ax.n

    def mine(g, me):  # per rank: under fs.simulate each rank takes its own slice
        return g.narrow(axis, me * size, size).clone() if tiled else g.select(axis, me).clone()

    return simulation.per_rank(mine)(g, ax.me)


class _SliceMine(torch.autograd.Function):
    @staticmethod
    def forward(g, ax, axis, tiled):
        return _slice_mine_raw(g, ax, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.axis, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, g):
        # JAX: the slice's operand is invariant, so its implicit pvary sums the padded
        # cotangents, which is the gather of every rank's slice.
        return _apply(_AllGatherInvariant, g, ctx.ax, ctx.axis, ctx.tiled), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_SliceMine, t, ctx.ax, ctx.axis, ctx.tiled)


def _pbroadcast_raw(x, ax: _Axes, source: int):
    # A gather, then the source's block: an exact copy (a psum of masked values would turn
    # -0.0 into 0.0).
    return _gather_raw(x, ax, 0, False)[source].clone()


def _pbroadcast_t_raw(g, ax: _Axes, source: int):
    stack = g.new_zeros((ax.n, *g.shape))
    stack[source] = g
    return _scatter_raw(stack, ax, 0, False)  # source gets the sum, the others zeros


class _Pbroadcast(torch.autograd.Function):
    @staticmethod
    def forward(x, ax, source):
        return _pbroadcast_raw(x, ax, source)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.source = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return _apply(_PbroadcastT, g, ctx.ax, ctx.source), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_Pbroadcast, t, ctx.ax, ctx.source)


class _PbroadcastT(torch.autograd.Function):
    """pbroadcast's transpose (JAX: ``select(axis_index == source, psum(t), 0)``); its own
    transpose is pbroadcast."""

    @staticmethod
    def forward(g, ax, source):
        return _pbroadcast_t_raw(g, ax, source)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.source = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return _apply(_Pbroadcast, g, ctx.ax, ctx.source), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_PbroadcastT, t, ctx.ax, ctx.source)


for _fn, _dims in (
    (_Psum, ()),
    (_Pvary, ()),
    (_PReduceNoGrad, ()),
    (_AllGather, (2,)),
    (_PsumScatter, (2,)),
    (_AllToAll, (2, 3)),
    (_Ppermute, ()),
    (_AllGatherInvariant, (2,)),
    (_SliceMine, (2,)),
    (_Pbroadcast, ()),
    (_PbroadcastT, ()),
):
    _fn.vmap = _batched(_fn, _dims)


# --- public API -------------------------------------------------------------------------
_IN_LAX: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_in_lax", default=False)


def _map(what: str, x: Any, axis_name, one, *, to_varying: bool | None, all_or_none: bool = False):
    """Applies ``one(leaf, body, axes)`` to every tensor leaf, with checked-mode typing.

    ``to_varying``: True -> output varies over the axes, False -> invariant over them,
    None -> no typing change beyond the input's. ``all_or_none``: a leaf must vary over
    all of the axes or none of them (JAX's rule for the reducing collectives).
    """
    body, ax = _axes(what, axis_name)
    names = frozenset(ax.names)
    token = _IN_LAX.set(True)
    wtoken = _contract.WHAT.set(what)  # the header names fs.lax's op (pmean and psum differ)
    try:

        def leaf(t):
            if not isinstance(t, torch.Tensor):
                return t
            if body.check:
                if all_or_none:
                    _check_all_or_none(what, t, ax.names)
                t = _make_varying(t, ax, names)
            out = one(t, ax)  # each ``one`` skips the collective for an axis of size 1
            if body.check:
                base = vma(t)
                set_vma(out, base | names if to_varying else (base - names if to_varying is False else base))
            return out

        return tree_util.tree_map(leaf, x)
    finally:
        _contract.WHAT.reset(wtoken)
        _IN_LAX.reset(token)


_MSG_MIXED = (
    "fs.lax.{what} over {axes}: the value varies over {varying} but not over {invariant} "
    "(checked mode). As in JAX, {what} takes a value that varies over all of its axes or "
    "over none of them. Fix: {fix}"
)

# The fix each all-or-none collective suggests (JAX refuses the same calls, see docs/jax.md).
_FIX_MIXED = {
    "psum": "make it varying over the rest first, fs.lax.{what}(fs.lax.pvary(x, {invariant}), {axes}) "
    "(every rank's copy then counts), or reduce over {varying} only.",
    "pvary": "pvary over the axes it does not vary over yet: fs.lax.pvary(x, {invariant}).",
}
_FIX_MIXED["pmean"] = _FIX_MIXED["psum_scatter"] = _FIX_MIXED["psum"]


def _axes_repr(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def _check_all_or_none(what: str, t: torch.Tensor, names: tuple[str, ...]) -> None:
    """JAX 0.10.2's rule for psum, pmean, psum_scatter and pvary over several axes: the
    value varies over all of them or none (pmax, pmin, all_gather, ppermute and
    all_to_all accept any mix). Raises ``ValueError`` otherwise."""
    v = vma(t)
    varying = tuple(a for a in names if a in v)
    if not varying or len(varying) == len(names):
        return
    parts = {
        "what": what,
        "axes": _axes_repr(names),
        "varying": _axes_repr(varying),
        "invariant": _axes_repr(tuple(a for a in names if a not in v)),
    }
    raise ValueError(_MSG_MIXED.format(**parts, fix=_FIX_MIXED[what].format(**parts)))


def _make_varying(t: torch.Tensor, ax: _Axes, names: frozenset) -> torch.Tensor:
    missing = names - vma(t)
    if not missing:
        return t
    sub = _sub_axes(ax, missing)
    # Over size-1 axes the backward psum would be a collective over one rank: skip it.
    out = _Pvary.apply(t, sub) if t.requires_grad and sub.n > 1 else t.view_as(t)
    return set_vma(out, vma(t) | missing)


def _sub_axes(ax: _Axes, names: frozenset) -> _Axes:
    body = BODY.get()
    return _axes("pvary", tuple(a for a in body.mesh.axis_names if a in names))[1]


def psum(x: Any, axis_name: str | Sequence[str]) -> Any:
    """All-reduce sum over ``axis_name``. Shape unchanged; result invariant over the axes.

    Dtypes (as JAX 0.10.2): bool is counted, converted to int32 before the sum (all-True
    over n ranks gives n); other dtypes are kept (integers wrap as in their dtype).

    Checked mode: the value varies over all of the axes or none (JAX's rule); an
    invariant one is summed as ``n`` copies. Backward: identity (the cotangent of an
    invariant output is invariant).

    Raises:
      ValueError: (checked mode) the value varies over some of the axes only.
    """
    return _psum("psum", x, axis_name)


def _psum(what: str, x: Any, axis_name) -> Any:
    def one(t, ax):
        t = _summable(t)
        return _apply(_Psum, t, ax) if ax.n > 1 else t.view_as(t)

    return _map(what, x, axis_name, one, to_varying=False, all_or_none=True)


# --- dtype rules (JAX 0.10.2, measured by tests/faults/faults_jax_dtype_table.py) --------
# psum of bool counts: JAX converts bool to int32 before the sum (with or without x64), so
# all-True over n ranks gives n, not True (a sum of bools on gloo is a logical OR).
# pmean = psum / n with JAX's true division: an integer (or bool, counted in int32) sum
# becomes float32, a 64-bit one float64; floating dtypes are kept. psum_scatter of bool is
# refused (JAX: "add does not accept dtype bool"); integer sums keep their dtype.
_MEAN_DTYPE = {torch.int64: torch.float64, torch.uint64: torch.float64}


def _summable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as psum sums it: bool is counted in int32 (JAX's rule)."""
    return t.to(torch.int32) if t.dtype == torch.bool else t


def _mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``pmean`` of a (psum-ed) value of ``dtype``: floats kept, 64-bit ints
    to float64, other ints (and bool, summed as int32) to float32, as JAX's true division."""
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return _MEAN_DTYPE.get(dtype, torch.float32)


def pmean(x: Any, axis_name: str | Sequence[str]) -> Any:
    """``psum(x, axis_name) / axis_size(axis_name)`` (the same all-or-none rule).

    Dtypes (as JAX 0.10.2): floating values keep their dtype; bool and integer values are
    summed (bool counted in int32), then divided in float32 (float64 for 64-bit integers),
    so the mean of an all-True bool is 1.0.
    """
    n = axis_size(axis_name)

    def mean(t):
        if not isinstance(t, torch.Tensor):
            return t
        return (t if t.dtype == _mean_dtype(t.dtype) else t.to(_mean_dtype(t.dtype))) / n

    return tree_util.tree_map(mean, _psum("pmean", x, axis_name))


def pmax(x: Any, axis_name: str | Sequence[str]) -> Any:
    """All-reduce max. Not differentiable: its backward raises (detach the input)."""
    return _map("pmax", x, axis_name, lambda t, ax: _apply(_PReduceNoGrad, t, ax, "max"), to_varying=False)


def pmin(x: Any, axis_name: str | Sequence[str]) -> Any:
    """All-reduce min. Not differentiable: its backward raises (detach the input)."""
    return _map("pmin", x, axis_name, lambda t, ax: _apply(_PReduceNoGrad, t, ax, "min"), to_varying=False)


def pvary(x: Any, axis_name: str | Sequence[str]) -> Any:
    """Marks an invariant value as varying over ``axis_name``: identity forward, psum backward.

    Megatron's "f". Needed in unchecked mode wherever a replicated value (e.g. a
    parameter with spec ``P()``) meets data that differs across the axis; checked
    mode inserts it for you. Checked mode: a value already varying over all of the axes
    is returned as it is (JAX refuses it; a row of docs/jax.md), one varying over some of
    them only is refused, as in JAX.

    Raises:
      ValueError: (checked mode) the value varies over some of the axes only.
    """

    def one(t, ax):
        return _apply(_Pvary, t, ax) if ax.n > 1 else t.view_as(t)

    body, ax = _axes("pvary", axis_name)
    names = frozenset(ax.names)

    def leaf(t):
        if not isinstance(t, torch.Tensor):
            return t
        if body.check:
            _check_all_or_none("pvary", t, ax.names)
            if names <= vma(t):
                return t  # already varying (JAX refuses; docs/jax.md): nothing to sum in backward
        return set_vma(one(t, ax), vma(t) | names) if body.check else one(t, ax)

    token = _IN_LAX.set(True)
    try:
        return tree_util.tree_map(leaf, x)
    finally:
        _IN_LAX.reset(token)


def all_gather(
    x: Any, axis_name: str | Sequence[str], *, axis: int = 0, tiled: bool = False, to: str = "varying"
) -> Any:
    """Gathers the shards of every rank on ``axis_name``, ordered by axis index.

    Shapes (n = axis size): ``tiled=False``: a new dim of size n at ``axis``;
    ``tiled=True``: dim ``axis`` grows n-fold.

    Args:
      to: the result's type over the axes, as JAX 0.10.2's ``to``. ``"varying"`` (default):
        varying, backward ``psum_scatter``. ``"invarying"`` (JAX's spelling; JAX's
        ``all_gather_invariant``): invariant, so ``out_specs=P()`` takes it in checked
        mode, and the backward is this rank's slice of the cotangent, no collective.
        ``"reduced"`` is refused: reduced values are not built yet.

    Raises:
      ValueError: ``to`` is not one of JAX's values; ``axis`` is not a dim of the value
        (tiled) or of the result (untiled): a 0-d value cannot be gathered tiled (JAX
        refuses it too); use ``tiled=False``.
      NotImplementedError: ``to="reduced"``.
    """
    if to not in _ALL_GATHER_TO:
        raise ValueError(
            f"fs.lax.all_gather over {axis_name!r}: to={to!r} is not one of JAX's values "
            f"{sorted(_ALL_GATHER_TO)} ('invarying' is JAX's spelling of an invariant result)."
        )
    if to == "reduced":
        raise NotImplementedError(_not_built("all_gather", axis_name, "to='reduced'", "reduced"))
    invariant = to == "invarying"
    fn = _AllGatherInvariant if invariant else _AllGather

    def one(t, ax):
        a = _dim("all_gather", t, axis, ax, "axis", tiled=tiled, extra=0 if tiled else 1)
        if ax.n == 1:
            return t.view_as(t) if tiled else t.unsqueeze(a)
        return _apply(fn, t, ax, a, tiled)

    return _map("all_gather", x, axis_name, one, to_varying=not invariant)


_ALL_GATHER_TO = frozenset({"varying", "invarying", "reduced"})  # JAX 0.10.2's _allowed_ag_to


def _not_built(what: str, axis_name, form: str, state: str) -> str:
    return (
        f"fs.lax.{what}(..., {axis_name!r}, {form}): {state} values are not built yet in fshard "
        f"(issue 34, item 2: the unreduced/reduced per-axis states). Use to='varying' (or "
        f"fs.lax.pvary) and an explicit fs.lax.psum where JAX would reduce the unreduced value."
    )


def pcast(x: Any, axis_name: str | Sequence[str], *, to: str) -> Any:
    """JAX's ``pcast``: changes the type of ``x`` over ``axis_name``.

    ``to="varying"`` is :func:`pvary` (an invariant value becomes varying: identity
    forward, ``psum`` backward; the same leniency for an already varying value, see
    docs/jax.md). An empty ``axis_name`` returns ``x``.

    Raises:
      TypeError: ``axis_name`` is a set (JAX refuses it: the order of the axes matters).
      ValueError: ``to`` is not one of JAX's values.
      NotImplementedError: ``to="reduced"`` or ``"unreduced"``: those states are not built yet.
    """
    if isinstance(axis_name, (set, frozenset)):
        raise TypeError(
            f"fs.lax.pcast: axis_name={axis_name!r} must be a str or a tuple of axes (as in JAX), not a set."
        )
    if not axis_name:
        return x
    if to not in _PCAST_TO:
        raise ValueError(f"fs.lax.pcast over {axis_name!r}: to={to!r}; JAX's values are {sorted(_PCAST_TO)}.")
    if to != "varying":
        raise NotImplementedError(_not_built("pcast", axis_name, f"to={to!r}", to))
    return pvary(x, axis_name)


_PCAST_TO = frozenset({"varying", "reduced", "unreduced"})  # JAX 0.10.2's _allowed_pcast_to


def pbroadcast(x: Any, axis_name: str | Sequence[str], source: int) -> Any:
    """Every rank gets the value of axis index ``source`` (JAX's collective broadcast).

    Checked mode: as in JAX, the value must vary over every axis of ``axis_name`` (no
    implicit ``pvary``), and the result keeps its type: varying (the ranks hold equal
    values, but the type does not say so). Backward: the cotangents' ``psum``, on the
    ``source`` rank; the others get zeros.

    Raises:
      ValueError: ``source`` is outside the axis; (checked mode) the value is invariant
        over some of the axes.
    """
    body, ax = _axes("pbroadcast", axis_name)
    source = int(source)
    if not 0 <= source < ax.n:
        raise ValueError(
            f"fs.lax.pbroadcast over {_axes_repr(ax.names)} (size {ax.n}): source={source} must be in [0, {ax.n})."
        )

    def check(t):
        if body.check and isinstance(t, torch.Tensor) and (missing := tuple(n for n in ax.names if n not in vma(t))):
            raise ValueError(
                f"fs.lax.pbroadcast over {_axes_repr(ax.names)}: the value (shape {tuple(t.shape)}) is invariant over "
                f'{_axes_repr(missing)} (checked mode). As in JAX ("Collective pbroadcast must be applied to a '
                f'device-varying type"), pbroadcast takes a value varying over all of its axes. Fix: use the value '
                f"as it is (it is already equal on every rank there), or fs.lax.pvary(x, {_axes_repr(missing)}) first."
            )
        return t

    tree_util.tree_map(check, x)  # before _map's implicit pvary: pbroadcast has none in JAX
    return _map(
        "pbroadcast",
        x,
        axis_name,
        lambda t, a: _apply(_Pbroadcast, t, a, source) if a.n > 1 else t.view_as(t),
        to_varying=True,
    )


def pshuffle(x: Any, axis_name: str | Sequence[str], perm: Sequence[int]) -> Any:
    """``ppermute`` with JAX's other encoding: axis index ``i`` gets the value of ``perm[i]``.

    Raises:
      ValueError: ``perm`` is not a permutation of ``range(len(perm))``, or does not fit the axis.
    """
    perm = [int(p) for p in perm]
    if set(perm) != set(range(len(perm))):
        raise ValueError(f"fs.lax.pshuffle over {axis_name!r}: perm={perm} is not a permutation of range({len(perm)}).")
    return ppermute(x, axis_name, list(zip(perm, range(len(perm)))))


def pswapaxes(x: Any, axis_name: str | Sequence[str], axis: int, *, axis_index_groups: Any = None) -> Any:
    """Swaps the mapped axis ``axis_name`` with dim ``axis``: ``all_to_all(x, axis_name, axis, axis)``.

    Needs ``x.shape[axis] == axis_size(axis_name)``. Backward: the same swap.

    Raises:
      ValueError: the dim does not fit the axis size.
      NotImplementedError: ``axis_index_groups`` is given (fs.lax has no axis index groups).
    """
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"fs.lax.pswapaxes over {axis_name!r}: axis_index_groups={axis_index_groups!r} is not supported "
            f"(fs.lax collectives run over whole mesh axes). Fix: give the groups their own mesh axis, "
            f"e.g. fs.make_mesh({{..., 'outer': n // k, 'inner': k}}), and swap over it."
        )
    return all_to_all(x, axis_name, axis, axis)


def psum_scatter(x: Any, axis_name: str | Sequence[str], *, scatter_dimension: int = 0, tiled: bool = False) -> Any:
    """Sums over ``axis_name`` and keeps this rank's slice of ``scatter_dimension``.

    Shapes (n = axis size): ``tiled=False`` needs ``x.shape[d] == n`` and removes dim d;
    ``tiled=True`` needs ``x.shape[d] % n == 0`` and divides it by n. Backward: ``all_gather``.

    Checked mode: the value varies over all of the axes or none (JAX's rule).

    Dtypes (as JAX 0.10.2): integer and floating dtypes are kept; bool is refused.

    Raises:
      TypeError: a bool value.
      ValueError: the dim does not fit the axis size (names both), or is not a dim of
        the value (a 0-d value has none; JAX refuses it too); (checked mode) the value
        varies over some of the axes only.
    """

    def one(t, ax):
        if t.dtype == torch.bool:
            raise TypeError(
                f"fs.lax.psum_scatter over {_axes_repr(ax.names)}: the value is bool (shape {tuple(t.shape)}); "
                f'as in JAX ("add does not accept dtype bool"), bool values are not summed and scattered. '
                f"Cast first, e.g. fs.lax.psum_scatter(x.to(torch.int32), ...) to count."
            )
        d = _dim("psum_scatter", t, scatter_dimension, ax, "scatter_dimension", tiled=tiled)
        _check_split("psum_scatter", t, d, ax, exact=not tiled)
        if ax.n == 1:
            return t.view_as(t) if tiled else t.squeeze(d)
        return _apply(_PsumScatter, t, ax, d, tiled)

    return _map("psum_scatter", x, axis_name, one, to_varying=True, all_or_none=True)


def all_to_all(
    x: Any, axis_name: str | Sequence[str], split_axis: int, concat_axis: int, *, tiled: bool = False
) -> Any:
    """Splits ``split_axis`` into n chunks, sends chunk j to axis index j, concatenates on ``concat_axis``.

    Shapes: ``tiled=True``: split dim / n, concat dim * n. ``tiled=False``: needs
    ``x.shape[split_axis] == n``; output = ``insert(delete(shape, split_axis), concat_axis, n)``.
    Backward: ``all_to_all`` with the two axes swapped.

    Raises:
      ValueError: the split dim does not fit the axis size, or an axis is not a dim of
        the value (a 0-d value has none; JAX refuses it too).
    """

    def one(t, ax):
        s = _dim("all_to_all", t, split_axis, ax, "split_axis", tiled=tiled)
        c = _dim("all_to_all", t, concat_axis, ax, "concat_axis", tiled=tiled)
        _check_split("all_to_all", t, s, ax, exact=not tiled)
        if ax.n == 1:
            return t.view_as(t) if tiled else t.squeeze(s).unsqueeze(c)
        return _apply(_AllToAll, t, ax, s, c, tiled)

    return _map("all_to_all", x, axis_name, one, to_varying=True)


def ppermute(x: Any, axis_name: str | Sequence[str], perm: Sequence[tuple[int, int]]) -> Any:
    """Sends this rank's ``x`` along ``perm`` = ``[(src, dst), ...]`` (axis indices).

    Ranks that are no ``dst`` receive zeros. Backward: ``ppermute`` with pairs inverted.

    Raises:
      ValueError: a repeated source or destination, or an index outside the axis.
    """
    _, ax = _axes("ppermute", axis_name)
    perm = _checked_perm(perm, ax)
    return _map(
        "ppermute",
        x,
        axis_name,
        lambda t, a: (
            _apply(_Ppermute, t, a, perm) if a.n > 1 else (t.view_as(t) if (0, 0) in perm else torch.zeros_like(t))
        ),
        to_varying=True,
    )


def _checked_perm(perm: Sequence[tuple[int, int]], ax: _Axes) -> tuple[tuple[int, int], ...]:
    perm = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    bad = [i for i in srcs + dsts if not 0 <= i < ax.n]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or bad:
        raise ValueError(
            f"fs.lax.ppermute: perm={list(perm)} over {ax.names} (size {ax.n}) must have unique "
            f"sources and unique destinations in [0, {ax.n}); "
            + (f"out of range: {bad}" if bad else "duplicates found")
        )
    return perm


def ppermute_start(x: torch.Tensor, axis_name: str | Sequence[str], perm: Sequence[tuple[int, int]]):
    """Starts ``ppermute(x, axis_name, perm)`` and returns a function that waits for it and
    returns its result: the compute between the two calls overlaps the transfer (fshard's,
    not JAX's, which has no eager code to overlap). The result, its type in checked mode and
    its gradient are ``ppermute``'s.

    No other collective may start on the group before the wait (on gloo the next one would
    complete this one first). Under a torch.func transform, or over an axis of size 1, the
    transfer is ``ppermute``'s, made at once.
    """
    if x.dim() == 0 or _functorch.is_functorch_wrapped_tensor(x) or axis_size(axis_name) == 1:
        done = ppermute(x, axis_name, perm)
        return lambda: done
    body, ax = _axes("ppermute", axis_name)
    perm = _checked_perm(perm, ax)
    names = frozenset(ax.names)
    token, wtoken = _IN_LAX.set(True), _contract.WHAT.set("ppermute")
    try:
        t = _make_varying(x, ax, names) if body.check else x
        handle = _permute_start_raw(t.detach(), ax, perm)
    finally:
        _contract.WHAT.reset(wtoken)
        _IN_LAX.reset(token)

    def wait() -> torch.Tensor:
        token = _IN_LAX.set(True)
        try:
            grad = t.requires_grad and torch.is_grad_enabled()
            out = _PpermuteDone.apply(t, ax, perm, handle) if grad else handle.wait()
        finally:
            _IN_LAX.reset(token)
        return set_vma(out, vma(t) | names) if body.check else out

    return wait


def axis_index(axis_name: str | Sequence[str]) -> torch.Tensor:
    """This rank's index along ``axis_name`` (row-major over a tuple, in its order).

    Returns a 0-d int64 tensor on the CPU, as JAX returns an int array: in checked mode it
    varies over the axes, so every op that uses it (arithmetic, comparisons, ``where``,
    indexing) is typed varying over them, and an invariant operand that needs gradients
    gets the implicit ``pvary``. On the CPU it mixes with CUDA tensors as a scalar and
    reads back with no device sync: ``x[i]``, ``x[i * k:(i + 1) * k]``, ``range(i)`` and
    ``int(i)`` work; ``int(i)`` is a plain host int, typed invariant, for where a host
    value is meant (seeds, Python control flow).
    """
    body, ax = _axes("axis_index", axis_name)
    i = simulation.per_rank(_index_tensor)(ax.me)  # under fs.simulate, each rank's own index
    return set_vma(i, frozenset(ax.names)) if body.check else i


def _index_tensor(me: int) -> torch.Tensor:
    return torch.tensor(me, dtype=torch.int64, device="cpu")


def axis_size(axis_name: str | Sequence[str]) -> int:
    """The size of ``axis_name`` (the product for a tuple)."""
    return _axes("axis_size", axis_name)[1].n


def _check_split(what: str, t: torch.Tensor, d: int, ax: _Axes, *, exact: bool) -> None:
    size = t.shape[d]
    if (exact and size != ax.n) or (not exact and size % ax.n):
        need = f"equal to {ax.n}" if exact else f"divisible by {ax.n}"
        raise ValueError(
            f"fs.lax.{what}: dim {d} of the local value (shape {tuple(t.shape)}) has size {size}, "
            f"which must be {need}, the size of axis {ax.names}"
            + (" (tiled=False)" if exact else " (tiled=True)")
            + "."
        )


def _dim(what: str, t: torch.Tensor, axis: int, ax: _Axes, arg: str, *, tiled: bool, extra: int = 0) -> int:
    """``axis`` normalized to ``[0, t.dim() + extra)`` (``extra``: the new dim of an untiled
    all_gather), as JAX's ``canonicalize_axis``.

    Raises:
      ValueError: out of range, naming the op, the mesh axes, the shape and ``tiled``. A
        0-d value has no dim to tile or split: JAX 0.10.2 refuses it too ("axis 0 is out
        of bounds for array of dimension 0", or an IndexError for psum_scatter).
    """
    ndim = t.dim() + extra
    if -ndim <= axis < ndim:
        return axis % ndim
    hint = ""
    if t.dim() == 0:
        hint = (
            " A 0-d value has no dim to "
            + ("tile" if what == "all_gather" else "split")
            + "; "
            + (
                "use tiled=False (a new dim of size n) or x.reshape(1)."
                if what == "all_gather"
                else "give it one first (x.reshape(1)), or use psum."
            )
        )
    raise ValueError(
        f"fs.lax.{what} over {_axes_repr(ax.names)}: {arg}={axis} is out of range for the local value of "
        f"shape {tuple(t.shape)} ({t.dim()}-d, tiled={tiled}); it must be in [{-ndim}, {ndim}).{hint}"
    )


class _AllToAllV(torch.autograd.Function):
    """Rows to peers by per-peer counts (group-rank order); transpose: the counts swapped."""

    @staticmethod
    def forward(x, ax, send, recv):
        return comm.all_to_all_v(x, ax.group, send, recv, axes=ax.names)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx, g):
        return _apply(_AllToAllV, g, ctx.ax, ctx.recv, ctx.send), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply(_AllToAllV, t, ctx.ax, ctx.send, ctx.recv)


def ragged_all_to_all(
    operand: torch.Tensor,
    output: torch.Tensor,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    *,
    axis_name: str | Sequence[str],
) -> torch.Tensor:
    """Sends ragged slices of ``operand`` to every rank of ``axis_name`` and writes the
    received ones into ``output`` (``jax.lax.ragged_all_to_all``).

    The rule (JAX's). ``K = len(input_offsets)`` is a multiple of the axis size ``n``; with
    ``s = K // n`` slices per peer, this rank sends ``operand[input_offsets[i]:][:send_sizes[i]]``
    to axis index ``i // s``, which writes it at row ``output_offsets[i]`` of its own
    ``output``. The result is ``output`` with every received slice written in; rows no slice
    reaches keep ``output``'s values. ``recv_sizes[j]`` is the size of the slice received from
    axis index ``j // s``: ``send_sizes`` on every rank must equal
    ``all_to_all(recv_sizes, tiled=True)``.

    Lowering. One ``all_gather`` of the four integer vectors over the axis gives every rank
    the whole plan, so that every rank checks it the same way and a bad plan raises on every
    rank instead of hanging the ones it does not concern. Then one ``all_to_all_single``
    with this rank's row counts per peer (host ints: reading the plan is one device sync
    per call, as in torchtitan's dispatch). The data path is ``index_select`` (the rows
    sent, in peer order) -> the exchange -> ``index_copy`` into ``output``, and autograd
    transposes it: the exchange's transpose is the exchange with the split sizes swapped,
    ``index_select``'s is a scatter-add to the operand's rows, ``index_copy``'s gives
    ``output`` the cotangent with the received rows zeroed. That is JAX's transpose rule
    (a ragged_all_to_all back, and the output cotangent masked), with two differences where
    JAX 0.10.2's rule is not the derivative of its own forward (docs/jax.md):

    - input slices that overlap (a row sent to two peers): its gradient is the sum of both
      cotangents; JAX's transpose writes them into a zero buffer, the last one wins;
    - the output cotangent: exactly the received rows are zeroed; JAX builds the mask from
      a cumulative sum of +1 set at slice starts (duplicates collapse) and -1 added at slice
      ends (duplicates add up), which is wrong wherever an empty slice lies inside the output
      at the start of another slice or at another empty slice's offset (packed offsets with
      an expert that receives no tokens); only empty slices at offset ``M`` are safe.

    Checked mode: the result varies over the axis and over whatever ``operand`` and
    ``output`` vary over (an invariant one gets the implicit ``pvary`` first); JAX 0.10.2
    gives it ``output``'s type, invariant for an invariant ``output``, though the values
    differ per rank, and then fails to differentiate it.

    Args:
      operand: ``(N, ...)`` rows to send from.
      output: ``(M, ...)``, same dtype and row shape: the values of rows nothing is
        written to.
      input_offsets, send_sizes: ``(K,)`` integers: slice ``i`` of ``operand`` goes to
        axis index ``i // (K // n)``.
      output_offsets: ``(K,)``: where slice ``i`` is written on its receiver.
      recv_sizes: ``(K,)``: the size of the slice received from axis index ``j // (K // n)``.
      axis_name: a mesh axis or a tuple of axes (row-major over the tuple).

    Returns:
      ``(M, ...)``: ``output`` with the received slices written in. Differentiable in
      ``operand`` and ``output`` (the transpose is above).

    Raises:
      ValueError: (on every rank, before any data moves) a vector that is not 1-D of one
        length ``K`` divisible by ``n``; operand and output of different dtypes or row
        shapes; a slice outside the operand; a send size that differs from its receiver's
        recv size; received slices outside the output or overlapping there. The axis, the
        ranks, the slice indices and the sizes are named.
    """
    body, ax = _axes("ragged_all_to_all", axis_name)
    vectors = (input_offsets, send_sizes, output_offsets, recv_sizes)
    k = _ragged.check_arrays(ax, operand, output, vectors)
    names = frozenset(ax.names)
    token, wtoken = _IN_LAX.set(True), _contract.WHAT.set("ragged_all_to_all")
    try:
        if body.check:
            operand, output = (_make_varying(t, ax, names) for t in (operand, output))
        # Each rank's four vectors and its operand's and output's row counts (they may differ
        # per rank in eager code: a receiver's output is sized by what it receives).
        rows = simulation.per_rank(_ragged.row_counts)(operand, output, input_offsets.device)
        plan = torch.cat([v.reshape(k).to(torch.int64) for v in vectors] + [rows])  # (4K + 2,)
        every = plan.unsqueeze(0) if ax.n == 1 else _gather_raw(plan, ax, 0, False)  # (n, 4K + 2)
        table, sizes = simulation.per_rank(_ragged.host)(every, k)  # the same on every rank of a group
        simulation.per_rank(_ragged.check_plan)(ax, table, sizes)
        out = _ragged_exchange(operand, output, table, ax)
    finally:
        _contract.WHAT.reset(wtoken)
        _IN_LAX.reset(token)
    if body.check:
        set_vma(out, vma(operand) | vma(output) | names)
    return out


def _ragged_planned(operand: torch.Tensor, output: torch.Tensor, table: Any, axis_name: str | Sequence[str]):
    """:func:`ragged_all_to_all` for a caller that holds the whole plan already:
    ``table[u] = [input_offsets, send_sizes, output_offsets, recv_sizes]`` of axis index ``u``
    (an int64 ``(n, 4, K)`` tensor, or host ints), the same on every rank of the group and
    valid by construction (the dropless MoE derives it from counts every rank has gathered).
    No plan all_gather and no checks: one exchange."""
    body, ax = _axes("ragged_all_to_all", axis_name)
    names = frozenset(ax.names)
    token, wtoken = _IN_LAX.set(True), _contract.WHAT.set("ragged_all_to_all")
    try:
        if body.check:
            operand, output = (_make_varying(t, ax, names) for t in (operand, output))
        out = _ragged_exchange(operand, output, table, ax)
    finally:
        _contract.WHAT.reset(wtoken)
        _IN_LAX.reset(token)
    if body.check:
        set_vma(out, vma(operand) | vma(output) | names)
    return out


def _ragged_exchange(operand: torch.Tensor, output: torch.Tensor, table: Any, ax: _Axes) -> torch.Tensor:
    """The data path of a checked plan: the rows sent (peer order) -> the exchange -> ``output``."""
    order = ax.u_of_g or tuple(range(ax.n))  # the axis index of each group rank
    dev = operand.device
    send_rows = simulation.per_rank(_ragged.rows)(table, ax.me, order, True, dev)
    recv_rows = simulation.per_rank(_ragged.rows)(table, ax.me, order, False, dev)
    sent = operand.index_select(0, send_rows)
    if ax.n > 1:
        send = simulation.per_rank(_ragged.splits)(table, ax.me, order, True)
        recv = simulation.per_rank(_ragged.splits)(table, ax.me, order, False)
        sent = _apply(_AllToAllV, sent, ax, send, recv)
    return output.index_copy(0, recv_rows, sent)

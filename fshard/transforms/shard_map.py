"""``shard_map``: run a per-device function on every rank of a mesh.

Inputs are global values (DTensors, or plain tensors taken as the global value); the
body sees this rank's local blocks as plain torch tensors and may call
:mod:`fshard.lax` collectives over the mesh's axes; its outputs are local blocks that
are put back together as DTensors according to ``out_specs``.

An output spec that leaves out a mesh axis promises that the output is the same on
every rank along that axis. With ``check=True`` (the default, as JAX's
``check_vma``) fshard tracks which axes each value varies over: a promise that the
types already prove costs nothing; otherwise it is verified at run time (a max/min
all-reduce) and a broken promise raises naming the output path and the largest
difference. Checked mode also inserts the implicit ``pvary`` that makes gradients of
replicated inputs correct (see :mod:`fshard.transforms.vma`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fshard import comm, lax
from fshard import meta as meta_util
from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh, get_mesh
from fshard.mesh.placement import (
    block_shape,
    placements_to_spec,
    raise_spec_errors,
    spec_problems,
    spec_to_placements,
    take_block,
)
from fshard.mesh.sharding import make_dtensor
from fshard.mesh.spec import PartitionSpec, is_spec
from fshard.transforms.vma import VmaMode, storage_address

__all__ = ["shard_map"]


def shard_map(
    f: Callable[..., Any],
    *,
    mesh: Mesh | None = None,
    in_specs: Any,
    out_specs: Any,
    check: bool = True,
    reshard: bool = False,
) -> Callable[..., Any]:
    """Maps ``f`` over the blocks of its inputs on every rank of ``mesh``.

    Args:
      f: the per-device function. Takes local tensors (pytrees allowed), returns local
        tensors; may call ``fs.lax`` collectives over ``mesh``'s axes.
      mesh: the mesh (default: the current mesh at call time).
      in_specs: a pytree prefix of the positional arguments tuple (a single ``P``
        applies to every argument). Non-tensor leaves are passed through as static
        values; ``None`` marks a static argument. Keyword arguments are passed through unchanged (tensors in them are
        taken as replicated).
      out_specs: a pytree prefix of ``f``'s result (``None`` for non-tensor parts,
        which are returned as they are).
      check: track varying axes, insert implicit ``pvary``, and verify replication
        promises of ``out_specs`` (JAX's ``check_vma``). ``False`` is Megatron style:
        no per-op cost, and you place ``fs.lax.pvary`` yourself.
      reshard: redistribute DTensor arguments whose layout differs from ``in_specs``
        instead of raising.

    Returns:
      The mapped function: same arguments as ``f`` with global values; returns
      DTensors laid out by ``out_specs``.

    Raises:
      ValueError: specs are not pytree prefixes of the arguments/results (both
        structures shown), a spec does not fit its argument, a DTensor's layout
        differs from its spec (without ``reshard``), or an output breaks its
        replication promise (path and max difference named).
    """
    name = getattr(f, "__name__", "f")

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        m = get_mesh(mesh, what=f"shard_map({name})")
        body = lax.Body(m, check)
        locals_ = _enter(name, body, args, in_specs, reshard)
        token = lax.BODY.set(body)
        try:
            with m:
                if check:
                    with VmaMode():
                        out = f(*locals_, **kwargs)
                else:
                    out = f(*locals_, **kwargs)
        finally:
            lax.BODY.reset(token)
        return _exit(name, body, out, out_specs)

    return mapped


def _enter(name: str, body: lax.Body, args: tuple, in_specs: Any, reshard: bool) -> list[Any]:
    mesh = body.mesh
    specs = in_specs if not is_spec(in_specs) else tuple(in_specs for _ in args)
    values, treedef = tree_util.tree_flatten(list(args))
    flat = tree_util.broadcast_prefix(
        list(specs) if isinstance(specs, tuple) else specs,
        list(args),
        is_prefix_leaf=_is_spec_or_static,
        name=f"shard_map({name}) in_specs",
        full_name="args",
    )
    # DTensors already in their spec's layout (the usual case: params made by fs.shard)
    # need no check, and become their local blocks through one autograd node.
    direct = [
        i for i, (x, spec) in enumerate(zip(values, flat)) if isinstance(x, DTensor) and _in_layout(x, spec, mesh)
    ]
    skip, bad = set(direct), []
    paths: list[str] = []

    def path_of(i: int) -> str:  # names for the error messages, made only when one is needed
        if not paths:
            paths.extend(
                f"args[{p.split('.', 1)[0]}]" + (f".{p.split('.', 1)[1]}" if "." in p else "")
                for p in tree_util.zip_with_path(list(args))[0]
            )
        return paths[i]

    for i, (x, spec) in enumerate(zip(values, flat)):
        if i in skip or not isinstance(x, torch.Tensor):
            continue
        if isinstance(x, DTensor):
            have = placements_to_spec(x.placements, mesh, path=path_of(i))
            if have.padded(x.dim()) != spec.padded(x.dim()) and not reshard and not _same_layout(x, spec, mesh):
                bad.append(
                    (
                        path_of(i),
                        spec,
                        tuple(x.shape),
                        [f"the DTensor is laid out as {have}; pass reshard=True to redistribute it"],
                    )
                )
        # A DTensor knows its own (possibly uneven, FSDP-style) layout; plain tensors must divide.
        probs = (
            spec_problems(spec, tuple(x.shape), mesh, allow_uneven=isinstance(x, DTensor))
            if spec is not None
            else ["a tensor argument needs a P(...) spec; None marks static (non-tensor) arguments"]
        )
        if probs:
            bad.append((path_of(i), spec, tuple(x.shape), probs))
    raise_spec_errors(
        f"shard_map({name}) in_specs",
        mesh,
        bad,
        "Make each spec match its argument (specs are pytree prefixes of the arguments).",
    )
    locals_ = dict(zip(direct, _Locals.apply(*(values[i] for i in direct)))) if direct else {}
    out = []
    for i, (x, spec) in enumerate(zip(values, flat)):
        if isinstance(x, torch.Tensor):
            local = locals_[i] if i in locals_ else _to_local(x, spec, mesh)
            meta_util.register_input(body, local, meta_util.Meta(frozenset(spec.axes()), tuple(x.shape), spec))
            out.append(local)
        else:
            out.append(x)
    return tree_util.tree_unflatten(treedef, out)


def _in_layout(x: DTensor, spec: Any, mesh: Mesh) -> bool:
    """Whether ``x``'s placements are exactly ``spec``'s (kinds compared: a strided shard
    never stands for a plain one)."""
    if not is_spec(spec):
        return False
    try:
        want = spec_to_placements(spec, mesh)
    except (ValueError, IndexError):
        return False  # the checks explain what is wrong with the spec
    return len(want) == len(x.placements) and all(type(a) is type(b) and a == b for a, b in zip(want, x.placements))


def _same_layout(x: DTensor, spec: Any, mesh: Mesh) -> bool:
    """Whether ``spec`` gives ``x``'s placements: specs that differ only in where a size-1
    axis sits (``P(("tp", "fsdp"))`` vs ``P(("fsdp", "tp"))`` with tp=1) are one layout."""
    try:
        want = spec_to_placements(spec, mesh)
    except ValueError:
        return False  # spec_problems explains what is wrong with the spec
    return all(type(a) is type(b) and a == b for a, b in zip(want, x.placements))


def set_global_shape(local: torch.Tensor, shape: tuple[int, ...], spec: PartitionSpec | None = None) -> None:
    """Records the global shape and spec of a local block (FSDP needs them for uneven
    shards), keeping its varying axes; the pipeline executor uses it for stage params."""
    m = meta_util.meta_of(local)
    meta_util.set_meta(local, meta_util.Meta(m.vma, tuple(shape), spec))


def input_spec(local: torch.Tensor) -> PartitionSpec | None:
    """The in_spec of a shard_map input's local block (or an alias of it), if it is one."""
    return meta_util.meta_of(local).spec


def global_shape(local: torch.Tensor) -> tuple[int, ...] | None:
    """The global shape of a shard_map input's local block (or an alias of it), if it is one."""
    return meta_util.meta_of(local).global_shape


def _is_spec_or_static(x: Any) -> bool:
    return x is None or is_spec(x)


class _Locals(torch.autograd.Function):
    """DTensors -> their local blocks (``to_local()`` of each), as one autograd node.

    Backward gives each local cotangent its primal's layout, as ``to_local``'s backward
    does, but shares the primal's spec instead of building a DTensorSpec and a
    ``from_local`` node per leaf: host work per leaf and step, which bounds a small model's
    step on a GPU (``bench/README.md``, "Host costs behind the code").
    """

    @staticmethod
    def forward(ctx, *xs):
        ctx.specs = [x._spec for x in xs]
        ctx.set_materialize_grads(False)
        # Fresh tensor objects: autograd's metadata is set on them, not on the DTensors' locals.
        out = tuple(x._local_tensor.view_as(x._local_tensor) for x in xs)
        # What did not require grad (buffers, data) stays so, as with to_local().
        ctx.mark_non_differentiable(*(o for o, x in zip(out, xs) if not x.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads):
        return tuple(None if g is None else _as_dtensor(g, spec) for g, spec in zip(grads, ctx.specs))


def _as_dtensor(g: torch.Tensor, spec) -> DTensor:
    """The local cotangent ``g`` as a DTensor laid out by ``spec`` (its primal's)."""
    meta = spec.tensor_meta
    differentiable = g.requires_grad and torch.is_grad_enabled()  # a create_graph backward (grad of grad)
    if (
        not differentiable
        and meta is not None
        and g.dtype == meta.dtype
        and g.is_contiguous()
        and meta.stride == _contiguous(meta.shape)
    ):
        return DTensor(g, spec, requires_grad=False)
    # A non-contiguous primal or cotangent, or one that must stay differentiable: torch's own
    # rule (global stride from the local one), through from_local's autograd node.
    from torch.distributed.tensor._utils import compute_global_tensor_info

    _, stride = compute_global_tensor_info(g, spec.mesh, spec.placements)
    return DTensor.from_local(g, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=tuple(stride))


def _contiguous(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _to_local(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    placements = spec_to_placements(spec, mesh)
    if isinstance(x, DTensor):
        if not _in_layout(x, spec, mesh):
            x = x.redistribute(mesh.device_mesh, placements)
        # to_local's backward turns the local grad into a grad with the same layout.
        return x.to_local()
    if x.requires_grad:
        # Differentiable route: the gradient w.r.t. a plain global tensor is the full,
        # gathered gradient on every rank (Shard -> Replicate in backward).
        rep = DTensor.from_local(x, mesh.device_mesh, [Replicate()] * len(mesh.axis_names), run_check=False)
        return rep.redistribute(mesh.device_mesh, placements).to_local()
    return take_block(x, spec, mesh, device=mesh.device)


class _SplitCotangent(torch.autograd.Function):
    """Identity forward; divides the cotangent by n in backward.

    For an output typed as varying over axes that its spec promises are invariant (and
    that the run-time check found identical): the global value is any one copy, so each
    of the n identical copies receives 1/n of the cotangent.
    """

    @staticmethod
    def forward(x, n):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g / ctx.n, None


def _exit(name: str, body: lax.Body, out: Any, out_specs: Any) -> Any:
    mesh, check = body.mesh, body.check
    paths, values, treedef = tree_util.zip_with_path(out)
    flat = tree_util.broadcast_prefix(
        out_specs, out, is_prefix_leaf=_is_spec_or_static, name=f"shard_map({name}) out_specs", full_name="outputs"
    )
    bad = []
    for path, x, spec in zip(paths, values, flat):
        if isinstance(x, torch.Tensor):
            probs = (
                spec_problems(spec, tuple(x.shape), mesh, allow_uneven=True)
                if spec is not None
                else ["a tensor output needs a P(...) spec; None marks static (non-tensor) outputs"]
            )
            if probs:
                bad.append((f"outputs.{path}" if path != "<root>" else "output", spec, tuple(x.shape), probs))
    raise_spec_errors(
        f"shard_map({name}) out_specs", mesh, bad, "Give each output a spec of at most its rank over the mesh's axes."
    )
    result = []
    for path, x, spec in zip(paths, values, flat):
        if not isinstance(x, torch.Tensor):
            result.append(x)
            continue
        if check:
            x = _vary_over_spec(body, x, spec)
            x = _check_promise(name, body, path, x, spec)
        result.append(make_dtensor(x, spec, mesh, _global_shape(body, x, spec)))
    return tree_util.tree_unflatten(treedef, result)


def _global_shape(body: lax.Body, x: torch.Tensor, spec: PartitionSpec) -> tuple[int, ...]:
    """An output's global shape: that of its metadata when it has the output's layout (an
    input, an alias of one, or a gradient from ``fs.value_and_grad``, or in checked mode
    from ``torch.autograd.grad`` and ``.grad``), so uneven FSDP shards come back whole;
    otherwise the local shape times the axis sizes (even splits, as JAX requires)."""
    m = meta_util.meta_of(x)
    if (
        m.global_shape is not None
        and m.spec is not None
        and len(m.global_shape) == x.dim()
        and m.spec.padded(x.dim()) == spec.padded(x.dim())
        and block_shape(spec, m.global_shape, body.mesh, uneven=True) == tuple(x.shape)
    ):
        return m.global_shape
    return tuple(s * (body.mesh.axis_size(spec.dim_axes(d)) if spec.dim_axes(d) else 1) for d, s in enumerate(x.shape))


def _vary_over_spec(body: lax.Body, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """An output whose spec splits it over axes its type is invariant over: its global value
    holds one copy per rank of those axes, so (JAX's implicit pvary at the boundary) the
    gradient of the copies is summed there."""
    if not x.requires_grad:
        return x
    vma, mesh = lax.vma(x), body.mesh
    missing = tuple(a for a in spec.axes() if a not in vma and mesh.shape[a] > 1)
    if not missing:
        return x
    token = lax.BODY.set(body)
    try:
        return lax.pvary(x, missing)
    finally:
        lax.BODY.reset(token)


def _unproven_axes(body: lax.Body, x: torch.Tensor) -> tuple[frozenset, frozenset]:
    """The axes over which ``x``'s type does not prove it replicated, in two sets:
    ``(varying, escaped)``. ``varying``: those it varies over, and those its memory was
    written with in place by varying values; its copies are then distinct values, each owed
    1/n of the cotangent. ``escaped``: those of any varying value the body turned into a
    Python object (see :mod:`fshard.transforms.vma`): Python could have made ``x`` differ,
    but if the run-time check finds it identical its type is right, cotangent included (a
    psum's result keeps the whole cotangent)."""
    axes = lax.vma(x)
    if body.written:
        key = storage_address(x)
        held = body.written.get(key) if key else None
        axes = axes | held[1] if held else axes
    escaped = frozenset().union(*body.escaped) if body.escaped else frozenset()
    return axes, escaped - axes


def _check_promise(name: str, body: lax.Body, path: str, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    mesh = body.mesh
    varying, escaped = _unproven_axes(body, x)
    extra = tuple(a for a in mesh.axis_names if a in varying | escaped and a not in spec.axes())
    if not extra:
        return x  # the types prove the promise
    group = mesh.group(extra)
    n = mesh.axis_size(extra)
    if n == 1:
        return x
    split = tuple(a for a in extra if a in varying)
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(x) is not None:
        where = "output" if path == "<root>" else f"outputs.{path}"
        raise ValueError(
            f"shard_map({name}) out_specs: {where} has spec {spec}, which promises the value is the same on "
            f"every rank of axes {extra} of {mesh!r}; its type does not prove it (it varies over {extra}, as "
            f"an all_gather's result does: JAX types it varying too), so check=True would verify it at run "
            f"time by reading the values, which cannot be traced (fs.jit). Make it invariant (fs.lax.psum / "
            f"pmean over {extra}), name the axes in its out_spec, or pass check=False to this shard_map "
            f"(the promise is then yours)."
        )
    with torch.no_grad():
        # Plain c10d calls: a verification, not part of the program, so comm_log skips them.
        d = x.detach()
        hi = (d.float() if not d.is_floating_point() else d).clone()
        lo = hi.clone()
        comm.one_at_a_time(group)  # nothing of fshard's may still be in flight on a gloo group
        dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
        diff_t = (
            torch.nan_to_num((hi - lo).abs().amax().reshape(1), nan=float("inf"))
            if d.numel()
            else torch.zeros(1, dtype=hi.dtype, device=hi.device)
        )
        rest = tuple(a for a in mesh.axis_names if a not in extra and mesh.shape[a] > 1)
        if rest:
            # Every rank decides alike: a promise broken in one group of `extra` (and kept in
            # another) must raise on all of them, not leave the others waiting in their next
            # collective for ranks that raised.
            comm.one_at_a_time(mesh.group(rest))  # as above: nothing of fshard's in flight on it
            dist.all_reduce(diff_t, dist.ReduceOp.MAX, group=mesh.group(rest))
        diff = float(diff_t)
    if diff != 0.0:
        where = "output" if path == "<root>" else f"outputs.{path}"
        raise ValueError(
            f"shard_map({name}) out_specs: {where} has spec {spec}, which promises the value is the "
            f"same on every rank of axes {extra} of {mesh!r}, but it differs across them "
            f"(max difference {diff:.6g}). Reduce it (fs.lax.psum / pmean over {extra}), or "
            f"name the axes in its out_spec."
        )
    n_split = mesh.axis_size(split) if split else 1
    return _SplitCotangent.apply(x, n_split) if x.requires_grad and n_split > 1 else x

"""``scan_layers``: the FSDP / HSDP / DDP layer loop, inside a shard_map body.

For layer i: all-gather its parameters (with the next ``prefetch`` layers' gathers
already in flight), run ``block_fn``, and, with ``reshard_after_forward``, let the
gathered parameters go: autograd's saved tensors keep only a token for them (through
``saved_tensors_hooks``) and backward gathers them again when it unpacks the first
one, starting the previous layer's gather at the same time (BACKWARD_PRE-style
prefetch). The layer is never recomputed unless ``remat`` asks for it. Each layer's
gradients are reduced as soon as they exist, asynchronously, and waited at the end of
backward (see :mod:`fshard.parallel.groups`).

Communication per step and layer: with reshard, 2 all-gathers and 1 reduce-scatter;
without, 1 and 1; replicate (no shard axis): 1 all-reduce and no all-gather; HSDP: a
reduce-scatter over the shard axis and an all-reduce over the replicate axis.

``reshard_after_forward`` may also name a smaller group to stay sharded over between
forward and backward (FSDP2's int ``reshard_after_forward``): with
``axis=("fsdp_out", "fsdp_in")`` and ``reshard_after_forward="fsdp_in"`` each rank keeps
a ``1/k`` slice of the gathered layer (``k = mesh.shape["fsdp_in"]``), and backward's
regather is one all-gather over ``"fsdp_in"`` only (e.g. within a node).

``offload=True`` keeps the shards (hence the optimizer state) on the CPU and copies each
layer's flat shard buffer to the mesh's device just before its all-gather.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from fshard import lax
from fshard import tree as tree_util
from fshard._deprecated import config_from_keywords
from fshard.parallel.groups import Gather, Groups, Sink, saved_as_tokens
from fshard.parallel.scan_config import DEFAULT, ScanConfig
from fshard.transforms.policy import Policy
from fshard.transforms.remat import remat as remat_fn
from fshard.transforms.remat import saves_gathers

__all__ = ["scan_layers", "gather_params", "fsdp_loop", "offload_shards", "ScanConfig"]

_NO_POLICY = Policy()


def _as_axes(axis: str | Sequence[str] | None) -> tuple[str, ...]:
    if axis is None:
        return ()
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _shard_dims(leaves: Sequence[torch.Tensor], axes: tuple[str, ...], dim: int | None) -> list[int]:
    if not axes:
        return [0] * len(leaves)
    if dim is not None:
        return [dim if x.dim() else 0 for x in leaves]
    # Default: the dim whose spec names a gathered axis (FSDP rules put it on one dim), else 0.
    from fshard.transforms.shard_map import input_spec

    dims = []
    for x in leaves:
        spec = input_spec(x)
        hits = [d for d in range(x.dim()) if spec is not None and set(spec.dim_axes(d)) & set(axes)]
        dims.append(hits[0] if hits else 0)
    return dims


def _refuse_functorch(what: str, leaves: Sequence[Any]) -> None:
    """The group machinery reduces gradients as side effects of autograd's backward (async
    collectives started by one node and collected by another), which torch.func's
    functional transforms cannot carry: say so instead of failing deep inside backward."""
    if any(isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in leaves):
        raise RuntimeError(
            f"fs.parallel.{what} was called under a torch.func transform (grad, vjp, vmap, ...). Its "
            f"gathers and gradient reductions run through torch.autograd: differentiate with "
            f"fs.value_and_grad / fs.grad (inside or outside the shard_map body) or torch.autograd.grad."
        )


def _check_same_structure(layer_params: Sequence[Any]) -> None:
    first = tree_util.structure(layer_params[0])
    for i, p in enumerate(layer_params[1:], start=1):
        s = tree_util.structure(p)
        if s != first:
            raise ValueError(
                f"scan_layers: layer {i} has structure {s} but layer 0 has {first}; every layer "
                f"in one loop must have the same pytree structure."
            )


def _post_forward_axes(raf: Any, shard_axes: tuple[str, ...], mesh: Any, remat: bool) -> tuple[bool, tuple[str, ...]]:
    """Resolves ``reshard_after_forward`` to ``(reshard, post_axes)``.

    ``reshard`` False: keep the gathered parameters for backward (no regather).
    ``reshard`` True with ``post_axes == ()``: free them; backward regathers from the
    shards over all of ``shard_axes``. With ``post_axes``: keep a ``1/k`` slice, ``k`` the
    size of ``post_axes``; backward regathers over ``post_axes`` only.

    An int ``k`` names the trailing (minor) axes of ``shard_axes`` whose sizes multiply to
    ``k``: on the usual rank layout those are the ranks of one node. As in FSDP2, ``1``
    means ``False`` (a group of one keeps everything; warned, since ``True`` was probably
    meant) and the full size means ``True``. Axis names may be any of ``shard_axes``;
    naming all of them means ``True``.

    Raises:
      TypeError: not a bool, int, axis name or tuple of axis names.
      ValueError: an int that is no product of trailing axes (with the valid values and,
        on one axis, how to split it), an axis not in ``axis``, or a partial reshard
        together with ``remat``.
    """
    if isinstance(raf, bool):
        return raf, ()
    sizes = {a: mesh.shape[a] for a in shard_axes}
    full = math.prod(sizes.values())
    if isinstance(raf, int):
        # Trailing sub-tuples, shortest first: the smallest group of minor axes of size k.
        trailing = {}
        for j in range(len(shard_axes) - 1, -1, -1):
            trailing.setdefault(math.prod(sizes[a] for a in shard_axes[j:]), shard_axes[j:])
        if raf == 1:
            warnings.warn(
                "scan_layers: reshard_after_forward=1 (int) reshards to groups of 1 rank, i.e. keeps the "
                "gathered parameters for backward, the same as reshard_after_forward=False; pass "
                "True to free them after forward.",
                stacklevel=3,
            )
            return False, ()
        if raf == full and shard_axes:
            return True, ()
        if raf in trailing:
            post = trailing[raf]
        else:
            raise ValueError(_bad_int_message(raf, shard_axes, sizes, trailing))
    elif isinstance(raf, str) or (isinstance(raf, (tuple, list)) and raf and all(isinstance(a, str) for a in raf)):
        names = (raf,) if isinstance(raf, str) else tuple(raf)
        unknown = [a for a in names if a not in shard_axes]
        if unknown or len(set(names)) != len(names):
            hint = (
                f"e.g. reshard_after_forward={shard_axes[-1]!r}"
                if shard_axes
                else "but with no shard axis (axis=None) nothing is gathered: use False"
            )
            raise ValueError(
                f"scan_layers: reshard_after_forward={raf!r} names {unknown or list(names)!r}, but the "
                f"parameters are sharded over axis={shard_axes!r} (sizes {sizes}); the post-forward "
                f"group must be made of those axes, each once ({hint})."
            )
        if set(names) == set(shard_axes):
            return True, ()
        post = tuple(a for a in shard_axes if a in names)  # the order of ``axis``
    else:
        raise TypeError(
            f"scan_layers: reshard_after_forward={raf!r} ({type(raf).__name__}); use True, False, an int "
            f"(the size of the group to stay sharded over) or a mesh axis name from axis={shard_axes!r}."
        )
    k = math.prod(sizes[a] for a in post)
    if k == 1:  # size-1 axes: a group of one rank keeps everything
        return False, ()
    if remat:
        raise ValueError(
            f"scan_layers: reshard_after_forward={raf!r} with remat=True: remat recomputes each layer "
            f"in backward with its full gather over {shard_axes!r}, so nothing is kept between forward "
            f"and backward and a partial reshard over {post!r} would have no effect. Use "
            f"reshard_after_forward=True with remat."
        )
    return True, post


def _bad_int_message(
    raf: int, shard_axes: tuple[str, ...], sizes: dict[str, int], trailing: dict[int, tuple[str, ...]]
) -> str:
    head = f"scan_layers: reshard_after_forward={raf!r}"
    if not shard_axes:
        return (
            f"{head}, but there is no shard axis (axis=None): nothing is gathered, so nothing can be "
            f"resharded. Use False."
        )
    full = math.prod(sizes.values())
    if len(shard_axes) == 1:
        ((a, n),) = sizes.items()
        example = (
            f"make_mesh({{'{a}_out': {n // raf}, '{a}_in': {raf}}}), shard over "
            f"axis=('{a}_out', '{a}_in') (fsdp_specs(params, ('{a}_out', '{a}_in'))) and pass "
            f"reshard_after_forward='{a}_in' (or {raf})"
            if raf > 1 and n % raf == 0
            else f"make_mesh({{'{a}_out': {n} // k, '{a}_in': k}}) for a k that divides {n}, shard over "
            f"axis=('{a}_out', '{a}_in') and pass reshard_after_forward='{a}_in'"
        )
        return (
            f"{head} with axis={a!r} of size {n}: the group to stay sharded over after forward must "
            f"be a mesh axis, and one axis only allows 1 (= False) or {n} (= True). Split the axis "
            f"in two: {example}."
        )
    valid = ", ".join(f"{k} ({'= True' if k == full else repr(t)})" for k, t in sorted(trailing.items()) if k > 1)
    return (
        f"{head} is not the size of a trailing group of axis={shard_axes!r} (sizes {sizes}): an int k "
        f"keeps the parameters sharded over the last axes of `axis` whose sizes multiply to k. Valid: "
        f"1 (= False), {valid}; or name the axes, e.g. reshard_after_forward={shard_axes[-1]!r}."
    )


def scan_layers(
    block_fn: Callable[[Any, Any], Any],
    layer_params: Sequence[Any],
    x: Any,
    *,
    axis: str | Sequence[str] | None = "fsdp",
    replicate_axis: str | Sequence[str] | None = None,
    config: ScanConfig | None = None,
    accumulate: Any = None,
    sync: bool | str = True,
    **deprecated: Any,
) -> Any:
    """Runs ``x = block_fn(layer_params[i], x)`` for every layer with FSDP-style gathering.

    Call it inside a shard_map body; ``layer_params`` are the local shards (their spec
    over ``axis`` from :func:`fshard.parallel.fsdp_specs`).

    Args:
      block_fn: ``(full_layer_params, x) -> x``, the per-layer computation.
      layer_params: a list of per-layer pytrees of local shards, all the same structure.
      x: the activation (any pytree) fed to the first layer.
      axis: mesh axis (or axes) the parameters are sharded over; ``None`` for pure
        replication (DDP).
      replicate_axis: mesh axis (or axes) over which parameters are replicated and
        gradients all-reduced (DDP, or HSDP together with ``axis``).
      config: the loop's options, a :class:`~fshard.parallel.ScanConfig` (default
        ``ScanConfig()``): prefetch, reshard_after_forward, remat and remat_policy, policy
        (mixed precision), dim, forward_prefetch, backward_prefetch, bucket_bytes, offload.
        Build it once, outside the step. Those options as keywords of ``scan_layers``
        (``scan_layers(..., remat=True)``) still work for this release, with a
        ``DeprecationWarning``: pass ``config=ScanConfig(remat=True)``.
      accumulate: a :class:`~fshard.parallel.GradAccumulator` for gradient accumulation.
      sync: with ``accumulate``, ``False`` skips the reduction and keeps the unreduced
        gradient in the accumulator (the returned shard grads are zeros); ``True`` adds
        the accumulated gradients and reduces once; ``"reduce_scatter"`` (HSDP)
        reduce-scatters over ``axis`` every microbatch but defers the all-reduce over
        ``replicate_axis`` to the ``True`` microbatch.

    Returns:
      The output of the last layer.

    Raises:
      ValueError: layers differ in structure; a ``reshard_after_forward`` that names no
        sub-group of ``axis`` (the message lists the valid values and the remedy) or a
        partial one with ``remat``; ``offload=True`` with shards not on the CPU, or CPU
        shards on a GPU mesh without ``offload``.
      TypeError: an old option keyword together with ``config`` (both are named), or an
        unknown keyword; an option of the wrong type (from :class:`ScanConfig`).
      RuntimeError: called outside a shard_map body.
    """
    if deprecated:
        config = config_from_keywords("scan_layers", ScanConfig, config, deprecated)
    elif config is None:
        config = DEFAULT
    if len(layer_params) == 0:
        return x
    # Read once: the names below are the options' (and tools/mutations.py's snippets').
    prefetch, reshard_after_forward, remat, remat_policy = (
        config.prefetch,
        config.reshard_after_forward,
        config.remat,
        config.remat_policy,
    )
    forward_prefetch, backward_prefetch = config.forward_prefetch, config.backward_prefetch
    body = lax.BODY.get()
    if body is None:
        raise RuntimeError("fs.parallel layer loops run inside a shard_map body (they issue collectives).")
    shard_axes, rep_axes = _as_axes(axis), _as_axes(replicate_axis)
    body.mesh.check_axes(shard_axes, what="axis")
    reshard, post_axes = _post_forward_axes(reshard_after_forward, shard_axes, body.mesh, remat)
    _check_same_structure(layer_params)
    flat_layers, defs = [], []
    for p in layer_params:
        leaves, d = tree_util.tree_flatten(p)
        flat_layers.append(leaves)
        defs.append(d)
    _refuse_functorch("scan_layers", [x for ls in flat_layers for x in ls] + tree_util.leaves(x))
    # The partial slice is only worth keeping when the layer is resharded at all.
    keep_axes = post_axes if reshard and not remat else ()
    state = Groups(
        flat_layers,
        shard_axes,
        rep_axes,
        [_shard_dims(ls, shard_axes, config.dim) for ls in flat_layers],
        config.policy or _NO_POLICY,
        config.bucket_bytes,
        accumulate,
        sync,
        post_axes=keep_axes,
        offload=config.offload,
    )
    n_layers = len(flat_layers)
    all_leaves = [x for ls in flat_layers for x in ls]
    sunk = (
        Sink.apply(state, *all_leaves)
        if torch.is_grad_enabled() and any(t.requires_grad for t in all_leaves)
        else tuple(all_leaves)
    )
    sunk_layers, k = [], 0
    for ls in flat_layers:
        sunk_layers.append(list(sunk[k : k + len(ls)]))
        k += len(ls)
    fwd = forward_prefetch or [[j for j in range(i + 1, min(n_layers, i + 1 + prefetch))] for i in range(n_layers)]
    bwd = backward_prefetch or [[i - 1] if i > 0 else [] for i in range(n_layers)]
    tags = frozenset(shard_axes) | frozenset(rep_axes)

    reshard = reshard and state.n > 1 and not remat

    def block(i: int, full: list[torch.Tensor], h: Any) -> Any:
        return block_fn(tree_util.tree_unflatten(defs[i], full), h)

    def layer(i: int, leaves: list[torch.Tensor], h: Any) -> Any:
        full = _gather(state, i, leaves, tags)
        if not reshard:
            return block(i, full, h)
        with _reshard_hooks(state, i, bwd[i], full):
            return block(i, full, h)

    # A policy that saves collectives' results keeps the gathered parameters for backward:
    # the gather then runs before the checkpointed region (its result is the region's saved
    # input) and only the block is recomputed. Gathering inside the region instead would
    # wait there on a gather started outside it, which selective checkpointing cannot replay.
    gather_outside = remat and saves_gathers(remat_policy)

    for i in range(n_layers):
        state.start_gather(i)
        for j in fwd[i]:
            state.start_gather(j)
        if gather_outside:
            full = _gather(state, i, sunk_layers[i], tags)
            x = remat_fn(lambda full, h, i=i: block(i, full, h), policy=remat_policy)(full, x)
        elif remat:
            x = remat_fn(lambda leaves, h, i=i: layer(i, leaves, h), policy=remat_policy)(sunk_layers[i], x)
        else:
            x = layer(i, sunk_layers[i], x)
    return x


fsdp_loop = scan_layers


def _gather(state: Groups, i: int, leaves: list[torch.Tensor], tags: frozenset) -> list[torch.Tensor]:
    if any(t.requires_grad for t in leaves) and torch.is_grad_enabled():
        token = lax._IN_LAX.set(True)  # checked mode: our own typing below, no implicit pvary
        try:
            full = list(Gather.apply(state, i, *leaves))
        finally:
            lax._IN_LAX.reset(token)
    else:
        full = state.gathered(i)
    body = lax.BODY.get()
    if body is not None and body.check:
        # Gathered parameters are typed as varying over the shard and replicate axes: the
        # gather's backward already does the reductions an implicit pvary would add.
        for f, leaf in zip(full, leaves):
            lax.set_vma(f, lax.vma(leaf) | tags)
    return full


def _reshard_hooks(state: Groups, i: int, prefetch: Sequence[int], full: list[torch.Tensor]):
    """Saved tensors that live in group i's gathered storage become tokens; backward regathers."""
    return saved_as_tokens(full, lambda: state.regathered(i, prefetch))


def gather_params(
    params: Any,
    *,
    axis: str | Sequence[str] | None = "fsdp",
    replicate_axis: str | Sequence[str] | None = None,
    policy: Policy | None = None,
    dim: int | None = None,
    accumulate: Any = None,
    sync: bool | str = True,
    offload: bool = False,
) -> Any:
    """Gathers one group of parameters (e.g. embeddings + head) for use in a shard_map body.

    One all-gather in forward, one reduce-scatter (plus an all-reduce over
    ``replicate_axis``) in backward, waited at the end of backward. The result is kept
    for backward (no reshard): use it for the root group.

    Args:
      params: pytree of local shards.
      axis, replicate_axis, policy, dim, accumulate, sync, offload: as in :func:`scan_layers`
        (with ``offload``, ``params`` live on the CPU, the gathered result on the mesh's
        device, and the gradients come back to the CPU).

    Returns:
      The pytree of full parameters.
    """
    leaves, treedef = tree_util.tree_flatten(params)
    if not leaves:
        return params
    _refuse_functorch("gather_params", leaves)
    shard_axes, rep_axes = _as_axes(axis), _as_axes(replicate_axis)
    state = Groups(
        [leaves],
        shard_axes,
        rep_axes,
        [_shard_dims(leaves, shard_axes, dim)],
        policy or Policy(),
        accumulator=accumulate,
        sync=sync,
        offload=offload,
    )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
    sunk = list(Sink.apply(state, *leaves)) if grad else leaves
    full = _gather(state, 0, sunk, frozenset(shard_axes) | frozenset(rep_axes))
    return tree_util.tree_unflatten(treedef, full)


def offload_shards(params: Any, *, pin_memory: bool | None = None) -> Any:
    """Moves a pytree of shards to the CPU for ``offload=True``, keeping their layout.

    A DTensor keeps its mesh and placements with its local shard on the CPU (FSDP2's CPU
    offload holds its parameters the same way), so ``shard_map`` hands the CPU shard to
    the body and the gradient comes back as a DTensor with a CPU shard; optimizer state
    initialized from the result lives on the CPU too. Plain tensors are moved as they are.
    Unverified on GPU in CI (no GPU there): see ``bench/gpu_checks/offload_check.py``.

    Args:
      params: pytree of DTensors (e.g. from ``fs.shard``) or tensors.
      pin_memory: page-lock the CPU shards; default: when CUDA is available.

    Returns:
      The pytree with every tensor's local data on the CPU.
    """
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        local = x.to_local() if isinstance(x, DTensor) else x
        local = local.detach().to("cpu")
        if pin and not local.is_pinned():
            local = local.pin_memory()
        if isinstance(x, DTensor):
            # Built directly (as FSDP2 does): DTensor.from_local would move the shard back
            # to the mesh's device type.
            return DTensor(local, x._spec, requires_grad=x.requires_grad)
        return local.requires_grad_(x.requires_grad)

    return tree_util.tree_map(one, params)

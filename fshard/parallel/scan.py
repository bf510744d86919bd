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
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from fshard import lax
from fshard import tree as tree_util
from fshard.parallel.groups import Gather, Groups, Sink
from fshard.transforms.policy import Policy
from fshard.transforms.remat import remat as remat_fn

__all__ = ["scan_layers", "gather_params", "fsdp_loop"]


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


def _check_same_structure(layer_params: Sequence[Any]) -> None:
    first = tree_util.structure(layer_params[0])
    for i, p in enumerate(layer_params[1:], start=1):
        s = tree_util.structure(p)
        if s != first:
            raise ValueError(
                f"scan_layers: layer {i} has structure {s} but layer 0 has {first}; every layer "
                f"in one loop must have the same pytree structure."
            )


def scan_layers(
    block_fn: Callable[[Any, Any], Any],
    layer_params: Sequence[Any],
    x: Any,
    *,
    axis: str | Sequence[str] | None = "fsdp",
    replicate_axis: str | Sequence[str] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    remat: bool = False,
    remat_policy: Any = None,
    policy: Policy | None = None,
    dim: int | None = None,
    forward_prefetch: Sequence[Sequence[int]] | None = None,
    backward_prefetch: Sequence[Sequence[int]] | None = None,
    bucket_bytes: int = 25 * 2**20,
    accumulate: Any = None,
    sync: bool | str = True,
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
      prefetch: how many layers ahead the forward all-gathers run.
      reshard_after_forward: free gathered parameters after each layer's forward and
        gather them again in backward (2 all-gathers per layer instead of 1).
      remat: recompute each layer in backward (activation checkpointing); its gather
        is redone inside the recomputation.
      remat_policy: a :func:`fshard.remat` policy for ``remat``.
      policy: mixed precision (gather in ``param_dtype``, reduce in ``reduce_dtype``).
      dim: the sharded dim of every leaf (default: inferred per leaf).
      forward_prefetch: explicit lists: ``forward_prefetch[i]`` = layers whose gathers
        start when layer i starts (overrides ``prefetch``).
      backward_prefetch: ``backward_prefetch[i]`` = layers whose regathers start when
        layer i's backward starts (default: ``[i - 1]``).
      bucket_bytes: replicate (DDP) only: consecutive layers' gradients share one
        all-reduce up to this size (default 25 MiB, as DDP).
      accumulate: a :class:`~fshard.parallel.GradAccumulator` for gradient accumulation.
      sync: with ``accumulate``, ``False`` skips the reduction and keeps the unreduced
        gradient in the accumulator (the returned shard grads are zeros); ``True`` adds
        the accumulated gradients and reduces once; ``"reduce_scatter"`` (HSDP)
        reduce-scatters over ``axis`` every microbatch but defers the all-reduce over
        ``replicate_axis`` to the ``True`` microbatch.

    Returns:
      The output of the last layer.

    Raises:
      ValueError: layers differ in structure; an int ``reshard_after_forward``.
      RuntimeError: called outside a shard_map body.
    """
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"scan_layers: reshard_after_forward={reshard_after_forward!r}: resharding to a "
            f"smaller group is not supported yet; use True or False."
        )
    if len(layer_params) == 0:
        return x
    _check_same_structure(layer_params)
    shard_axes, rep_axes = _as_axes(axis), _as_axes(replicate_axis)
    flat_layers, defs = [], []
    for p in layer_params:
        leaves, d = tree_util.tree_flatten(p)
        flat_layers.append(leaves)
        defs.append(d)
    state = Groups(flat_layers, shard_axes, rep_axes,
                   [_shard_dims(ls, shard_axes, dim) for ls in flat_layers], policy or Policy(), bucket_bytes,
                   accumulate, sync)
    n_layers = len(flat_layers)
    all_leaves = [x for ls in flat_layers for x in ls]
    sunk = Sink.apply(state, *all_leaves) if torch.is_grad_enabled() and any(
        t.requires_grad for t in all_leaves) else tuple(all_leaves)
    sunk_layers, k = [], 0
    for ls in flat_layers:
        sunk_layers.append(list(sunk[k:k + len(ls)]))
        k += len(ls)
    fwd = forward_prefetch or [[j for j in range(i + 1, min(n_layers, i + 1 + prefetch))] for i in range(n_layers)]
    bwd = backward_prefetch or [[i - 1] if i > 0 else [] for i in range(n_layers)]
    tags = frozenset(shard_axes) | frozenset(rep_axes)

    reshard = reshard_after_forward and state.n > 1 and not remat

    def layer(i: int, leaves: list[torch.Tensor], h: Any) -> Any:
        full = _gather(state, i, leaves, tags)
        params = tree_util.tree_unflatten(defs[i], full)
        if not reshard:
            return block_fn(params, h)
        with _reshard_hooks(state, i, bwd[i], full):
            return block_fn(params, h)

    for i in range(n_layers):
        state.start_gather(i)
        for j in fwd[i]:
            state.start_gather(j)
        if remat:
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


@contextlib.contextmanager
def _reshard_hooks(state: Groups, i: int, prefetch: Sequence[int], full: list[torch.Tensor]):
    """Saved tensors that live in group i's gathered storage become tokens; backward regathers."""
    storages = {f.untyped_storage()._cdata: k for k, f in enumerate(full)}

    def pack(t: torch.Tensor):
        k = storages.get(t.untyped_storage()._cdata)
        if k is None:
            return t
        return (k, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(obj):
        if isinstance(obj, torch.Tensor):
            return obj
        k, shape, stride, offset = obj
        return state.regathered(i, prefetch)[k].as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def gather_params(
    params: Any,
    *,
    axis: str | Sequence[str] | None = "fsdp",
    replicate_axis: str | Sequence[str] | None = None,
    policy: Policy | None = None,
    dim: int | None = None,
    accumulate: Any = None,
    sync: bool | str = True,
) -> Any:
    """Gathers one group of parameters (e.g. embeddings + head) for use in a shard_map body.

    One all-gather in forward, one reduce-scatter (plus an all-reduce over
    ``replicate_axis``) in backward, waited at the end of backward. The result is kept
    for backward (no reshard): use it for the root group.

    Args:
      params: pytree of local shards.
      axis, replicate_axis, policy, dim, accumulate, sync: as in :func:`scan_layers`.

    Returns:
      The pytree of full parameters.
    """
    leaves, treedef = tree_util.tree_flatten(params)
    if not leaves:
        return params
    shard_axes, rep_axes = _as_axes(axis), _as_axes(replicate_axis)
    state = Groups([leaves], shard_axes, rep_axes, [_shard_dims(leaves, shard_axes, dim)], policy or Policy(),
                   accumulator=accumulate, sync=sync)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
    sunk = list(Sink.apply(state, *leaves)) if grad else leaves
    full = _gather(state, 0, sunk, frozenset(shard_axes) | frozenset(rep_axes))
    return tree_util.tree_unflatten(treedef, full)

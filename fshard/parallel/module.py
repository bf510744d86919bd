"""``fsdp_apply``: per-block FSDP / HSDP / DDP for a functionalized ``nn.Module``.

FSDP2 shards a model you did not write with ``fully_shard(block)`` for each block and
``fully_shard(model)``. Here that is one call on the function from
``fs.nn.functionalize``::

    apply, params, buffers = fs.nn.functionalize(model)          # e.g. a Hugging Face model
    apply = fs.parallel.fsdp_apply(apply, blocks="model.layers", axis="fsdp")
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    def loss_fn(p, tokens, targets):                              # a shard_map body
        logits = apply(p, tokens).logits                          # p: local shards
        ...

Each block's parameters are one group (the engine under ``scan_layers``:
:class:`fshard.parallel.groups.Groups`): gathered in one flat all-gather just before the
block runs, with the next ``prefetch`` blocks' gathers in flight; with
``reshard_after_forward`` dropped from autograd's saved tensors after the block's forward
and gathered again when backward needs them; the gradients reduce-scattered once. The
parameters in no block (embeddings, final norm, head) form the root group, gathered once
at the start of the call and kept for backward. The wrapper reaches the blocks through
forward pre/post hooks that exist only during the call: the module is not modified.

Communication per call and block: 1 all-gather in forward, +1 in backward with reshard,
1 reduce-scatter; the root: 1 and 1. ``axis=None, replicate_axis="dp"`` is DDP (one
bucketed all-reduce of gradients, no gather); both axes are HSDP.

Tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) appear once in
``functionalize``'s tree; a tensor used both inside a block and outside it (or in two
blocks) goes to the root group, gathered once, and its gradient is the sum over its uses.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from fshard import lax
from fshard import nn as fnn
from fshard import tree as tree_util
from fshard.parallel import _modules as mods
from fshard.parallel.groups import Groups, Sink, saved_as_tokens
from fshard.parallel.scan import _as_axes, _gather, _post_forward_axes, _refuse_functorch, _shard_dims
from fshard.runtime import simulation
from fshard.transforms.policy import Policy

__all__ = ["fsdp_apply", "FSDPApply"]


def fsdp_apply(
    apply: Any,
    blocks: str | Sequence[str] = "model.layers",
    axis: str | Sequence[str] | None = "fsdp",
    replicate_axis: str | Sequence[str] | None = None,
    reshard_after_forward: bool | int | str | Sequence[str] = True,
    prefetch: int = 1,
    policy: Policy | None = None,
    sync_buffers: str = "local",
) -> "FSDPApply":
    """Wraps ``apply`` so that each block's parameters are gathered per block (FSDP2's
    ``fully_shard`` per block plus the root).

    Call the result inside a shard_map body with the local shards, exactly as ``apply``:
    ``fsdp(params, *args, **kwargs)``; specs from :func:`fshard.parallel.fsdp_specs`
    (HSDP: the same specs on a mesh with a replicate axis; DDP:
    :func:`fshard.parallel.replicate_specs`).

    Args:
      apply: the function from ``fs.nn.functionalize(module)``, or ``tp_apply(...)`` of it
        (FSDP x TP on a 2-D mesh: the tp-local shards are gathered over ``axis`` only).
      blocks: a dotted path to an ``nn.ModuleList`` whose children are the blocks
        (``"model.layers"`` for Llama, ``"transformer.h"`` for GPT-2), or a list of paths
        and patterns (``*`` matches within one name: ``"model.layers.*"``); a list entry
        naming a ``ModuleList`` stands for its children, any other module is one block.
        Blocks are gathered (and prefetched) in this order.
      axis: mesh axis (or axes) the parameters are sharded over; ``None`` for DDP.
      replicate_axis: mesh axis (or axes) the parameters are replicated over, whose
        gradients are all-reduced (DDP, or HSDP together with ``axis``).
      reshard_after_forward: as in :func:`fshard.parallel.scan_layers` (``True``: free each
        block's gathered parameters after its forward and gather them again in backward;
        ``False``: keep them; an axis name or int: keep a slice). The root group is kept.
      prefetch: how many blocks ahead the forward all-gathers run.
      policy: mixed precision (gather in ``param_dtype``, reduce in ``reduce_dtype``).
      sync_buffers: what a call with ``return_buffers=True`` returns for buffers the
        forward updated (BatchNorm's running statistics). Either way the forward
        normalizes with this rank's batch statistics, as torch DDP does (no SyncBatchNorm).
        ``"local"`` (default): rank 0's buffers, on every rank. That is torch DDP's
        ``broadcast_buffers=True``, which copies rank 0's buffers to every rank before
        each forward: the running statistics follow rank 0's batches. ``"mean"``: the
        floating-point buffers averaged over the data axes (``axis`` and
        ``replicate_axis``); integer ones (``num_batches_tracked``) are the same
        everywhere and kept.

    Returns:
      An :class:`FSDPApply`, with ``apply``'s signature.

    Raises:
      TypeError: ``apply`` does not come from ``functionalize``.
      ValueError: a ``blocks`` path that does not exist (names where the path stops and
        what is there), a string path that is not a ``ModuleList``, a pattern that matches
        no module, a block inside another block, or a block with no parameters of its own.
    """
    module = mods.module_of(apply, "fsdp_apply")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fsdp_apply: prefetch={prefetch!r}; use an int >= 0.")
    if sync_buffers not in ("local", "mean"):
        raise ValueError(
            f"fsdp_apply: sync_buffers={sync_buffers!r}; use 'local' (rank 0's, as torch DDP) or "
            f"'mean' (averaged over the data axes)."
        )
    return FSDPApply(
        apply,
        module,
        _resolve_blocks(module, blocks),
        _as_axes(axis),
        _as_axes(replicate_axis),
        reshard_after_forward,
        prefetch,
        policy or Policy(),
        sync_buffers,
    )


def _resolve_blocks(module: nn.Module, blocks: str | Sequence[str]) -> list[str]:
    """``blocks`` -> the block module paths, in order."""
    if isinstance(blocks, str):
        entries, single = [blocks], True
    elif isinstance(blocks, (list, tuple)) and blocks and all(isinstance(b, str) for b in blocks):
        entries, single = list(blocks), False
    else:
        raise TypeError(
            f"fsdp_apply: blocks={blocks!r}; use a dotted path to a ModuleList or a non-empty "
            f"list of module paths and patterns."
        )
    named = mods.module_paths(module)
    kind = type(module).__name__
    out: list[str] = []
    for entry in entries:
        if mods.is_pattern(entry):
            rx = mods.compile_pattern(entry)
            hits = [p for p in named if p and rx.fullmatch(p)]
            if not hits:
                raise ValueError(
                    f"fsdp_apply: blocks pattern {entry!r} matches no submodule of {kind}. Module "
                    f"paths look like {_examples(named)}."
                )
            out.extend(hits)
            continue
        where = mods.nearest_names(module, entry) if entry else "the empty path is the whole model"
        if where:
            raise ValueError(f"fsdp_apply: blocks path {entry!r} does not exist in {kind}: {where}.")
        m = module.get_submodule(entry)
        if isinstance(m, nn.ModuleList):
            out.extend(f"{entry}.{k}" for k in m._modules)
        elif single:
            raise ValueError(
                f"fsdp_apply: blocks={entry!r} is a {type(m).__name__}, not an nn.ModuleList. Pass the path of "
                f"the ModuleList that holds the blocks, or a list of block paths (blocks=[{entry!r}] makes "
                f"this one module a block)."
            )
        else:
            out.append(entry)
    seen: set[str] = set()
    for p in out:
        if p in seen:
            raise ValueError(f"fsdp_apply: block {p!r} is named twice in blocks={blocks!r}.")
        seen.add(p)
    for p in out:
        for q in out:
            if p != q and q.startswith(p + "."):
                raise ValueError(f"fsdp_apply: block {q!r} lies inside block {p!r}; blocks must not nest.")
    return out


def _examples(named: dict[str, nn.Module]) -> str:
    paths = [p for p in named if p][:6]
    return ", ".join(repr(p) for p in paths) or "(none: the module has no submodules)"


class FSDPApply:
    """The function :func:`fsdp_apply` returns: ``fsdp(params, *args, **kwargs)``.

    Attributes:
      module: the wrapped ``nn.Module`` (only read: its structure, at call time).
      inner: the wrapped ``apply``.
      blocks: the block paths, in gather order.
      groups: the parameter names of each group: ``groups[0]`` the root (if it has any),
        then one list per block.
    """

    def __init__(
        self,
        inner: Any,
        module: nn.Module,
        blocks: list[str],
        shard_axes: tuple[str, ...],
        replicate_axes: tuple[str, ...],
        reshard_after_forward: Any,
        prefetch: int,
        policy: Policy,
        sync_buffers: str = "local",
    ) -> None:
        self.inner, self.module, self.blocks = inner, module, blocks
        self.sync_buffers = sync_buffers
        self.shard_axes, self.replicate_axes = shard_axes, replicate_axes
        self.reshard_after_forward, self.prefetch, self.policy = reshard_after_forward, prefetch, policy
        names = [n for n, _ in module.named_parameters()]  # canonical names, as functionalize's tree
        aliases = mods.aliases_of(module)
        self._names = frozenset(names)

        def owner(name: str) -> int | None:
            for k, b in enumerate(blocks):
                if name.startswith(b + "."):
                    return k
            return None

        per_block: list[list[str]] = [[] for _ in blocks]
        root: list[str] = []
        for n in names:
            k = owner(n)
            # A tensor tied across a block boundary is gathered once, with the root.
            if k is None or any(owner(a) != k for a in aliases.get(n, ())):
                root.append(n)
            else:
                per_block[k].append(n)
        empty = [b for b, ns in zip(blocks, per_block) if not ns]
        if empty:
            raise ValueError(
                f"fsdp_apply: block(s) {empty} hold no parameters of their own (parameterless, or every "
                f"parameter tied to one outside the block, which the root group holds). Leave them out of "
                f"blocks."
            )
        self._root = root
        self._per_block = per_block
        # The names to rebind inside each block: its parameters and their in-block aliases.
        self._bind = [[(n, [n] + list(aliases.get(n, ()))) for n in ns] for ns in per_block]
        self.groups = ([root] if root else []) + per_block

    def __repr__(self) -> str:
        return (
            f"FSDPApply({type(self.module).__name__}, {len(self.blocks)} blocks, axis={self.shard_axes}, "
            f"replicate_axis={self.replicate_axes})"
        )

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        body = lax.BODY.get()
        if body is None:
            raise RuntimeError(
                "fs.parallel.fsdp_apply: call the wrapped function inside a shard_map body "
                "(it issues collectives on local shards)."
            )
        mesh = body.mesh
        mesh.check_axes(self.shard_axes, what="axis")
        mesh.check_axes(self.replicate_axes, what="replicate_axis")
        reshard, post_axes = _post_forward_axes(self.reshard_after_forward, self.shard_axes, mesh, False)
        flat = fnn.to_state_dict(params)
        if flat.keys() != self._names:
            raise ValueError(
                fnn._mismatch_message(f"fsdp_apply({type(self.module).__name__}): params", flat.keys(), self._names)
            )
        leaves = [[flat[n] for n in names] for names in self.groups]
        all_leaves = [x for ls in leaves for x in ls]
        _refuse_functorch("fsdp_apply", all_leaves)
        dims = [_shard_dims(ls, self.shard_axes, None) for ls in leaves]
        state = Groups(
            leaves, self.shard_axes, self.replicate_axes, dims, self.policy, post_axes=post_axes if reshard else ()
        )
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in all_leaves)
        sunk = list(Sink.apply(state, *all_leaves)) if grad else all_leaves
        sunk_groups, k = [], 0
        for ls in leaves:
            sunk_groups.append(sunk[k : k + len(ls)])
            k += len(ls)
        tags = frozenset(self.shard_axes) | frozenset(self.replicate_axes)
        reshard = reshard and state.n > 1
        first = 1 if self._root else 0  # the group id of block 0
        n_blocks = len(self.blocks)

        bound = dict(flat)
        if self._root:
            state.start_gather(0)
            for j in range(first, first + min(self.prefetch, n_blocks)):
                state.start_gather(j)
            for n, full in zip(self._root, _gather(state, 0, sunk_groups[0], tags)):
                bound[n] = full
        for names, ls in zip(self._per_block, sunk_groups[first:]):
            bound.update(zip(names, ls))  # bound to the shards; each block's pre hook rebinds

        hooks = mods.CallHooks()
        used: set[int] = set()

        def make(kb: int):
            g = first + kb
            block = self.module.get_submodule(self.blocks[kb])
            prefix = len(self.blocks[kb]) + 1
            ahead = range(g + 1, min(first + n_blocks, g + 1 + self.prefetch))
            behind = [g - 1] if kb > 0 else []
            open_: list[Any] = []

            def pre(module, args, kwargs):
                used.add(g)
                state.start_gather(g)
                for j in ahead:
                    state.start_gather(j)
                full = _gather(state, g, sunk_groups[g], tags)
                rebind = {a[prefix:]: f for f, (_, names) in zip(full, self._bind[kb]) for a in names}
                before = mods.swap(block, rebind)
                ctx = saved_as_tokens(full, lambda: state.regathered(g, behind)) if reshard else None
                if ctx is not None:
                    ctx.__enter__()

                def cleanup():
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
                    mods.swap(block, before)

                open_.append(cleanup)
                hooks.push_cleanup(cleanup)

            def post(module, args, kwargs, output):
                if open_:
                    hooks.pop_cleanup(open_.pop())

            return block, pre, post

        for kb in range(n_blocks):
            block, pre, post = make(kb)
            hooks.add(block, pre, post)
        try:
            result = self.inner(fnn.from_state_dict(bound), *args, **kwargs)
        finally:
            hooks.close()
            for g in range(first, first + n_blocks):
                if g not in used:
                    state.drop(g)  # a prefetched gather for a block that did not run
        if kwargs.get("return_buffers"):
            out, buffers = result
            axes = tuple(a for a in mesh.axis_names if a in self.shard_axes + self.replicate_axes and mesh.shape[a] > 1)
            return out, _sync_buffers(buffers, self.sync_buffers, axes)
        return result


def _varying(x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """``x`` typed varying over all of ``axes`` (checked mode): psum and pmean take a value
    varying over all of their axes or none, and a buffer that a forward updated from data
    split over some of them, or one picked by the rank's position, varies over all."""
    missing = tuple(a for a in axes if a not in lax.vma(x))
    return lax.pvary(x, missing) if missing else x  # detached: no autograd, no collective


def _if_first(flat: torch.Tensor, position: list[int]) -> torch.Tensor:
    """``flat`` on the rank at index 0 of every axis, zeros elsewhere."""
    return flat if all(i == 0 for i in position) else torch.zeros_like(flat)


def _sync_buffers(buffers: Any, mode: str, axes: tuple[str, ...]) -> Any:
    """Makes the buffers a forward updated the same on every rank of the data ``axes``.

    ``"local"``: rank 0's (a psum of rank 0's values and zeros: exact); ``"mean"``: the
    mean. Floating-point buffers of one dtype travel as one flat buffer (one collective);
    integer ones (step counters) agree already and are kept.
    """
    if not axes:
        return buffers
    leaves, treedef = tree_util.tree_flatten(buffers)
    # The rank's position from the mesh, not int(lax.axis_index(...)), whose conversion to
    # Python would leave checked mode's types (every P() output then verified); used per rank
    # (under fs.simulate each simulated rank's own position).
    mesh = lax.BODY.get().mesh
    position = [mesh.axis_index(a) for a in axes]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, b in enumerate(leaves):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            by_dtype.setdefault(b.dtype, []).append(k)
    out = list(leaves)
    for ks in by_dtype.values():
        flat = torch.cat([leaves[k].detach().reshape(-1) for k in ks])  # (sum of numels,)
        if mode == "mean":
            flat = lax.pmean(_varying(flat, axes), axes)
        else:
            flat = lax.psum(_varying(simulation.per_rank(_if_first)(flat, position), axes), axes)
        for k, part in zip(ks, flat.split([leaves[k].numel() for k in ks])):
            out[k] = part.view(leaves[k].shape)
    return tree_util.tree_unflatten(treedef, out)

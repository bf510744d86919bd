"""Base interfaces and datatypes, and the leaf plumbing every transform shares.

A transform sees pytrees whose leaves are torch DTensors (sharded or replicated on a
mesh) or plain tensors (one process, or local shards inside a ``shard_map`` body). It
does its arithmetic on the local shards and wraps the results back with the same
mesh and placements, so optimizer state is laid out exactly like the parameters.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence, Union

import torch
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util

__all__ = [
    "Params",
    "Updates",
    "OptState",
    "Schedule",
    "ScalarOrSchedule",
    "TransformInitFn",
    "TransformUpdateFn",
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "apply_updates",
    "donate",
]

Params = Any  # a pytree of tensors / DTensors
Updates = Any  # a pytree shaped and sharded like Params
OptState = Any  # a pytree (usually NamedTuples) holding the transform's state
# step (0, 1, ...) -> value; under fs.jit the step is a 0-dim int64 tensor and the value may
# be a 0-dim tensor (see fshard.optim.schedules)
Schedule = Callable[[Any], Any]
ScalarOrSchedule = Union[float, Schedule]


class TransformInitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None) -> (new_updates, new_state)``; pure."""

    def __call__(self, updates: Updates, state: OptState, params: Params | None = None) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init`` builds the state, ``update`` transforms updates.

    ``update`` never mutates its arguments: it returns new updates and a new state.
    Build one with a factory (``fs.optim.adamw(lr=1e-3)``) and compose with
    :func:`chain`.

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(updates, state, params=None) -> (updates, state)``.
    """

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """A transform that returns the updates unchanged.

    Returns:
      A :class:`GradientTransformation` with :class:`EmptyState`.
    """

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: EmptyState, params: Params | None = None):
        del params
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transforms one after the other; the state is the tuple of their states.

    Args:
      *transforms: the transforms, first applied first.

    Returns:
      A :class:`GradientTransformation` whose state is a tuple with one entry per
      transform.

    Raises:
      TypeError: an argument is not a :class:`GradientTransformation`.
      ValueError: (from ``update``) the state does not have one entry per transform.

    Example:
      >>> import fshard as fs
      >>> opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=1e-3))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation.")

    def init_fn(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update_fn(updates: Updates, state: tuple[OptState, ...], params: Params | None = None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state with {got} entries. "
                "Make sure you pass the state that this chain's init returned."
            )
        new_state = []
        with _private_scope():
            for t, s in zip(transforms, state):
                updates, s = t.update(updates, s, params)
                new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)


# Checks that must pass before parameters are updated, registered by the layers that can
# leave a step unfinished (fshard.parallel's GradAccumulator); optim imports none of them.
_BEFORE_APPLY: list[Callable[[str], None]] = []


def register_before_apply(check: Callable[[str], None]) -> None:
    """Makes :func:`apply_updates` call ``check("fs.optim.apply_updates")`` first (once per
    ``check``); ``check`` raises to refuse the update, naming what is unfinished."""
    if check not in _BEFORE_APPLY:
        _BEFORE_APPLY.append(check)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Returns ``params + updates``, leaf by leaf, in each parameter's dtype.

    Updates of a wider dtype (float32 updates of bfloat16 params) are added in that
    dtype and the sum is rounded once to the parameter's, as torch's ``p.add_(u)`` and
    ``optax.apply_updates`` do (casting the updates first would round twice).

    Pure: ``params`` and ``updates`` are left as they are. A DTensor result keeps the
    parameter's mesh and placements; every result keeps the parameter's
    ``requires_grad``, so autograd-based loops can go on using the new leaves.

    Args:
      params: a pytree of tensors or DTensors, global shape ``S`` (per rank: the local
        shard of ``S``).
      updates: a pytree with the same structure, shapes and sharding (the output of a
        transform's ``update``).

    Returns:
      The new parameters, structured and sharded like ``params``.

    Raises:
      ValueError: the structures differ, or a leaf's sharding differs; the message names
        the path.
      RuntimeError: a :class:`fshard.parallel.GradAccumulator` still holds gradients of
        microbatches run with ``sync=False`` (the step would use partial gradients).

    Example:
      >>> updates, state = opt.update(grads, state, params)  # doctest: +SKIP
      >>> params = fs.optim.apply_updates(params, updates)  # doctest: +SKIP
    """
    for check in _BEFORE_APPLY:
        check("fs.optim.apply_updates")
    p, u, treedef = flatten_matching("apply_updates", ("params", params), ("updates", updates))
    with torch.no_grad():
        pl, ul = to_locals(p), to_locals(u)
        if _DONATE.get():
            if pl:
                torch._foreach_add_(pl, ul)  # in the promoted dtype, rounded once into p's
            return params
        out = torch._foreach_add(pl, ul) if pl else []
        out = [o if o.dtype == x.dtype else o.to(x.dtype) for o, x in zip(out, pl)]
    new = [wrap_like(local, ref) for local, ref in zip(out, p)]
    for x, ref in zip(new, p):
        if ref.requires_grad:
            x.requires_grad_(True)
    return tree_util.tree_unflatten(treedef, new)


_DONATE: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_optim_donate", default=False)


@contextlib.contextmanager
def donate() -> Iterator[None]:
    """Lets ``update`` overwrite the state, and ``apply_updates`` the params, they are given.

    JAX's buffer donation for the usual loop, where the old state and params are
    never used again. Outside this context every transform is pure and must allocate
    its new state and params; on CPU, where fresh memory costs page faults, donating
    makes an AdamW step much cheaper (``bench/README.md``, "Host costs behind the
    code"). Updates and grads are never overwritten.

    Example:
      >>> with fs.optim.donate():  # doctest: +SKIP
      ...     updates, state = opt.update(grads, state, params)
      ...     params = fs.optim.apply_updates(params, updates)
      >>> # the state and params from before the step are now stale: use the new ones only
    """
    token = _DONATE.set(True)
    try:
        yield
    finally:
        _DONATE.reset(token)


def state_for_kernel(locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors the in-place kernels may write: the state itself when donated, else copies."""
    if _DONATE.get():
        return list(locals_)
    return [x.clone() for x in locals_]


# --- leaf plumbing shared by the transforms --------------------------------------


def check_hparam(
    what: str, name: str, value: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    """Raises ValueError unless ``value`` is a number in the given interval, naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{what}: {name}={value!r} must be a number in {lb}{lo}, {hi}{hb}.")


# Updates that one transform of a chain makes and the next one consumes are seen by no
# one else, so the next transform may overwrite them instead of allocating new tensors.
# On CPU, fresh allocations of this size cost more than the arithmetic (page faults;
# bench/README.md, "Host costs behind the code"), so this saves AdamW two of the five
# fresh trees a pure step would otherwise allocate, without giving up purity. The scope maps
# id -> tensor and holds the tensors, so an id is never reused while the scope lives; it ends
# when the outermost chain returns, so nothing handed back to the caller is ever overwritten.
_PRIVATE: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "fshard_optim_private", default=None
)


@contextlib.contextmanager
def _private_scope() -> Iterator[None]:
    if _PRIVATE.get() is not None:  # an inner chain shares the outer chain's scope
        yield
        return
    token = _PRIVATE.set({})
    try:
        yield
    finally:
        _PRIVATE.reset(token)


def mark_private(locals_: Sequence[torch.Tensor]) -> None:
    """Records fresh local tensors that only the running chain can see (no-op outside one)."""
    scope = _PRIVATE.get()
    if scope is not None:
        for t in locals_:
            scope[id(t)] = t


def all_private(locals_: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor was made by an earlier transform of the running chain."""
    scope = _PRIVATE.get()
    return scope is not None and all(scope.get(id(t)) is t for t in locals_)


def map_updates(
    updates: Updates,
    out_of_place: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    in_place: Callable[[list[torch.Tensor]], Any],
) -> Updates:
    """Applies an elementwise op to every local shard of ``updates``.

    Overwrites the updates when they are private to the running chain (see above),
    else returns new tensors laid out like the old ones.
    """
    leaves, treedef = tree_util.tree_flatten(updates)
    with torch.no_grad():
        local = to_locals(leaves)
        if not local:
            return updates
        if all_private(local):
            in_place(local)
            return updates
        out = out_of_place(local)
    mark_private(out)
    return tree_util.tree_unflatten(treedef, [wrap_like(o, x) for o, x in zip(out, leaves)])


def to_locals(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards: ``to_local()`` of DTensors, plain tensors as they are."""
    return [x.to_local() if isinstance(x, DTensor) else x for x in leaves]


def wrap_like(local: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``local`` as a leaf laid out like ``ref`` (a DTensor with ref's mesh and placements).

    The result is an autograd leaf that does not require grad.
    """
    if not isinstance(ref, DTensor):
        return local
    spec = getattr(ref, "_spec", None)
    if spec is not None and spec.tensor_meta is not None and spec.tensor_meta.dtype == local.dtype:
        # Same global shape, stride, dtype and placements as ref: share its spec. This is
        # an order of magnitude cheaper than from_local (bench/README.md, "Host costs behind
        # the code"), which matters because every transform wraps every leaf of every tree
        # it returns.
        return DTensor(local, spec, requires_grad=False)
    with torch.no_grad():
        # run_check=False: every rank built its shard from its own inputs; nothing to verify.
        return DTensor.from_local(
            local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
        )


def zeros_like_tree(params: Params, what: str) -> Params:
    """Zeros shaped, typed and sharded like ``params`` (a state tree of the transform)."""
    paths, leaves, treedef = tree_util.zip_with_path(params)
    _check_tensors(what, "params", paths, leaves)
    with torch.no_grad():
        zeros = [torch.zeros_like(x) for x in to_locals(leaves)]
    return tree_util.tree_unflatten(treedef, [wrap_like(z, x) for z, x in zip(zeros, leaves)])


def new_count() -> torch.Tensor:
    """A step counter: shape=(), dtype=int64, on CPU (read without a device sync)."""
    return torch.zeros((), dtype=torch.int64)


def flatten_matching(what: str, first: tuple[str, Any], *others: tuple[str, Any]):
    """Flattens ``first`` and ``others`` (``(name, tree)`` pairs) after checking they match.

    Every tree must have ``first``'s structure, and every leaf the same kind (DTensor or
    plain tensor), global shape, mesh and placements as the leaf at that path in
    ``first``.

    Returns:
      ``(leaves_first, *leaves_others, treedef)``.

    Raises:
      TypeError: a leaf is not a tensor.
      ValueError: a structure or a leaf's layout differs; the message names the paths.
    """
    name0, tree0 = first
    leaves0, treedef = tree_util.tree_flatten(tree0)
    if not all(isinstance(x, torch.Tensor) for x in leaves0):
        paths, _, _ = tree_util.zip_with_path(tree0)
        _check_tensors(what, name0, paths, leaves0)
    out = [leaves0]
    for name, tree in others:
        leaves, td = tree_util.tree_flatten(tree)
        if td != treedef:
            raise ValueError(_structure_error(what, name0, tree0, name, tree))
        bad = [i for i, (a, b) in enumerate(zip(leaves0, leaves)) if not _same_layout(a, b)]
        if bad:
            paths, _, _ = tree_util.zip_with_path(tree0)
            _check_tensors(what, name0, paths, leaves0)
            _check_tensors(what, name, paths, leaves)
            raise ValueError(_layout_error(what, name0, name, [(paths[i], leaves0[i], leaves[i]) for i in bad]))
        out.append(leaves)
    return (*out, treedef)


def _same_layout(a: Any, b: Any) -> bool:
    """``_layout(a) == _layout(b)``, without building the tuples on the common paths.

    Every transform checks every leaf of two or three trees each step, so building and
    comparing layout tuples would be a large share of a step's Python time (``bench/README.md``,
    "Host costs behind the code"). Plain tensors compare shapes; DTensors made by :func:`wrap_like` share their
    parameter's spec object, and one spec object means one shape, mesh and placements.
    """
    if type(a) is torch.Tensor and type(b) is torch.Tensor:
        return a.shape == b.shape
    if type(a) is DTensor and type(b) is DTensor and a._spec is b._spec:
        return True
    return _layout(a) == _layout(b)


def _layout(x: Any) -> tuple[Any, ...]:
    # Placements compare by kind too, so Shard(0) never passes for _StridedShard(0, 2).
    if isinstance(x, DTensor):
        return ("DTensor", tuple(x.shape), x.device_mesh, tuple((type(p), p) for p in x.placements))
    if isinstance(x, torch.Tensor):
        return ("Tensor", tuple(x.shape))
    return (type(x),)


def _describe_layout(x: Any) -> str:
    if isinstance(x, DTensor):
        names: tuple[object, ...] = x.device_mesh.mesh_dim_names or tuple(range(x.device_mesh.ndim))
        where = ", ".join(f"{n}: {p}" for n, p in zip(names, x.placements))
        try:
            from fshard.mesh.sharding import spec_of

            spec = f"spec {spec_of(x)!r}, "
        except Exception:  # a Partial placement or an unnamed mesh has no spec; placements say it all
            spec = ""
        return f"DTensor of shape {tuple(x.shape)}, {spec}placements ({where})"
    if isinstance(x, torch.Tensor):
        return f"plain tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _layout_error(what: str, name0: str, name: str, bad: list[tuple[str, Any, Any]]) -> str:
    lines = [f"{what}: {name0} and {name} are laid out differently:"]
    for path, a, b in bad[:10]:
        lines.append(f"  * {path}: {name0} has a {_describe_layout(a)}; {name} has a {_describe_layout(b)}")
    if len(bad) > 10:
        lines.append(f"  ... and {len(bad) - 10} more")
    lines.append(
        "Give every leaf the mesh, placements and shape of its parameter "
        "(e.g. fs.reshard(grads, fs.spec_of(params))), and build the state with init(params)."
    )
    return "\n".join(lines)


def _structure_error(what: str, name0: str, tree0: Any, name: str, tree: Any) -> str:
    p0, _, td0 = tree_util.zip_with_path(tree0)
    p1, _, td1 = tree_util.zip_with_path(tree)
    only0 = [p for p in p0 if p not in set(p1)]
    only1 = [p for p in p1 if p not in set(p0)]
    if only0 or only1:
        first, side = (only0[0], name0) if only0 else (only1[0], name)
        detail = (
            f"first difference at '{first}', which only {side} has"
            f"\n  only in {name0}: {only0[:5]}{' ...' if len(only0) > 5 else ''}"
            f"\n  only in {name}: {only1[:5]}{' ...' if len(only1) > 5 else ''}"
        )
    else:
        detail = f"same leaf paths but different containers:\n  {name0}: {td0}\n  {name}: {td1}"
    return (
        f"{what}: {name} does not have the pytree structure of {name0}: {detail}\n"
        f"Pass {name} with exactly the structure of the params the optimizer was built on."
    )


def _check_tensors(what: str, name: str, paths: Sequence[str], leaves: Sequence[Any]) -> None:
    bad = [(p, x) for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)]
    if bad:
        listed = "; ".join(f"{p}: {type(x).__name__}" for p, x in bad[:10])
        raise TypeError(f"{what}: every leaf of {name} must be a tensor or DTensor; got {listed}.")

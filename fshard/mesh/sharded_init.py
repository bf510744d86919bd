"""``init_sharded``: build parameters directly as shards, equal to the one-process init.

How: ``init_fn(seed)`` is traced once on fake (shape-only) tensors, which records the ATen ops
it runs (the random ones included, with their generators) and gives every shape for
free. The recorded program is then replayed op by op on the real device, in the same
order, so every random op draws exactly the numbers it draws in a plain
``init_fn(seed)`` call. The replay frees each intermediate after its last use, and as
soon as a parameter is final it keeps only this rank's block. So the full values of
at most one parameter (plus the temporaries that compute it) are alive at a time.

Limits: ``init_fn`` must not read tensor values into Python (``.item()``, ``if
x.sum() > 0``), which a meta trace cannot do, and must take its randomness from
torch (``torch.manual_seed`` / a ``torch.Generator``), not from numpy or ``random``.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh, get_mesh
from fshard.mesh.placement import raise_spec_errors, spec_problems, take_block, uneven_problems
from fshard.mesh.sharding import make_dtensor
from fshard.mesh.spec import is_spec

__all__ = ["init_sharded", "InitStats"]

_MSG_DATA_DEPENDENT = (
    "fs.init_sharded: init_fn reads tensor values into Python ({op}), which a shape-only "
    "trace cannot do. Common cause: torch.nn.init.trunc_normal_ (rejection sampling). "
    "Use ops whose control flow does not depend on values, e.g. normal_() then clamp_(), "
    "or build the full tree with init_fn(seed) and call fs.shard on it."
)


@attrs.frozen
class InitStats:
    """What the replay held: ``peak_bytes`` of full-size tensors alive at once, and the
    largest single parameter's ``max_param_bytes``, for checking the memory promise."""

    peak_bytes: int
    max_param_bytes: int
    n_ops: int


class _Ref:
    __slots__ = ("node",)

    def __init__(self, node: int) -> None:
        self.node = node


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Tracer(TorchDispatchMode):
    """Runs every op on fake tensors and records it with tensor args replaced by node refs.

    Fake (not meta) tensors, because ``torch.nn.init`` skips meta tensors entirely and
    would leave nothing to record.
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.ops: list[tuple[Any, Any, Any, list[int]]] = []
        self.node_of: dict[int, int] = {}  # id(meta tensor) -> node
        self.group_of: list[int] = []  # node -> storage key (aliasing group)
        self.consts: dict[int, torch.Tensor] = {}  # node -> real tensor from outside the trace
        self.keep: list[torch.Tensor] = []  # keeps ids unique for the trace's lifetime

    def _new_node(self, t: torch.Tensor) -> int:
        n = len(self.group_of)
        self.group_of.append(_storage_key(t))
        self.node_of[id(t)] = n
        self.keep.append(t)
        return n

    def _arg(self, x: Any) -> tuple[Any, Any]:
        """(template for replay, value for the meta call)."""
        if isinstance(x, torch.Tensor):
            n = self.node_of.get(id(x))
            if n is None:  # a real tensor captured from outside init_fn
                fake = self.fake_mode.from_tensor(x.detach())
                n = self._new_node(fake)
                self.consts[n] = x.detach()
                return _Ref(n), fake
            return _Ref(n), x
        if isinstance(x, (list, tuple)):
            pairs = [self._arg(y) for y in x]
            return type(x)(p[0] for p in pairs), type(x)(p[1] for p in pairs)
        return x, x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        has_gen = "generator" in kwargs
        gen = kwargs.pop("generator", None)
        targs, margs = self._arg(tuple(args))
        tk, mk = {}, {}
        for k, v in kwargs.items():
            tk[k], mk[k] = self._arg(v)
        if has_gen:  # the fake call draws nothing; the replay draws from the real one
            tk["generator"], mk["generator"] = gen, None
        try:
            out = func(*margs, **mk)
        except DataDependentOutputException as e:
            raise ValueError(_MSG_DATA_DEPENDENT.format(op=func)) from e
        outs = out if isinstance(out, (tuple, list)) else (out,)
        nodes = []
        for o in outs:
            if isinstance(o, torch.Tensor):
                n = self.node_of.get(id(o))
                nodes.append(self._new_node(o) if n is None else n)
            else:
                nodes.append(-1)
        self.ops.append((func, targs, tk, nodes))
        return out


def _resolve(template: Any, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(template, _Ref):
        return values[template.node]
    if isinstance(template, (list, tuple)):
        return type(template)(_resolve(t, values) for t in template)
    return template


def init_sharded(
    init_fn: Callable[[int], Any],
    specs: Any,
    mesh: Mesh | None = None,
    seed: int = 0,
    *,
    return_stats: bool = False,
    uneven: bool = False,
) -> Any:
    """Builds ``init_fn(seed)``'s parameters directly as shards laid out by ``specs``.

    Every rank gets DTensors whose values equal a one-process ``init_fn(seed)`` bit for
    bit, on any mesh, without ever holding more than one full parameter.

    Args:
      init_fn: ``seed -> pytree of tensors`` (seeding itself from ``seed`` with
        ``torch.manual_seed`` or a ``torch.Generator``). Factory calls without a
        device create CPU tensors, as in a plain call; shards then move to the mesh's
        device, so a CUDA mesh gets the CPU init's values.
      specs: pytree prefix of the result, with :class:`P` leaves.
      mesh: the mesh (default: the current mesh).
      seed: passed to ``init_fn``.
      return_stats: also return an :class:`InitStats`.
      uneven: allow ``torch.chunk``-style uneven blocks (FSDP parameters), as in
        :func:`fshard.shard`.

    Returns:
      The pytree of DTensors (and the stats when asked).

    Raises:
      ValueError: ``specs`` do not fit the shapes (every bad leaf listed with its path).
    """
    mesh = get_mesh(mesh, what="fs.init_sharded")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracer = _Tracer(fake_mode)
    with fake_mode, tracer:
        meta_tree = init_fn(seed)
    paths, meta_leaves, treedef = tree_util.zip_with_path(meta_tree)
    flat_specs = tree_util.broadcast_prefix(
        specs, meta_tree, is_prefix_leaf=is_spec, name="specs", full_name="init_fn(seed)"
    )
    bad = [
        (p, s, tuple(x.shape), probs)
        for p, x, s in zip(paths, meta_leaves, flat_specs)
        if isinstance(x, torch.Tensor)
        and (
            probs := spec_problems(s, tuple(x.shape), mesh, allow_uneven=uneven)
            or (uneven_problems(s, tuple(x.shape), mesh) if uneven else [])
        )
    ]
    raise_spec_errors("fs.init_sharded", mesh, bad, "Fix the spec, or change the parameter's shape.")

    leaf_node: dict[int, list[int]] = {}  # node -> leaf indices (tied leaves share a node)
    by_storage: dict[Any, list[int]] = {}
    for n, key in enumerate(tracer.group_of):
        by_storage.setdefault(key, []).append(n)
    for i, x in enumerate(meta_leaves):
        if isinstance(x, torch.Tensor):
            node = tracer.node_of.get(id(x))
            if node is None:  # e.g. nn.Parameter(t): a new object over the same storage
                node = next(
                    m
                    for m in reversed(by_storage[_storage_key(x)])
                    if tracer.keep[m].shape == x.shape and tracer.keep[m].stride() == x.stride()
                )
            leaf_node.setdefault(node, []).append(i)

    group_last: dict[int, int] = {}
    for k, (_, targs, tk, outs) in enumerate(tracer.ops):
        for n in _refs((targs, tk)) + [o for o in outs if o >= 0]:
            group_last[tracer.group_of[n]] = k
    closing: dict[int, list[int]] = {}
    for g, k in group_last.items():
        closing.setdefault(k, []).append(g)
    members: dict[int, list[int]] = {}
    for n, g in enumerate(tracer.group_of):
        members.setdefault(g, []).append(n)

    values: dict[int, torch.Tensor] = dict(tracer.consts)
    out_leaves: list[Any] = list(meta_leaves)
    peak = 0

    def finish(n: int) -> None:
        full = values[n]
        for i in leaf_node[n]:
            local = take_block(full.detach(), flat_specs[i], mesh, uneven=uneven, device=mesh.device, copy=True)
            out_leaves[i] = make_dtensor(local, flat_specs[i], mesh, full.shape)

    with torch.no_grad():
        for k, (func, targs, tk, outs) in enumerate(tracer.ops):
            res = func(*_resolve(targs, values), **_resolve(tk, values))
            res_t = res if isinstance(res, (tuple, list)) else (res,)
            for n, r in zip(outs, res_t):
                if n >= 0:
                    values[n] = r
            live = {_storage_key(v): v.untyped_storage().nbytes() for v in values.values()}
            peak = max(peak, sum(live.values()))
            for g in closing.get(k, ()):
                for n in members[g]:
                    if n in leaf_node and n in values:
                        finish(n)
                for n in members[g]:
                    values.pop(n, None)
    for n in list(values):  # leaves that are constants never touched by an op
        if n in leaf_node:
            finish(n)
    result = tree_util.tree_unflatten(treedef, out_leaves)
    if not return_stats:
        return result
    max_param = max((x.numel() * x.element_size() for x in meta_leaves if isinstance(x, torch.Tensor)), default=0)
    return result, InitStats(peak_bytes=peak, max_param_bytes=max_param, n_ops=len(tracer.ops))


def _refs(template: Any) -> list[int]:
    if isinstance(template, _Ref):
        return [template.node]
    if isinstance(template, (list, tuple)):
        return [n for t in template for n in _refs(t)]
    if isinstance(template, dict):
        return [n for t in template.values() for n in _refs(t)]
    return []

"""Compiling a captured graph that holds point-to-point transfers (``fs.sched``'s pipeline
step under ``fs.jit(backend="inductor")``): the transfers run eagerly, in program order,
between compiled regions of compute.

Why not compile the whole graph: a rank's point-to-point transfers pair up with its peers'
in program order, which no data dependency of one rank's graph shows (a receive's wait
depends on a send in another process). Inductor fuses and reorders kernels as the data
dependencies allow, so it moved a 1F1B rank's wait for a gradient before the send of the
activation its peer needed, and the ranks deadlocked.

How (:func:`split_at_transfers`): the graph's nodes are walked in program order. The
transfer nodes (each ``fshard.p2p_batch``, the ``getitem`` of its results, and the
``wait_tensor`` on them) are *eager* nodes, run one by one at their place; every run of
other nodes between two transfer nodes is one *region*, compiled as its own graph (its
inputs: the values it reads from the graph's inputs, earlier regions and transfers; its
outputs: the values later ones read). Adjacent compute is always one region, so a 1F1B
step has about one region per compute action of the schedule. So the order of the
transfers (posts and waits) is eager's exactly, and so is what each region computes; a
receive's data still moves while the regions before its wait run.

A collective of another kind (a data-parallel gradient all-reduce, the loss broadcast)
stays in its region when its wait is in the same region; one whose wait lies beyond a
transfer is run eagerly too, with its wait, at their places (a compiled region returns
no collective in flight). Within a region the collectives keep the order that fshard's
Inductor passes give every compile (``fshard/jit/passes/bucket.py``), and ranks holding the same
stage compile the same regions.

Compile time: regions whose code, input layouts and input overlaps are equal (the forward
of each microbatch, the backward of each but the first two) are compiled once and the
compiled callable is reused (:class:`Segmented`); a region of views and allocations only is
not compiled but run node by node. Every region is compiled before the first call runs
anything (:meth:`Segmented.compile_ahead`, on the traced fake tensors, which have the real
inputs' layouts and overlaps), so the ranks compile at the same time rather than one waiting
at a receive for its peer's compile; the ranks then agree that every one of them compiled
(:func:`agree`) before any transfer is posted, so a compile that fails on one rank stops
every rank at once, each naming the rank that failed and its error.

Which inputs of a region overlap in memory is part of what a region is compiled for
(:func:`overlaps`): AOTAutograd compiles a region that writes into an input as if no other
input overlapped it (unless the example inputs did), and a region called with overlapping
inputs would compute other values than eager. Inductor checks each input's shape and
strides at every call (``assert_size_stride``), but not overlaps: a region that mutates an
input compares its real inputs' overlaps with those it was compiled for at every call, and
compiles again when they differ (a compile in the middle of a call; its failure stops this
rank, and its peers at their next transfer after the process group's timeout).
"""

from __future__ import annotations

import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["split_at_transfers", "Segmented", "P2P_OPS", "agree", "overlaps", "spans_world"]

P2P_OPS = frozenset(
    {
        "fshard.p2p_batch.default",
        "_c10d_functional.batch_p2p_ops.default",
        "_c10d_functional.isend.default",
        "_c10d_functional.irecv.default",
    }
)
_C10D = torch.ops._c10d_functional
_WAIT = _C10D.wait_tensor.default
_GETITEM = operator.getitem
_ATEN = torch.ops.aten
# Nodes that do no arithmetic: a region of only these runs node by node, uncompiled.
_CHEAP = frozenset(
    {
        _ATEN.empty.memory_format,
        _ATEN.empty_like.default,
        _ATEN.new_empty.default,
        _ATEN.zeros.default,
        _ATEN.zeros_like.default,
        _ATEN.detach.default,
    }
)


def _is_p2p(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) in P2P_OPS


def _is_collective(node: fx.Node) -> bool:
    """A functional collective that ``wait_tensor`` completes (not the wait itself)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
        and node.target is not _WAIT
        and not _is_p2p(node)
    )


def _transfer_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes to run eagerly: transfers, their results' getitems and waits."""
    eager = set()
    for n in graph.nodes:
        if _is_p2p(n) or (
            n.target in (_GETITEM, _WAIT) and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in eager
        ):
            eager.add(n)
    return eager


def _loose(graph: fx.Graph, eager: set[fx.Node]) -> tuple[list[fx.Node], set[fx.Node]]:
    """Nodes run eagerly on their own rather than in a region, so that equal computations
    make equal regions: the detaches of the graph's inputs (the first forward's region would
    hold them, the later ones not), moved to the start (they read inputs only), and the
    receive buffers' templates (allocations read by transfers only). Returns the walking
    order and the loose nodes."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    early = [n for n in graph.nodes if n.target is _ATEN.detach.default and n.args[0].op == "placeholder"]
    templates = {
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target in _CHEAP
        and not n.all_input_nodes
        and n.users
        and all(u in eager for u in n.users)
    }
    moved = set(early)
    order = places + early + [n for n in graph.nodes if n.op != "placeholder" and n not in moved]
    return order, moved | templates


def _assign(order: list[fx.Node], eager: set[fx.Node]) -> dict[fx.Node, int]:
    """Segment index per call_function / get_attr node: eager nodes each their own, runs of
    others one region; a ``getitem`` of a region's node joins that region (a region returns
    tensors, not lists)."""
    seg, k, open_region = {}, -1, False
    for n in order:
        if n.op not in ("call_function", "get_attr"):
            continue
        if n in eager:
            k += 1
            seg[n] = k
            open_region = False
        elif n.target is _GETITEM and n.args[0] in seg and n.args[0] not in eager:
            seg[n] = seg[n.args[0]]
        else:
            if not open_region:
                k += 1
                open_region = True
            seg[n] = k
    return seg


def split_at_transfers(gm: fx.GraphModule) -> list[tuple[str, Any, list[fx.Node], list[fx.Node]]]:
    """Cuts ``gm`` into segments in program order.

    Returns:
      A list of ``(kind, what, inputs, outputs)``: ``kind`` ``"transfer"`` (a transfer, a
      getitem of its results or a wait of one) or ``"eager"`` (a node run on its own: see
      :func:`_loose`; a collective waited beyond its region, or its wait), ``what`` the one
      node to run; or ``"region"`` (``what``: a GraphModule of the region's nodes, whose
      placeholders are ``inputs`` and whose output list is ``outputs``, nodes of ``gm``).
      Node names in a region are fresh (by op, in order): equal computations give equal code.
    """
    graph = gm.graph
    transfers = _transfer_nodes(graph)
    order, loose = _loose(graph, transfers)
    eager = transfers | loose
    while True:  # a collective waited beyond its region runs eagerly, with its waits
        seg = _assign(order, eager)
        more = set()
        for n in graph.nodes:
            if _is_collective(n) and n not in eager:
                # The collective, the getitems of a coalesced one's results, and their waits.
                family = [n] + [u for u in n.users if u.target is _GETITEM]
                family += [w for f in family for w in f.users if w.target is _WAIT]
                if any(seg[f] != seg[n] for f in family):
                    more.update(family)
        if not more:
            break
        eager |= more
    order = {n: i for i, n in enumerate(order)}
    members: dict[int, list[fx.Node]] = {}
    for n, k in seg.items():
        members.setdefault(k, []).append(n)
    segments = []
    for k in sorted(members):
        nodes = sorted(members[k], key=order.__getitem__)
        inside = set(nodes)
        if nodes[0] in eager:
            ins = [a for a in nodes[0].all_input_nodes if a.op != "get_attr"]
            segments.append(("transfer" if nodes[0] in transfers else "eager", nodes[0], ins, [nodes[0]]))
            continue
        # get_attr nodes (constants) are copied into each region that reads them.
        ins = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and a not in ins:
                    ins.append(a)
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        segments.append(("region", _region_module(gm, nodes, ins, outs), ins, outs))
    return segments


def _region_module(gm: fx.GraphModule, nodes: list[fx.Node], ins: list[fx.Node], outs: list[fx.Node]) -> fx.GraphModule:
    g, env = fx.Graph(), {}
    for i, a in enumerate(ins):
        env[a] = g.placeholder(f"in_{i}")
        env[a].meta = dict(a.meta)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a constant of gm
            env[a] = g.get_attr(a.target)
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        if n.op == "get_attr":
            arg(n)
            continue
        new = g.create_node(n.op, n.target, fx.node.map_arg(n.args, arg), fx.node.map_arg(n.kwargs, arg))
        new.meta = dict(n.meta)
        env[n] = new
    g.output([env[o] for o in outs])
    return fx.GraphModule(gm, g)


def _trivial(region: fx.GraphModule) -> bool:
    """No arithmetic: only views, getitems, allocations and detaches."""
    for n in region.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is _GETITEM or n.target in _CHEAP:
            continue
        if isinstance(n.target, torch._ops.OpOverload) and n.target.is_view:
            continue
        return False
    return True


def _mutates(region: fx.GraphModule) -> bool:
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in region.graph.nodes
    )


class Segmented:
    """Runs ``gm`` as its segments: eager nodes as they are, each region through
    ``compile_region(region_gm, example_inputs) -> callable``, compiled ahead
    (:meth:`compile_ahead`) or at its first run; equal regions (same key and, for a region
    that writes into an input, the same overlaps of its inputs) share one compiled
    callable. Values are dropped after their last use.

    Args:
      gm: the captured graph (placeholders: the call's flat local tensors).
      compile_region: e.g. Inductor's compile with fshard's passes; it gets real tensors or
        the trace's fake ones.
      key: a digest of a region's code and inputs' layouts: regions of one key share a compile.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        compile_region: Callable[[fx.GraphModule, tuple], Callable],
        key: Callable[[fx.GraphModule, tuple], str],
    ) -> None:
        self._compile, self._key = compile_region, key
        graph = gm.graph
        places = [n for n in graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in graph.nodes if n.op == "output")
        segments = split_at_transfers(gm)
        slot: dict[fx.Node, int] = {n: i for i, n in enumerate(places)}
        for _, _, _, outs in segments:
            for o in outs:
                slot.setdefault(o, len(slot))
        self._n_inputs, self._n_slots = len(places), len(slot)
        # The last segment that reads each slot (the output reads at the end).
        last: dict[int, int] = {}
        for k, (_, _, ins, _) in enumerate(segments):
            for a in ins:
                last[slot[a]] = k
        finals = set()

        def out_slot(a):
            finals.add(slot[a])
            return _Slot(slot[a])

        self._result = fx.node.map_arg(out_node.args[0], out_slot)
        steps = []
        for k, (kind, what, ins, outs) in enumerate(segments):
            free = tuple(s for s, j in last.items() if j == k and s not in finals)
            in_slots, out_slots = tuple(slot[a] for a in ins), tuple(slot[o] for o in outs)
            if kind in ("transfer", "eager"):
                node = what
                args = fx.node.map_arg(
                    node.args, lambda a: _Slot(slot[a]) if a.op != "get_attr" else _attr(gm, a.target)
                )
                kwargs = fx.node.map_arg(
                    node.kwargs, lambda a: _Slot(slot[a]) if a.op != "get_attr" else _attr(gm, a.target)
                )
                steps.append(_EagerNode(node.target, args, kwargs, out_slots[0], free))
            elif _trivial(what):
                steps.append(_Interpreted(what, in_slots, out_slots, free))
            else:
                steps.append(_Region(self, what, in_slots, out_slots, free))
        self._steps = steps
        self.n_regions = sum(isinstance(s, _Region) for s in steps)
        self.n_transfer_nodes = sum(kind == "transfer" for kind, *_ in segments)
        self.n_eager = sum(isinstance(s, _EagerNode) for s in steps) - self.n_transfer_nodes
        self._compiled: dict[str, Callable] = {}
        self.compile_s = 0.0

    def compile_ahead(self) -> None:
        """Compiles every region before the call runs anything, on the traced fake tensors
        (the real inputs' shapes, strides and overlaps; no memory): a failure then comes
        before any transfer is posted, and the ranks compile at once instead of waiting at
        their receives for a peer's compile. A region whose traced inputs are not all tensors
        compiles at its first run."""
        for step in self._steps:
            if not isinstance(step, _Region) or step.fn is not None:
                continue
            vals = tuple(n.meta.get("val") for n in step.gm.graph.nodes if n.op == "placeholder")
            if all(isinstance(v, torch.Tensor) for v in vals):
                step.alias = overlaps(vals) if step.mutates else ()
                step.fn = self.compiled_once(step.gm, vals, step.alias)

    def compiled_once(self, region: fx.GraphModule, args: tuple, alias: tuple = ()) -> Callable:
        """The compiled callable of ``region`` for inputs like ``args`` whose overlapping
        pairs are ``alias`` (:func:`overlaps`), compiled at the first request."""
        key = f"{self._key(region, args)}/{alias}"
        fn = self._compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
            if alias:
                # AOTAutograd's own cache keys fake inputs by metadata; whether that holds what
                # they share is torch's detail (a check with Inductor, cold and warm, found it
                # served the right code), so regions compiled for overlaps skip it.
                import torch._functorch.config as functorch_config  # not imported by `import torch`

                with functorch_config.patch(enable_autograd_cache=False):
                    fn = self._compiled[key] = self._compile(region, args)
            else:
                fn = self._compiled[key] = self._compile(region, args)
            self.compile_s += time.perf_counter() - t0
        return fn

    @property
    def n_compiled(self) -> int:
        """Distinct regions compiled so far."""
        return len(self._compiled)

    def __call__(self, *args: Any) -> Any:
        env: list[Any] = [None] * self._n_slots
        env[: self._n_inputs] = args
        for step in self._steps:
            step.run(env)
        return _read(env, self._result)


class _Slot(int):
    """A value of the run (its slot) in an eager node's arguments or in the results."""


def _attr(gm: fx.GraphModule, target: str) -> Any:
    return operator.attrgetter(target)(gm)


def _read(env: list, a: Any) -> Any:
    if isinstance(a, _Slot):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_read(env, x) for x in a)
    if isinstance(a, dict):
        return {k: _read(env, v) for k, v in a.items()}
    return a


def _drop(env: list, free: tuple) -> None:
    for s in free:
        env[s] = None


class _EagerNode:
    __slots__ = ("target", "args", "kwargs", "out", "free")

    def __init__(self, target, args, kwargs, out: int, free: tuple) -> None:
        self.target, self.args, self.kwargs, self.out, self.free = target, args, kwargs, out, free

    def run(self, env: list) -> None:
        env[self.out] = self.target(*_read(env, self.args), **_read(env, self.kwargs))
        _drop(env, self.free)


class _Interpreted:
    __slots__ = ("gm", "ins", "outs", "free")

    def __init__(self, gm, ins: tuple, outs: tuple, free: tuple) -> None:
        self.gm, self.ins, self.outs, self.free = gm, ins, outs, free

    def run(self, env: list) -> None:
        res = self.gm(*[env[s] for s in self.ins])
        for s, v in zip(self.outs, res):
            env[s] = v
        _drop(env, self.free)


class _Region:
    __slots__ = ("owner", "gm", "ins", "outs", "free", "fn", "mutates", "alias")

    def __init__(self, owner: Segmented, gm, ins: tuple, outs: tuple, free: tuple) -> None:
        self.owner, self.gm, self.ins, self.outs, self.free, self.fn = owner, gm, ins, outs, free, None
        # Only a region that writes into an input depends on its inputs' overlaps (what
        # AOTAutograd assumes of them); the others' compiled code reads inputs only.
        self.mutates, self.alias = _mutates(gm), ()

    def run(self, env: list) -> None:
        args = [env[s] for s in self.ins]
        if self.fn is None:
            self.alias = overlaps(args) if self.mutates else ()
            self.fn = self.owner.compiled_once(self.gm, tuple(args), self.alias)
        elif self.mutates:
            alias = overlaps(args)
            if alias != self.alias:  # compiled for other overlaps: another compile (or a cached one)
                self.fn, self.alias = self.owner.compiled_once(self.gm, tuple(args), alias), alias
        res = self.fn(*args)
        for s, v in zip(self.outs, res):
            env[s] = v
        _drop(env, self.free)


def overlaps(args) -> tuple[tuple[int, int], ...]:
    """The pairs ``(i, j)``, ``i < j``, of tensor arguments whose memory overlaps: on one
    storage, with intersecting byte spans from their first to their last element (strided
    views that interleave count as overlapping: a recompile too many, never a wrong value;
    views of one storage in different dtypes compare in bytes). Works on real and fake
    tensors (the storage object, not its address, identifies it)."""
    by_storage: dict[int, list[int]] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.numel():
            by_storage.setdefault(a.untyped_storage()._cdata, []).append(i)
    pairs = []
    for idx in by_storage.values():
        if len(idx) < 2:
            continue
        # A sweep by start: each span is compared with those still open when it starts.
        spans = sorted((*_span(args[i]), i) for i in idx)
        open_: list[tuple[int, int]] = []  # (end, index)
        for start, end, i in spans:
            open_ = [(e, j) for e, j in open_ if e > start]
            pairs.extend((min(i, j), max(i, j)) for _, j in open_)
            open_.append((end, i))
    return tuple(sorted(pairs))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte offsets of ``t`` in its storage."""
    start = t.storage_offset()
    last = start + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    size = t.element_size()
    return start * size, (last + 1) * size


def spans_world(graph: fx.Graph, meshes: list) -> bool:
    """Whether every rank of the default group runs a step like this one: the process groups
    of the graph's transfers and collectives cover the world, or an input's mesh (its root,
    for a slice such as ``mesh["dp"]``) does. Collectives are symmetric (every member of a
    group has it in its graph), so the ranks of one pipeline decide alike."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        return False
    world = dist.get_world_size()
    for m in meshes:
        root = m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m
        if root.mesh.numel() == world:
            return True
    ranks: set[int] = set()
    for n in graph.nodes:
        if _is_p2p(n) or _is_collective(n):
            names = [a for a in n.args if isinstance(a, str)]
            if names:
                ranks.update(dist.get_process_group_ranks(_resolve_process_group(names[-1])))
    return len(ranks) == world


def agree(error: BaseException | None) -> dict[int, str]:
    """Every rank's outcome of compiling its regions, on every rank: ``{rank: error}`` of
    those that failed (empty when all compiled).

    The ranks of a pipeline must stop together: a rank that raised at its compile would
    leave its peers waiting at their first receive for the process group's timeout, and
    then report their timeout instead of the cause. One ``all_gather_object`` over the
    default group, before any transfer, after every region's compile (which runs no
    collective). The caller agrees only when the step's mesh spans the world (``make_mesh``
    does), so that every rank of the default group runs the same step.
    """
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {str(error).strip()[:500]}"
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return {} if mine is None else {0: mine}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {r: m for r, m in enumerate(every) if m is not None}

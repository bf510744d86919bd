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
Inductor passes give every compile (``fshard/_jit_comm.py``), and ranks holding the same
stage compile the same regions.

Compile time: regions whose code and input layouts are equal (the forward of each
microbatch, the backward of each but the first two) are compiled once and the compiled
callable is reused (:class:`Segmented`); a region of views and allocations only is not
compiled but run node by node. Regions that mutate nothing are compiled before the first
call runs anything (:meth:`Segmented.compile_ahead`, on inputs of the traced layouts), so
the ranks compile at the same time rather than one waiting at a receive for its peer's
compile, and such a compile failure comes before any transfer is posted.
"""

from __future__ import annotations

import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["split_at_transfers", "Segmented", "P2P_OPS"]

P2P_OPS = frozenset({"fshard.p2p_batch.default", "_c10d_functional.batch_p2p_ops.default",
                     "_c10d_functional.isend.default", "_c10d_functional.irecv.default"})
_C10D = torch.ops._c10d_functional
_WAIT = _C10D.wait_tensor.default
_GETITEM = operator.getitem
_ATEN = torch.ops.aten
# Nodes that do no arithmetic: a region of only these runs node by node, uncompiled.
_CHEAP = frozenset({_ATEN.empty.memory_format, _ATEN.empty_like.default, _ATEN.new_empty.default,
                    _ATEN.zeros.default, _ATEN.zeros_like.default, _ATEN.detach.default})


def _is_p2p(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) in P2P_OPS


def _is_collective(node: fx.Node) -> bool:
    """A functional collective that ``wait_tensor`` completes (not the wait itself)."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "_c10d_functional" and node.target is not _WAIT and not _is_p2p(node))


def _transfer_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes to run eagerly: transfers, their results' getitems and waits."""
    eager = set()
    for n in graph.nodes:
        if _is_p2p(n) or (n.target in (_GETITEM, _WAIT) and n.args and isinstance(n.args[0], fx.Node)
                          and n.args[0] in eager):
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
    templates = {n for n in graph.nodes
                 if n.op == "call_function" and n.target in _CHEAP and not n.all_input_nodes and n.users
                 and all(u in eager for u in n.users)}
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


def _region_module(gm: fx.GraphModule, nodes: list[fx.Node], ins: list[fx.Node],
                   outs: list[fx.Node]) -> fx.GraphModule:
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
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable for n in region.graph.nodes)


class Segmented:
    """Runs ``gm`` as its segments: eager nodes as they are, each region through
    ``compile_region(region_gm, example_inputs) -> callable`` at its first run (equal regions
    share one compiled callable). Values are dropped after their last use.

    Args:
      gm: the captured graph (placeholders: the call's flat local tensors).
      compile_region: e.g. Inductor's compile with fshard's passes.
      key: a digest of a region's code and inputs' layouts: regions of one key share a compile.
    """

    def __init__(self, gm: fx.GraphModule, compile_region: Callable[[fx.GraphModule, tuple], Callable],
                 key: Callable[[fx.GraphModule, tuple], str]) -> None:
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
                args = fx.node.map_arg(node.args, lambda a: _Slot(slot[a]) if a.op != "get_attr"
                                       else _attr(gm, a.target))
                kwargs = fx.node.map_arg(node.kwargs, lambda a: _Slot(slot[a]) if a.op != "get_attr"
                                         else _attr(gm, a.target))
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
        """Compiles, before the call runs anything, every region that mutates nothing, on
        inputs of the traced layouts: a failure then comes before any transfer is posted,
        and the ranks compile at once instead of waiting at their receives for a peer's
        compile. A region with an in-place op (gradient accumulation, a donated result)
        compiles at its first run instead, on the real inputs: whether those alias each
        other decides what Inductor's code for it may assume."""
        for step in self._steps:
            if not isinstance(step, _Region) or step.fn is not None or _mutates(step.gm):
                continue
            vals = [n.meta.get("val") for n in step.gm.graph.nodes if n.op == "placeholder"]
            if all(isinstance(v, torch.Tensor) for v in vals):
                step.fn = self.compiled_once(step.gm, tuple(
                    torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals))

    def compiled_once(self, region: fx.GraphModule, args: tuple) -> Callable:
        key = self._key(region, args)
        fn = self._compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
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
    __slots__ = ("owner", "gm", "ins", "outs", "free", "fn")

    def __init__(self, owner: Segmented, gm, ins: tuple, outs: tuple, free: tuple) -> None:
        self.owner, self.gm, self.ins, self.outs, self.free, self.fn = owner, gm, ins, outs, free, None

    def run(self, env: list) -> None:
        args = [env[s] for s in self.ins]
        if self.fn is None:
            self.fn = self.owner.compiled_once(self.gm, tuple(args))
        res = self.fn(*args)
        for s, v in zip(self.outs, res):
            env[s] = v
        _drop(env, self.free)

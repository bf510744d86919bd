"""Overlap scheduling of ``fs.jit``'s collectives on gloo: a deterministic post-grad FX pass
that moves each collective's start and wait against the step's compute, whose order it
keeps (:class:`OverlapCollectives`, run by :func:`fshard.jit.passes.bucket.collective_passes`).

What the captured FSDP step looks like without it (``bench/jit_step.py``'s step, 2 ranks):
fs.parallel's eager order, as traced. Forward: layer i+1's all-gather is issued before layer
i's compute and waited just before layer i+1 (prefetch depth 1): nothing to gain. Backward:
fshard keeps one collective in flight per gloo group (``fshard.comm.one_at_a_time``: two at
once corrupt torch 2.13 gloo's heap), so layer i's reduce-scatter (an all-to-all and a
local sum on gloo) is waited as soon as layer i-1's backward starts its regather prefetch:
the regather of layer i-2 hides behind layer i-1's backward, the reduce-scatter of layer i
behind nothing. The regather of the last layer is issued at the start of backward and
waited at once, the loss's all-reduce too.

What this pass does, for every collective in graph order (one chain per process group):

- start: as early as its inputs exist (its input-only producers, the casts and flattening
  of a shard, move with it), but after the previous collective on its group was waited
  (one in flight per group) and after every collective the graph started before it (every
  rank starts the same collectives in the same order, so no rank waits for a collective
  another rank has not started);
- wait: as late as possible, but early enough to leave the group's next collectives their
  share of the compute before they are due: the compute between this start and the
  earliest time a later collective of the group is needed is split between this one and
  those up to that one in proportion to their bytes (compute estimated from shapes only:
  matrix products by FLOPs, the rest by bytes); no earlier than the point where the next
  collective can start anyway; no later than its first use. Its pure epilogue (the local
  sum of gloo's reduce-scatter, views) moves with the wait.

So in backward each layer's compute now hides two collectives one after the other: the
previous layer's reduce-scatter (first part of the layer) and the next layer's regather
(second part). The forward (already prefetched) and the order of compute are unchanged:
peak memory grows by at most a reduce-scatter's buffers held across part of a layer.

Deterministic: a pure function of the graph (its order, shapes, dtypes, groups); no timing,
no collective while compiling. What keeps the ranks in step is that each rank keeps its own
graph's order of collectives and one collective in flight per group: the ranks of a group
issue the same collectives in the same order whatever the graphs around them (a pipeline's
stages compile different regions that share the pp group). All or nothing: a graph with a
collective this pass does not know how to move (several waits, a use before the wait, a
non-CPU tensor: NCCL's overlap is the job of torch's overlap scheduling) is left as it is.
Nodes that mutate or have side effects stay barriers that nothing crosses.

Inductor's ``reorder_for_peak_memory`` runs after this pass and would move every start back
next to its wait, undoing it, so ``collective_passes`` turns it off with the pass; the
opt-in Inductor test checks that the compiled code keeps the reduce-scatters behind matrix
products. What the pass gains on gloo is a hidden collective's wire time, which on one host
is small beside the compute; on more cores per rank there is more to hide. Its step time
and peak memory are measured in ``bench/README.md``, "Overlap scheduling of gloo
collectives".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fshard.jit import fx

__all__ = ["OverlapCollectives", "schedule"]

log = logging.getLogger("fshard.jit")

_C10D = torch.ops._c10d_functional
_WAIT = _C10D.wait_tensor.default
_ATEN = torch.ops.aten
# Matrix products, costed by FLOPs; everything else by the bytes it reads and writes.
_MATMULS = frozenset({_ATEN.mm.default, _ATEN.addmm.default, _ATEN.bmm.default, _ATEN.baddbmm.default})
# The ops that may move with a collective's start: they lay out its input (casts, padding,
# flattening, concatenation of shards), no compute.
_LAYOUT_OPS = frozenset(
    {
        "cat",
        "_to_copy",
        "clone",
        "constant_pad_nd",
        "detach",
        "convert_element_type",
        "copy",
        "zeros",
        "zeros_like",
        "new_zeros",
        "empty",
        "empty_like",
        "new_empty",
        "full",
        "alias",
        "lift_fresh_copy",
        "contiguous",
    }
)
# Relative costs (ns per FLOP and per byte): only their ratio matters (it splits a window of
# compute between collectives). Roughly one CPU core: 100 GFLOP/s, 10 GB/s.
_NS_PER_FLOP, _NS_PER_BYTE = 0.01, 0.1


class OverlapCollectives(CustomGraphPass):
    """Moves collectives' starts earlier and their waits later against compute (see the
    module docstring); an Inductor ``post_grad_custom_post_pass``."""

    def __repr__(self) -> str:  # part of fs.jit's compile key: stable across processes
        return f"OverlapCollectives(source={_SOURCE_HASH.hex()[:16]})"

    def uuid(self) -> Any:  # part of Inductor's cache key
        return ("fshard.OverlapCollectives", _SOURCE_HASH)

    def __call__(self, graph: torch.fx.Graph) -> None:
        schedule(graph)


_SOURCE_HASH = get_hash_for_files((__file__, fx.__file__))


_is_c10d = fx.is_c10d
_is_view = fx.is_view


def _is_random(node: torch.fx.Node) -> bool:
    """A node that draws random numbers: moved past another, it would draw another part of
    the generator's stream than eager (a dropout on a gathered activation)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _is_barrier(node: torch.fx.Node) -> bool:
    """A node nothing moves across: it mutates an argument or has another side effect
    (drawing random numbers aside)."""
    if node.op != "call_function" or _is_c10d(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    # Random ops are not barriers: no random op moves (``_is_random`` keeps them out of the
    # epilogues, and producers only lay out graph inputs), so moving a collective reorders
    # no two of them.
    return node.is_impure(impure_random=False)


def _group(node: torch.fx.Node) -> str:
    g = node.args[-1]
    return g.name if isinstance(g, torch.fx.Node) else str(g)


_nbytes = fx.largest_tensor_bytes


def _cost(node: torch.fx.Node) -> float:
    """Estimated run time of a compute node (relative units), from its shapes only."""
    if node.op != "call_function" or _is_view(node):
        return 0.0
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    out = node.meta.get("val")
    if node.target in _MATMULS and isinstance(out, torch.Tensor):
        a = node.args[-2]  # mm(a, b), addmm(c, a, b), bmm(a, b), baddbmm(c, a, b)
        a = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(a, torch.Tensor):
            return 2.0 * out.numel() * a.shape[-1] * _NS_PER_FLOP
    outs = out if isinstance(out, (list, tuple)) else [out]
    nbytes = sum(v.numel() * v.element_size() for v in list(outs) + vals if isinstance(v, torch.Tensor))
    return nbytes * _NS_PER_BYTE


def _movable(node: torch.fx.Node) -> torch.fx.Node | None:
    """The wait of collective ``node`` if this pass can move it, else ``None``."""
    if len(node.users) != 1:
        return None
    wait = next(iter(node.users))
    val = node.meta.get("val")
    if wait.target is not _WAIT or not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return None
    return wait


def _producers(coll: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that exist only to lay out ``coll``'s input from the graph's inputs (the
    casts, padding and flattening of a shard: views and ``_LAYOUT_OPS`` whose every input
    is a graph input or in the set and every use is in the set or ``coll``): they move with
    it. Anything else (compute, a gradient) stays where it is. In graph order."""
    chain: set[torch.fx.Node] = set()
    for n in coll.graph.nodes:  # graph order: a node's inputs are decided before it
        if n is coll:
            break
        if _is_barrier(n):  # it may mutate a graph input: what read the input before it stays before it
            chain.clear()
            continue
        if (
            n.op == "call_function"
            and not _is_c10d(n)
            and not _is_barrier(n)
            and n.all_input_nodes
            and (_is_view(n) or getattr(n.target, "_opname", None) in _LAYOUT_OPS)
            and all(a.op in ("placeholder", "get_attr") or a in chain for a in n.all_input_nodes)
        ):
            chain.add(n)
    # Keep only those whose every use is in the set or the collective (from the last one back).
    for n in reversed([m for m in coll.graph.nodes if m in chain]):
        if not n.users or any(u is not coll and u not in chain for u in n.users):
            chain.discard(n)
    return [n for n in coll.graph.nodes if n in chain]


def _epilogue(wait: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes computed from ``wait``'s result alone (views, gloo's local sum, a no-op
    wait on that sum; no matrix product): they move with the wait. In graph order."""
    ep: dict[torch.fx.Node, None] = {}  # ordered: graph order
    n = wait
    while n.next.op != "root":  # graph order after the wait: a node's inputs are decided before it
        n = n.next
        if n.op != "call_function" or not n.all_input_nodes:
            continue
        if (
            all(a is wait or a in ep for a in n.all_input_nodes)
            and not _is_barrier(n)
            and not _is_random(n)
            and n.target not in _MATMULS
            and (not _is_c10d(n) or n.target is _WAIT)
        ):
            ep[n] = None
    return list(ep)


def schedule(graph: torch.fx.Graph) -> bool:
    """Reorders ``graph`` in place (see the module docstring). Returns whether it did."""
    colls = [n for n in graph.nodes if _is_c10d(n) and n.target is not _WAIT]
    if not colls:
        return False
    waits = [_movable(c) for c in colls]
    if any(w is None for w in waits):
        return _leave("a collective with another use than one wait, or not on the CPU")
    moved: dict[torch.fx.Node, int] = {}  # moved node -> index of its collective
    pro, epi = [], []
    for k, (c, w) in enumerate(zip(colls, waits)):
        p, e = _producers(c), _epilogue(w)
        if any(n in moved for n in p + e):
            return _leave(f"{c.name}'s producers or epilogue are another collective's")
        for n in p + [c, w] + e:
            moved[n] = k
        pro.append(p)
        epi.append(e)

    # The fixed sequence: every other node, in its order; a moved node's original place is
    # "before fixed node opos[n]".
    fixed, opos = [], {}
    for n in graph.nodes:
        if n in moved:
            opos[n] = len(fixed)
        else:
            fixed.append(n)
    pos = {n: i for i, n in enumerate(fixed)}
    prefix = [0.0]
    for n in fixed:
        prefix.append(prefix[-1] + _cost(n))
    barriers = [i for i, n in enumerate(fixed) if _is_barrier(n)]

    def last_barrier_before(i):
        return max((b + 1 for b in barriers if b < i), default=0)

    def first_barrier_from(i):
        return min((b for b in barriers if b >= i), default=len(fixed) - 1)

    n_colls = len(colls)
    # Per collective: the earliest place for its start among the fixed nodes (``ready_fixed``),
    # the earlier collective whose result (waited, or its epilogue) its input needs
    # (``after_wait_of``), and the place of its result's first use (``due``), all within the
    # barriers around it.
    due, ready_fixed, after_wait_of = [], [], []
    for k, c in enumerate(colls):
        members = set(pro[k]) | {c}
        r, dep = last_barrier_before(opos[c]), None
        for m in members:
            for a in m.all_input_nodes:
                if a in members:
                    continue
                if a in moved:
                    dep = moved[a] if dep is None else max(dep, moved[a])
                else:
                    r = max(r, pos[a] + 1)
        ready_fixed.append(r)
        after_wait_of.append(dep)
        out = {waits[k]} | set(epi[k])
        d = first_barrier_from(opos[c])
        for m in out:
            for u in m.users:
                if u not in out:
                    d = min(d, pos[u] if u in pos else opos[u])
        due.append(d)
    chains: dict[str, list[int]] = {}
    for k, c in enumerate(colls):
        chains.setdefault(_group(c), []).append(k)
    nxt = {}
    for ks in chains.values():
        for a, b in zip(ks, ks[1:]):
            nxt[a] = b

    def point(start, end, share):
        """The first place in [start, end] with ``share`` of the compute of [start, end) before it."""
        target = prefix[start] + share * (prefix[end] - prefix[start])
        for i in range(start, end + 1):
            if prefix[i] >= target:
                return i
        return end

    start, wait_at = [0] * n_colls, [0] * n_colls
    last_wait: dict[str, int] = {}
    last_start = 0
    for k, c in enumerate(colls):
        g = _group(c)
        s = max(ready_fixed[k], last_start, last_wait.get(g, 0))
        if after_wait_of[k] is not None:
            s = max(s, wait_at[after_wait_of[k]])
        if s > due[k]:
            return _leave(f"no place to start {c.name} before its first use")
        # Later collectives of this group: the earliest one to be due bounds this one's share.
        rest = chains[g][chains[g].index(k) :]
        end = min(due[j] for j in rest)
        upto = max(j for j in rest if due[j] == end)
        if upto == k:  # every later one is due after this one
            w = due[k]
        else:
            w = point(s, end, _nbytes(c) / max(1, sum(_nbytes(colls[j]) for j in rest if j <= upto)))
        j = nxt.get(k)
        if j is not None and after_wait_of[j] != k:
            w = max(w, min(ready_fixed[j], due[k]))  # the next one cannot start before then anyway
        w = min(max(w, s), due[k])
        start[k], wait_at[k] = s, w
        log.debug(
            "overlap: %s (%d B) was [%d, %d], ready %d, due %d -> [%d, %d]",
            c.name,
            _nbytes(c),
            opos[c],
            opos[waits[k]],
            ready_fixed[k],
            due[k],
            s,
            w,
        )
        last_start, last_wait[g] = s, w

    # Rebuild the order: before fixed node i, the waits and starts placed there, in the
    # order they were decided (a collective's start before its wait, a wait before the
    # starts decided after it).
    events: dict[int, list[tuple[int, list[torch.fx.Node]]]] = {}
    for k, c in enumerate(colls):
        events.setdefault(start[k], []).append((2 * k, pro[k] + [c]))
    for k in range(n_colls):
        events.setdefault(wait_at[k], []).append((2 * k + 1, [waits[k]] + epi[k]))
    order = []
    for i, n in enumerate(fixed):
        for _, nodes in sorted(events.get(i, []), key=lambda e: e[0]):
            order.extend(nodes)
        order.append(n)
    if order == list(graph.nodes):
        return False
    if not _valid(order, colls, waits):
        return _leave("the new order would break the collectives' order or a dependency")
    _relink(graph, order)
    graph.lint()
    return True


def _leave(why: str) -> bool:
    log.info("fs.jit: collective overlap scheduling leaves the graph as it is: %s", why)
    return False


def _valid(order: list[torch.fx.Node], colls: list[torch.fx.Node], waits: list[torch.fx.Node]) -> bool:
    """Whether ``order`` starts the collectives in their graph order, waits for each one
    before the next on its group starts, and computes every node after its inputs."""
    at = {n: i for i, n in enumerate(order)}
    if [at[c] for c in colls] != sorted(at[c] for c in colls):
        return False
    last: dict[str, int] = {}
    for c, w in zip(colls, waits):
        g = _group(c)
        if at[c] < last.get(g, -1) or at[w] < at[c]:
            return False
        last[g] = at[w]
    return all(at[a] < at[n] for n in order for a in n.all_input_nodes)


def _relink(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    """Puts ``graph``'s nodes in ``order`` (every node once)."""
    assert len(order) == len(graph.nodes) and set(order) == set(graph.nodes)
    anchor = graph._root
    for n in order:
        anchor.append(n)
        anchor = n

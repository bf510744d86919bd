"""Backward split in two: input gradients now (I), weight gradients later (W).

Zero-bubble schedules run a stage's backward as I (what the previous stage waits
for) and, later, W (what only the optimizer needs). :class:`SplitBackward` does that
with autograd on the graph the forward built, without running the forward, or the
input-gradient chain, twice. The executor (:mod:`fshard.sched.runtime`) calls it for
``I`` actions and calls :meth:`SplitBackward.weight_grads` for the matching ``W``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["SplitBackward", "differentiable", "edge_of", "grad", "wants_grad"]


class SplitBackward:
    """One stage's backward in two passes: the input gradient now (I), weights later (W).

    I runs autograd from the stage output to its input only, with pre-hooks that
    capture the gradient reaching each *frontier* node: a node on a path to the input
    with an edge that leaves those paths toward a parameter. W starts from the
    captured gradients (``GradientEdge``) and goes to the parameters only, so neither
    the forward nor the input-gradient chain is recomputed. Frontier nodes that reach
    a common parameter form one group; W of a group may pass through one of its
    frontier nodes on the way from another, so each one's incoming gradient is pinned
    to its captured value (the idea of torch.distributed.pipelining's
    ``stage_backward_weight``, written anew).

    Parameters are identified by the graph edge through which the stage used them (a
    leaf's AccumulateGrad, or output k of the node that made a tensor), not by node:
    one FSDP gather node makes all of a stage's gathered parameters, and keying by
    that node would merge every frontier node into one group, so that W would re-run
    the input path (and its collectives) between them.

    Args:
        root: the stage output (or loss) with its graph.
        seed: the gradient of ``root``.
        x: the stage input leaf, or None when no input gradient is wanted.
        leaves: what to differentiate for each parameter: the leaf itself, or the
            tensor (or its ``GradientEdge``) the stage used it as, e.g. its gathered
            form; None where no gradient is wanted.

    Attributes:
        input_grad: d root / d x (None when x is None or root does not depend on it).
    """

    def __init__(self, root: torch.Tensor, seed: torch.Tensor, x: torch.Tensor | None, leaves: Sequence[Any]) -> None:
        self._leaves = list(leaves)
        self._captured: dict[Any, tuple] = {}
        self._groups: list[tuple[list[Any], list[int]]] = []
        self._full: tuple[torch.Tensor, torch.Tensor] | None = (root, seed)
        self.input_grad: torch.Tensor | None = None
        if x is None or root.grad_fn is None:
            if x is not None and root.requires_grad:  # root is x itself
                self.input_grad = grad(root, [x], seed, retain=True)[0]
            return  # no input gradient to split off: W is the whole backward
        children, post = _walk(root.grad_fn)
        x_node = edge_of(x)[0]
        if x_node not in children:
            return
        params = {edge_of(p): i for i, p in enumerate(leaves) if p is not None}
        none: frozenset[int] = frozenset()

        def via(k: Any, nr: int) -> frozenset[int]:  # params reached through edge (k, nr)
            i = params.get((k, nr))
            return frozenset((i,)) if i is not None else reach.get(k, none)

        on_path: set[Any] = set()
        reach: dict[Any, frozenset[int]] = {}  # params a node reaches off the input paths
        for n in post:
            if n is x_node or any(k in on_path for k, _ in children[n]):
                on_path.add(n)
            else:
                reach[n] = none.union(*(via(k, nr) for k, nr in children[n]))
        # In post-order, not set order: W issues any collectives of the weight path
        # (FSDP's reduce-scatters) group by group, and every rank must issue them alike.
        frontier = {
            n: none.union(*(via(k, nr) for k, nr in children[n] if k not in on_path)) for n in post if n in on_path
        }
        self._groups = _group({n: ps for n, ps in frontier.items() if ps})
        self._full = None
        handles = [n.register_prehook(_capture(self._captured, n)) for nodes, _ in self._groups for n in nodes]
        try:
            self.input_grad = grad(root, [x], seed, retain=True)[0]
        finally:
            for h in handles:
                h.remove()

    def captured_gradients(self) -> list[torch.Tensor]:
        """The gradients I captured at the frontier nodes, held until :meth:`weight_grads`
        (what a microbatch holds between its I and its W besides the saved activations)."""
        return [g for grads in self._captured.values() for g in grads if g is not None]

    def weight_grads(self) -> tuple[list[int], list[torch.Tensor | None]]:
        """Runs W once; returns (leaf indices, their gradients) and frees the graph."""
        if self._full is not None:
            (root, seed), self._full = self._full, None
            wrt = [i for i, p in enumerate(self._leaves) if p is not None]
            return wrt, list(grad(root, [self._leaves[i] for i in wrt], seed))
        idx: list[int] = []
        out: list[torch.Tensor | None] = []
        for nodes, params in self._groups:
            edges = [
                (torch.autograd.graph.GradientEdge(n, k), g)
                for n in nodes
                for k, g in enumerate(self._captured[n])
                if g is not None
            ]
            if not edges:
                continue
            pins = [n.register_prehook(lambda _, v=self._captured[n]: v) for n in nodes] if len(nodes) > 1 else []
            try:
                got = torch.autograd.grad(
                    [e for e, _ in edges],
                    [self._leaves[i] for i in params],
                    [g for _, g in edges],
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                for h in pins:
                    h.remove()
            idx += params
            out += got
        self._groups, self._captured = [], {}
        return idx, out


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def wants_grad(p: Any) -> bool:
    return isinstance(p, torch.Tensor) and p.requires_grad


def grad(
    root: torch.Tensor, wrt: list[torch.Tensor], seed: torch.Tensor, retain: bool = False
) -> tuple[torch.Tensor | None, ...]:
    if not wrt or not root.requires_grad:
        return (None,) * len(wrt)
    return torch.autograd.grad([root], wrt, [seed], retain_graph=retain, allow_unused=True)


def edge_of(t: Any) -> tuple[Any, int]:
    """``(node, output_nr)``: where the gradient of ``t`` enters the graph.

    ``t`` is a tensor (a leaf: its AccumulateGrad, input 0) or a ``GradientEdge``.
    """
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return t.node, t.output_nr
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _walk(root: Any) -> tuple[dict[Any, list[tuple[Any, int]]], list[Any]]:
    """Edges ``(child, input_nr)`` of every node below ``root``, and the nodes in
    post-order (children first)."""
    children: dict[Any, list[tuple[Any, int]]] = {}
    post: list[Any] = []
    stack = [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            post.append(n)
        elif n not in children:
            children[n] = [(k, nr) for k, nr in n.next_functions if k is not None]
            stack.append((n, True))
            stack.extend((k, False) for k, _ in children[n] if k not in children)
    return children, post


def _group(frontier: dict[Any, frozenset[int]]) -> list[tuple[list[Any], list[int]]]:
    """Frontier nodes merged into groups that share no parameter."""
    groups: list[tuple[list[Any], set[int]]] = []
    for n, ps in frontier.items():
        merged: tuple[list[Any], set[int]] = ([n], set(ps))
        for g in [g for g in groups if g[1] & ps]:
            groups.remove(g)
            merged[0].extend(g[0])
            merged[1].update(g[1])
        groups.append(merged)
    return [(nodes, sorted(ps)) for nodes, ps in groups]


def _capture(store: dict[Any, tuple], node: Any) -> Callable[[tuple], None]:
    def hook(grad_outputs: tuple) -> None:
        store[node] = grad_outputs

    return hook

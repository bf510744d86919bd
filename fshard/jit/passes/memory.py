"""Peak memory of ``fs.jit``'s Inductor compile: keep a whole step's buffers alive no longer
than eager does (:func:`memory_passes`, config patches that ``fs.jit(options=...)`` overrides).

A captured step is forward, backward and optimizer in one graph, so a choice that Inductor
makes for a kernel's locality can move an allocation across the whole backward. Two do
(``bench/README.md``, "fs.jit", the peak-memory target, has the counts per rank):

- ``reorder_for_locality`` (off here): it moves kernels next to their consumers across
  forward, backward and optimizer and keeps their buffers alive meanwhile.
- Concatenation into a collective's flat buffer (:class:`LateConcat`, on). On CPU Inductor
  lowers every ``aten.cat`` to a ``ConcatKernel``: the producers of its inputs that are
  Inductor kernels write straight into slices of the output, so the output is allocated
  where the *first* such producer runs. ``fs.parallel``'s DDP bucket is the concatenation
  of every layer's gradients, built by eager after the last layer's backward; compiled as
  is, it would be allocated (nearly all of the model's gradients) before the first layer's
  backward, because that layer's bias and norm gradients (sums: Inductor kernels) are
  written into it. The matrix gradients (``mm``: extern kernels) are still copied in at the
  concatenation as in eager, so nothing is saved for the buffer held across the backward:
  the replicate step's peak rises above eager's. FSDP's per-layer flat gradient (the
  reduce-scatter's input) is the same pattern over one layer's backward.
  :class:`LateConcat` makes such a concatenation one opaque ``fshard::concat`` call
  (``torch.cat``), which allocates its output where the graph concatenates, as eager does;
  the small gradients it no longer writes in place are copied once more.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fshard.jit import fx

__all__ = ["memory_passes", "LateConcat"]


def memory_passes() -> dict[str, Any]:
    """Inductor config patches for ``fs.jit``'s peak memory (see the module docstring).

    Returns:
      A dict for ``torch._inductor.config.patch``; ``fs.jit(options=...)``'s entries replace
      its entries: ``{"reorder_for_locality": True}`` is Inductor's default ordering,
      ``{"post_grad_custom_pre_pass": None}`` lets Inductor concatenate in place again.
    """
    return {"reorder_for_locality": False, "post_grad_custom_pre_pass": LateConcat()}


@torch.library.custom_op("fshard::concat", mutates_args=())
def _concat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat``, opaque to Inductor: it allocates its output when it runs."""
    return torch.cat(tensors, dim)


@_concat.register_fake
def _(tensors, dim):
    return torch.cat(tensors, dim)


_CAT = torch.ops.aten.cat.default


class LateConcat(CustomGraphPass):
    """A ``post_grad_custom_pre_pass``: every ``aten.cat`` whose result goes (through views)
    into a collective and that has an input computed in the graph becomes one
    ``fshard::concat`` call (see the module docstring). A concatenation of graph inputs
    only (FSDP's forward all-gather of parameter shards) is left to Inductor: nothing
    is written into it early. Deterministic: the graph alone decides."""

    def __repr__(self) -> str:  # part of fs.jit's compile key: stable across processes
        return f"LateConcat(source={_SOURCE_HASH.hex()[:16]})"

    def uuid(self) -> Any:  # part of Inductor's cache key
        return ("fshard.LateConcat", _SOURCE_HASH)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not _CAT or not _to_collective(node):
                continue
            parts = node.args[0]
            if all(_is_input(p) for p in parts):
                continue
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            with graph.inserting_before(node):
                late = graph.call_function(torch.ops.fshard.concat.default, (list(parts), dim))
            late.meta = dict(node.meta)
            node.replace_all_uses_with(late)
            graph.erase_node(node)


_SOURCE_HASH = get_hash_for_files((__file__, fx.__file__))


_is_view = fx.is_view


def _is_input(node: Any) -> bool:
    """Whether ``node`` is a graph input or a view of one (nothing to write in place)."""
    while isinstance(node, torch.fx.Node) and node.op != "placeholder":
        if not _is_view(node) or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]
    return isinstance(node, torch.fx.Node)


def _to_collective(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value goes, directly or through views, into a functional collective."""
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if isinstance(u.target, torch._ops.OpOverload) and u.target.namespace == "_c10d_functional":
            return True
        if _is_view(u):
            todo.extend(u.users)
    return False

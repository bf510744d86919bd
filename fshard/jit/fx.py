"""fx-graph predicates and sizes that ``fs.jit``'s capture and Inductor passes share.

The passes' cache keys hash this file with their own (``get_hash_for_files``): a change here
recompiles what they touched.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["is_c10d", "is_view", "largest_tensor_bytes", "result_or_input_bytes"]


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` aliases its input: a ``getitem`` of a tuple, or an ATen view op."""
    return node.target is operator.getitem or (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def is_c10d(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functional collective (or its wait)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
    )


def result_or_input_bytes(node: torch.fx.Node) -> int:
    """A collective's size: the larger of its result and its (first) input, in bytes
    (an all-gather's result, a reduce-scatter's input)."""
    vals = (node.meta["val"], node.all_input_nodes[0].meta["val"])
    return max(v.numel() * v.element_size() for v in vals)


def largest_tensor_bytes(node: torch.fx.Node) -> int:
    """The largest tensor among ``node``'s result and all its inputs, in bytes (0 if none):
    what a node keeps alive while it runs."""
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    return max((v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)), default=0)

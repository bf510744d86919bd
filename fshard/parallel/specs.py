"""Spec rules: which parameter gets which ``P``. Plans are data.

``fsdp_specs`` shards every parameter over one axis (dim 0 by default, uneven dims
allowed: FSDP pads internally); ``replicate_specs`` replicates; ``hsdp_specs`` shards
over one axis and replicates over another; ``match_specs`` maps path regexes to specs.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from fshard import tree as tree_util
from fshard.mesh.spec import P, PartitionSpec

__all__ = ["fsdp_specs", "replicate_specs", "hsdp_specs", "match_specs"]


def fsdp_specs(
    params: Any,
    axis: str | Sequence[str] = "fsdp",
    *,
    dim: int = 0,
    placement_fn: Callable[[str, torch.Tensor], int] | None = None,
) -> Any:
    """``P`` per leaf that shards dim ``dim`` (or ``placement_fn(path, leaf)``) over ``axis``.

    Scalars (0-d leaves) are replicated. Shard them with ``fs.shard(..., uneven=True)``:
    dims that ``axis`` does not divide are cut like ``torch.chunk``.

    Args:
      params: pytree of tensors (global shapes).
      axis: mesh axis, or a tuple of axes (sharded over their product).
      dim: the dim to shard (default 0).
      placement_fn: ``(path, leaf) -> dim`` per leaf, overriding ``dim`` (e.g. the
        largest dim).

    Returns:
      A pytree of ``P`` with the structure of ``params``.
    """

    def one(path: str, x: Any) -> PartitionSpec:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return P()
        d = placement_fn(path, x) if placement_fn is not None else dim
        entries: list[Any] = [None] * x.dim()
        entries[d] = axis
        return P(*entries)

    return tree_util.tree_map_with_path(one, params)


def replicate_specs(params: Any) -> Any:
    """``P()`` for every leaf (DDP: parameters identical on every rank)."""
    return tree_util.tree_map(lambda x: P(), params)


def hsdp_specs(params: Any, shard_axis: str, replicate_axis: str, *, dim: int = 0) -> Any:
    """Sharded over ``shard_axis``, replicated over ``replicate_axis`` (which specs leave out)."""
    del replicate_axis  # replicated axes are the ones a spec does not name
    return fsdp_specs(params, shard_axis, dim=dim)


def match_specs(params: Any, rules: Sequence[tuple[str, PartitionSpec]], default: PartitionSpec | None = P()) -> Any:
    """The spec of the first rule whose regex fully matches a leaf's path (``layers.0.wq``).

    Args:
      params: pytree of tensors.
      rules: ``[(regex, P), ...]``, tried in order.
      default: spec for unmatched leaves; ``None`` makes an unmatched leaf an error.

    Returns:
      A pytree of ``P``.

    Raises:
      ValueError: an unmatched leaf with ``default=None`` (the path and the rules are named).
    """
    compiled = [(re.compile(rx), spec) for rx, spec in rules]

    def one(path: str, x: Any) -> PartitionSpec:
        for rx, spec in compiled:
            if rx.fullmatch(path):
                return spec
        if default is None:
            raise ValueError(f"match_specs: no rule matches '{path}'; rules: {[r for r, _ in rules]}.")
        return default

    return tree_util.tree_map_with_path(one, params)

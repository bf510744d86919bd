"""Sizes per rank from fshard's own spec rules: shards, gather buffers, pipeline stages.

The planner never writes a separate formula for what a layout sends or holds: it builds
each layer's parameters as meta tensors, asks the spec rules the training code uses
(each axis rule's, :data:`fshard.plan.axes.RULES`: ``fs.parallel.tp_specs``,
``fsdp_specs``; else ``replicate_specs``) for their specs, and cuts
the shapes the way ``fs.shard`` and the FSDP flat buffer do (``torch.chunk`` blocks per
axis, the gathered dim padded to ``ceil(N / n)`` rows per rank).
"""

from __future__ import annotations

import functools
import math

import torch

from fshard.parallel.layout import Layout
from fshard.plan.axes import RULES
from fshard.plan.axes.base import LayerShards
from fshard.plan.axes.pp import stage_layers
from fshard.plan.model import LayerDesc, ModelDesc

__all__ = ["LayerShards", "layer_shards", "stage_layers", "stage_shards"]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def _shards(
    params: tuple[tuple[str, tuple[int, ...]], ...],
    tp_plan: tuple[tuple[str, str], ...],
    sizes: tuple[tuple[str, int], ...],
) -> LayerShards:
    from fshard.parallel.specs import replicate_specs

    with torch.device("meta"):
        tree = {path: torch.empty(shape) for path, shape in params}
    size = dict(sizes)
    specs = next((sp for r in RULES if (sp := r.param_specs(tree, dict(tp_plan), size)) is not None), None)
    if specs is None:
        specs = replicate_specs(tree)
    gather = next(r.name for r in RULES if r.gathers_params)  # one axis: FSDP's flat buffer
    n_gather = size.get(gather, 1)
    local = flat = full = over_ep = 0
    for path, shape in params:
        spec = specs[path]
        full += math.prod(shape)
        kept = list(shape)  # after the axes that are not gathered (tp) only
        mine = list(shape)  # after every axis
        gather_dim = None
        for d in range(len(shape)):
            axes = [a for a in (spec.dim_axes(d) if d < len(spec) else ()) if size.get(a, 1) > 1]
            for a in axes:  # major to minor, as fs.shard cuts; rank 0 holds the first (largest) block
                mine[d] = _ceil(mine[d], size[a])
                if a != gather:
                    kept[d] = _ceil(kept[d], size[a])
                else:
                    gather_dim = d
        local += math.prod(mine)
        seg = math.prod(mine)
        if n_gather > 1:
            if gather_dim is None:  # a scalar or a leaf the rules leave whole: gathered as one row
                seg = math.prod(kept)
            else:
                rows = _ceil(kept[gather_dim], n_gather)
                seg = rows * math.prod(kept) // kept[gather_dim]
            flat += seg
        if size.get("ep", 1) > 1 and "ep" not in spec.axes():
            over_ep += seg
    gathered = flat * n_gather if n_gather > 1 else local
    return LayerShards(local=local, flat=flat, gathered=gathered, full=full, over_ep=over_ep)


def layer_shards(layer: LayerDesc, layout: Layout) -> LayerShards:
    """The sizes of one ``layer`` on one rank under ``layout`` (see :class:`LayerShards`)."""
    sizes = tuple((r.name, layout.size(r.name)) for r in RULES if r.shards_params)
    return _shards(layer.params, layer.tp_plan, sizes)


def stage_shards(model: ModelDesc, layout: Layout, parts: list[tuple[int, int]]) -> LayerShards:
    """The sizes of one pipeline stage (its layers together: one StageFSDP group)."""
    tot = LayerShards(0, 0, 0, 0)
    for i, k in parts:
        tot = tot + layer_shards(model.layers[i], layout) * k
    return tot

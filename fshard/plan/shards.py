"""Sizes per rank from fshard's own spec rules: shards, gather buffers, pipeline stages.

The planner never writes a separate formula for what a layout sends or holds: it builds
each layer's parameters as meta tensors, asks the spec rules the training code uses
(``fs.parallel.fsdp_specs``, ``tp_specs``, ``replicate_specs``) for their specs, and cuts
the shapes the way ``fs.shard`` and the FSDP flat buffer do (``torch.chunk`` blocks per
axis, the gathered dim padded to ``ceil(N / n)`` rows per rank).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from fshard.plan.layout import Layout
from fshard.plan.model import LayerDesc, ModelDesc

__all__ = ["LayerShards", "layer_shards", "stage_layers", "stage_shards"]


@attrs.frozen
class LayerShards:
    """One layer's parameter sizes on one rank (rank 0 of every axis: the largest blocks).

    Attributes:
      local: elements this rank stores (its shard over every axis).
      flat: elements this rank contributes to the FSDP all-gather (padded rows); 0 when
        the layer is not sharded over fsdp.
      gathered: elements after the FSDP gather (still split over tp): the flat buffer
        of all fsdp ranks, ``flat * fsdp``; ``local`` when nothing is gathered.
      full: elements of the whole layer (no axis).
    """

    local: int
    flat: int
    gathered: int
    full: int


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def _shards(
    params: tuple[tuple[str, tuple[int, ...]], ...], tp_plan: tuple[tuple[str, str], ...], tp: int, fsdp: int
) -> LayerShards:
    from fshard.parallel.specs import fsdp_specs, replicate_specs
    from fshard.parallel.tp import tp_specs

    with torch.device("meta"):
        tree = {path: torch.empty(shape) for path, shape in params}
    fsdp_axis = "fsdp" if fsdp > 1 else None
    if tp > 1:
        specs = tp_specs(tree, dict(tp_plan), "tp", fsdp_axis=fsdp_axis)
    elif fsdp_axis:
        specs = fsdp_specs(tree, "fsdp")
    else:
        specs = replicate_specs(tree)
    sizes = {"tp": tp, "fsdp": fsdp}
    local = flat = full = 0
    for path, shape in params:
        spec = specs[path]
        full += math.prod(shape)
        tp_local = list(shape)  # after the non-gathered axes (tp) only
        mine = list(shape)  # after every axis
        fsdp_dim = None
        for d in range(len(shape)):
            axes = [a for a in (spec.dim_axes(d) if d < len(spec) else ()) if sizes.get(a, 1) > 1]
            for a in axes:  # major to minor, as fs.shard cuts; rank 0 holds the first (largest) block
                mine[d] = _ceil(mine[d], sizes[a])
                if a != "fsdp":
                    tp_local[d] = _ceil(tp_local[d], sizes[a])
                else:
                    fsdp_dim = d
        local += math.prod(mine)
        if fsdp > 1:
            if fsdp_dim is None:  # a scalar or a leaf the rules leave whole: gathered as one row
                flat += math.prod(tp_local)
            else:
                rows = _ceil(tp_local[fsdp_dim], fsdp)
                flat += rows * math.prod(tp_local) // tp_local[fsdp_dim]
    gathered = flat * fsdp if fsdp > 1 else local
    return LayerShards(local=local, flat=flat, gathered=gathered, full=full)


def layer_shards(layer: LayerDesc, layout: Layout) -> LayerShards:
    """The sizes of one ``layer`` on one rank under ``layout`` (see :class:`LayerShards`)."""
    return _shards(layer.params, layer.tp_plan, layout.tp, layout.fsdp)


def stage_layers(model: ModelDesc, n_stages: int) -> list[list[tuple[int, int]]]:
    """Per pipeline stage, ``(layer index, how many)`` of the layers it runs, in order.

    The repeated layer kind (the blocks) is cut into ``n_stages`` contiguous runs as even
    as possible (``examples/train_lm.py``'s cut: stage s gets blocks
    ``[s * L // n, (s + 1) * L // n)``); the layers before it go to the first stage, the
    layers after it to the last.
    """
    rep = model.repeated
    L = model.layers[rep].count
    cuts = [s * L // n_stages for s in range(n_stages + 1)]
    out: list[list[tuple[int, int]]] = []
    for s in range(n_stages):
        parts: list[tuple[int, int]] = []
        if s == 0:
            parts += [(i, model.layers[i].count) for i in range(rep)]
        if cuts[s + 1] > cuts[s]:
            parts.append((rep, cuts[s + 1] - cuts[s]))
        if s == n_stages - 1:
            parts += [(i, model.layers[i].count) for i in range(rep + 1, len(model.layers))]
        out.append(parts)
    return out


def stage_shards(model: ModelDesc, layout: Layout, parts: list[tuple[int, int]]) -> LayerShards:
    """The sizes of one pipeline stage (its layers together: one StageFSDP group)."""
    tot = [0, 0, 0, 0]
    for i, k in parts:
        s = layer_shards(model.layers[i], layout)
        for j, v in enumerate((s.local, s.flat, s.gathered, s.full)):
            tot[j] += v * k
    return LayerShards(*tot)

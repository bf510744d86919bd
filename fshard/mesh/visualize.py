"""``visualize_sharding``: which rank holds which block, like JAX's debug view.

Computed from the spec and the mesh alone (no communication), so any rank can call
it; it prints where it is called (guard with ``if rank == 0`` in scripts).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fshard.mesh.mesh import Mesh
from fshard.mesh.placement import local_block
from fshard.mesh.sharding import _mesh_of, spec_of
from fshard.mesh.spec import PartitionSpec
from fshard.runtime.process import is_rank0

__all__ = ["visualize_sharding", "sharding_grid", "rank_grid"]


def rank_grid(mesh: Mesh) -> torch.Tensor:
    """The mesh's global ranks as a plain tensor of the mesh's shape.

    Under ``fs.simulate`` the device mesh's rank tensor is a per-rank tensor (the same on
    every rank); indexing it gives per-rank values, so the grid is read from one rank's copy.
    """
    ranks = mesh.device_mesh.mesh
    local = getattr(ranks, "_local_tensors", None)
    if local is not None:
        ranks = next(iter(local.values()))
    return ranks


def sharding_grid(shape, spec: PartitionSpec, mesh: Mesh) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """``{((start, stop) per dim): [global ranks holding it]}`` for every block of the layout.

    A dim its axes do not divide is cut like ``torch.chunk`` (an uneven DTensor's blocks);
    where they divide it, both cuts are the same.
    """
    grid: dict[tuple[tuple[int, int], ...], list[int]] = {}
    ranks = rank_grid(mesh)
    uneven = any(shape[d] % mesh.axis_size(spec.dim_axes(d)) for d in range(len(spec)) if spec.dim_axes(d))
    for idx in itertools.product(*(range(s) for s in ranks.shape)):
        coord = dict(zip(mesh.axis_names, idx))
        block = local_block(spec, shape, mesh, coord, uneven=uneven)
        key = tuple((s.start, s.stop) for s in block)
        grid.setdefault(key, []).append(int(ranks[idx]))
    return grid


def visualize_sharding(x: Any, *, mesh: Mesh | None = None, use_color: bool = True) -> str:
    """Prints (on rank 0) and returns (on every rank) a table of which ranks hold which block of ``x``.

    Every rank computes the table from ``x``'s metadata alone (no collective), so a call
    made on all ranks prints it once, as JAX's does; pass the returned text to ``print``
    to see it from another rank.

    Rows split dim 0 and columns dim 1 (a 1-D tensor is one row; dims past 1 are
    listed in the cell text). Each cell shows the index range and the ranks holding it.

    Args:
      x: a DTensor (or a plain tensor, shown as replicated when ``mesh`` is given).
      mesh: the mesh, when ``x`` is a plain tensor.
      use_color: color cells by block when rich is installed.

    Returns:
      The table as plain text.
    """
    if isinstance(x, DTensor):
        mesh = mesh or _mesh_of(x)
        spec = spec_of(x, mesh)
    elif isinstance(x, torch.Tensor) and mesh is not None:
        spec = PartitionSpec()
    else:
        raise TypeError("visualize_sharding needs a DTensor, or a tensor and mesh=...")
    shape = tuple(x.shape)
    grid = sharding_grid(shape, spec, mesh)
    rows = sorted({k[0][0] if k else 0 for k in grid})
    cols = sorted({k[1][0] if len(k) > 1 else 0 for k in grid})
    cell: dict[tuple[int, int], str] = {}
    for k, ranks in grid.items():
        r = k[0][0] if k else 0
        c = k[1][0] if len(k) > 1 else 0
        rng = ", ".join(f"{a}:{b}" for a, b in k) or "scalar"
        text = f"[{rng}] rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
        cell[(r, c)] = text if (r, c) not in cell else cell[(r, c)] + "\n" + text
    title = f"shape {shape}, {spec} on {mesh!r}"
    table_rows = [[cell.get((r, c), "") for c in cols] for r in rows]
    plain = _plain(title, table_rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        if is_rank0():
            print(plain)
        return plain
    table = Table(title=title, show_header=False, show_lines=True)
    for _ in cols:
        table.add_column(justify="center")
    palette = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_black", "white"]
    for i, row in enumerate(table_rows):
        styled = [f"[{palette[(i * len(cols) + j) % len(palette)]}]{t}" if use_color else t for j, t in enumerate(row)]
        table.add_row(*styled)
    if is_rank0():
        Console().print(table)
    return plain


def _plain(title: str, rows: list[list[str]]) -> str:
    width = max((len(line) for row in rows for t in row for line in t.splitlines()), default=1)
    out = [title]
    sep = "+" + "+".join("-" * (width + 2) for _ in rows[0]) + "+"
    out.append(sep)
    for row in rows:
        height = max(len(t.splitlines()) for t in row)
        for h in range(height):
            parts = [(t.splitlines() + [""] * height)[h].center(width) for t in row]
            out.append("| " + " | ".join(parts) + " |")
        out.append(sep)
    return "\n".join(out)

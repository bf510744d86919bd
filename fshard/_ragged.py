"""The host side of ``fs.lax.ragged_all_to_all`` (the rule, the lowering and the transpose are
in its docstring in :mod:`fshard.lax`): the gathered plan as host ints, the rows and the
per-peer counts each rank sends and receives, and the checks that raise alike on every rank.
It imports nothing of fshard's, so :mod:`fshard.lax` can build on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
_IO, _SS, _OO, _RS = range(4)


def row_counts(operand: torch.Tensor, output: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[operand rows, output rows]`` (int64): part of the gathered plan."""
    return torch.tensor([operand.shape[0], output.shape[0]], dtype=torch.int64, device=device)


def host(every: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table (n, 4, K), (n, 2) [operand rows, output rows] per rank)``.

    Tensors, not lists: under ``fs.simulate`` each group of the axis has its own plan, and
    a per-rank value can only be a tensor or an int (the helpers below read them as lists).
    """
    return every[:, : 4 * k].reshape(-1, 4, k), every[:, 4 * k :]


def _lists(table: Any) -> list:
    return table.tolist() if isinstance(table, torch.Tensor) else table


def _slices(table: list, me: int, order: Sequence[int], sending: bool) -> list[tuple[int, int]]:
    """``(start row, size)`` of each slice ``me`` sends (rows of its operand) or receives
    (rows of its output), peers in group-rank order, a peer's slices in their order."""
    table = _lists(table)
    n, k = len(table), len(table[0][0])
    per = k // n
    if sending:
        mine = table[me]
        return [(mine[_IO][i], mine[_SS][i]) for u in order for i in range(u * per, (u + 1) * per)]
    return [(table[u][_OO][i], table[u][_SS][i]) for u in order for i in range(me * per, (me + 1) * per)]


def rows(table: list, me: int, order: Sequence[int], sending: bool, device: torch.device) -> torch.Tensor:
    """The rows of :func:`_slices`, concatenated: an int64 index vector."""
    slices = _slices(table, me, order, sending)
    starts = torch.tensor([s for s, _ in slices], dtype=torch.int64)
    sizes = torch.tensor([z for _, z in slices], dtype=torch.int64)
    first = sizes.cumsum(0) - sizes  # each slice's first position in the concatenation
    rows = torch.repeat_interleave(starts - first, sizes) + torch.arange(int(sizes.sum()))
    return rows.to(device)


def splits(table: list, me: int, order: Sequence[int], sending: bool) -> list[int]:
    """Rows ``me`` sends to (receives from) each group rank."""
    table = _lists(table)
    n, k = len(table), len(table[0][0])
    per = k // n
    if sending:
        return [sum(table[me][_SS][u * per : (u + 1) * per]) for u in order]
    return [sum(table[u][_SS][me * per : (me + 1) * per]) for u in order]


# --- checks: one message template, every rank raising alike -----------------------------------
def _error(ax: Any, what: str, fix: str) -> ValueError:
    axes = repr(ax.names[0]) if len(ax.names) == 1 else repr(ax.names)
    return ValueError(f"fs.lax.ragged_all_to_all over {axes} (size {ax.n}): {what}. Fix: {fix}")


def check_arrays(ax: Any, operand: Any, output: Any, vectors: tuple) -> int:
    for name, t in (("operand", operand), ("output", output)) + tuple(zip(_NAMES, vectors)):
        if not isinstance(t, torch.Tensor):
            raise _error(ax, f"{name} is a {type(t).__name__}", "pass tensors (the offsets and sizes as int tensors).")
    for name, v in zip(_NAMES, vectors):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise _error(
                ax,
                f"{name} has shape {tuple(v.shape)} and dtype {v.dtype}",
                "each of the four vectors is 1-D with an integer dtype.",
            )
    lengths = [v.shape[0] for v in vectors]
    k = lengths[0]
    if len(set(lengths)) > 1 or k < 1 or k % ax.n:
        shown = ", ".join(f"{n}: {s}" for n, s in zip(_NAMES, lengths))
        raise _error(
            ax,
            f"the vectors have lengths ({shown})",
            f"give all four one length K >= 1 divisible by {ax.n} (K / {ax.n} slices per peer).",
        )
    rows_differ = operand.dim() == 0 or output.dim() == 0 or operand.shape[1:] != output.shape[1:]
    if rows_differ or operand.dtype != output.dtype:
        raise _error(
            ax,
            f"operand {tuple(operand.shape)} {operand.dtype} and output {tuple(output.shape)} "
            f"{output.dtype} differ in dtype or in their rows' shape",
            "rows of one shape and dtype: (N, ...) and (M, ...), slices along dim 0.",
        )
    return k


def check_plan(ax: Any, table: Any, sizes: Any) -> None:
    table, sizes = _lists(table), _lists(sizes)
    n, k = len(table), len(table[0][0])
    per = k // n
    for r, (io, ss, _, rs) in enumerate(table):
        n_rows = sizes[r][0]
        for i in range(k):
            if min(io[i], ss[i], rs[i]) < 0 or io[i] + ss[i] > n_rows:
                raise _error(
                    ax,
                    f"axis index {r} has input_offsets[{i}]={io[i]}, send_sizes[{i}]={ss[i]}, "
                    f"recv_sizes[{i}]={rs[i]}: rows [{io[i]}, {io[i] + ss[i]}) of an operand of {n_rows} rows",
                    "sizes are >= 0 and every slice lies inside the operand.",
                )
    for d in range(n):
        got, m_rows = [], sizes[d][1]
        for s in range(n):
            for j in range(per):
                i, mine = d * per + j, s * per + j  # slice i of s goes to d; d's recv entry for it
                size, start = table[s][_SS][i], table[s][_OO][i]
                if table[d][_RS][mine] != size:
                    raise _error(
                        ax,
                        f"axis index {s} sends send_sizes[{i}]={size} rows to axis index {d}, "
                        f"which expects recv_sizes[{mine}]={table[d][_RS][mine]}",
                        "send_sizes on every rank must equal all_to_all(recv_sizes, tiled=True).",
                    )
                if start < 0 or start + size > m_rows:
                    raise _error(
                        ax,
                        f"axis index {s} writes rows [{start}, {start + size}) (output_offsets[{i}]="
                        f"{start}, send_sizes[{i}]={size}) on axis index {d}, whose output has {m_rows} rows",
                        "every received slice lies inside the receiver's output.",
                    )
                if size:
                    got.append((start, size, s, i))
        got.sort()
        for (a, za, sa, ia), (b, zb, sb, ib) in zip(got, got[1:]):
            if b < a + za:
                raise _error(
                    ax,
                    f"on axis index {d}, rows [{a}, {a + za}) from axis index {sa} (output_offsets[{ia}]) "
                    f"and rows [{b}, {b + zb}) from axis index {sb} (output_offsets[{ib}]) overlap",
                    "received slices go to disjoint rows of the output.",
                )

"""``fs.lax.ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` on torch.distributed.

The rule (JAX's). ``K = len(input_offsets)`` is a multiple of the axis size ``n``; with
``s = K // n`` slices per peer, this rank sends ``operand[input_offsets[i]:][:send_sizes[i]]``
to axis index ``i // s``, which writes it at row ``output_offsets[i]`` of its own
``output``. The result is ``output`` with every received slice written in; rows no slice
reaches keep ``output``'s values. ``recv_sizes[j]`` is the size of the slice received from
axis index ``j // s``: ``send_sizes`` on every rank must equal
``all_to_all(recv_sizes, tiled=True)``.

Lowering. One ``all_gather`` of the four integer vectors over the axis gives every rank
the whole plan, so that every rank checks it the same way and a bad plan raises on every
rank instead of hanging the ones it does not concern. Then one ``all_to_all_single``
with this rank's row counts per peer (host ints: reading the plan is one device sync
per call, as in torchtitan's dispatch). The data path is ``index_select`` (the rows
sent, in peer order) -> the exchange -> ``index_copy`` into ``output``, and autograd
transposes it: the exchange's transpose is the exchange with the split sizes swapped,
``index_select``'s is a scatter-add to the operand's rows, ``index_copy``'s gives
``output`` the cotangent with the received rows zeroed. That is JAX's transpose rule
(a ragged_all_to_all back, and the output cotangent masked), with two differences where
JAX 0.10.2's rule is not the derivative of its own forward (docs/jax.md):

- input slices that overlap (a row sent to two peers): its gradient is the sum of both
  cotangents; JAX's transpose writes them into a zero buffer, the last one wins;
- the output cotangent: exactly the received rows are zeroed; JAX builds the mask from
  a cumulative sum over slice starts and ends, which is wrong where an empty slice starts
  at another slice's start (packed offsets with an expert that receives no tokens).

Checked mode: the result varies over the axis and over whatever ``operand`` and
``output`` vary over (an invariant one gets the implicit ``pvary`` first); JAX 0.10.2
gives it ``output``'s type, invariant for an invariant ``output``, though the values
differ per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fshard import _contract, comm, lax
from fshard.runtime import simulation

__all__ = ["ragged_all_to_all"]

_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
_IO, _SS, _OO, _RS = range(4)


class _AllToAllV(torch.autograd.Function):
    """Rows to peers by per-peer counts (group-rank order); transpose: the counts swapped."""

    @staticmethod
    def forward(x, ax, send, recv):
        return comm.all_to_all_v(x, ax.group, send, recv, axes=ax.names)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.ax, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx, g):
        return lax._apply(_AllToAllV, g, ctx.ax, ctx.recv, ctx.send), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return lax._apply(_AllToAllV, t, ctx.ax, ctx.send, ctx.recv)


def ragged_all_to_all(
    operand: torch.Tensor,
    output: torch.Tensor,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    *,
    axis_name: str | Sequence[str],
) -> torch.Tensor:
    """Sends ragged slices of ``operand`` to every rank of ``axis_name`` and writes the
    received ones into ``output`` (``jax.lax.ragged_all_to_all``; the rule is in the
    module docstring).

    Args:
      operand: ``(N, ...)`` rows to send from.
      output: ``(M, ...)``, same dtype and row shape: the values of rows nothing is
        written to.
      input_offsets, send_sizes: ``(K,)`` integers: slice ``i`` of ``operand`` goes to
        axis index ``i // (K // n)``.
      output_offsets: ``(K,)``: where slice ``i`` is written on its receiver.
      recv_sizes: ``(K,)``: the size of the slice received from axis index ``j // (K // n)``.
      axis_name: a mesh axis or a tuple of axes (row-major over the tuple).

    Returns:
      ``(M, ...)``: ``output`` with the received slices written in. Differentiable in
      ``operand`` and ``output`` (the module docstring has the transpose).

    Raises:
      ValueError: (on every rank, before any data moves) a vector that is not 1-D of one
        length ``K`` divisible by ``n``; operand and output of different dtypes or row
        shapes; a slice outside the operand; a send size that differs from its receiver's
        recv size; received slices outside the output or overlapping there. The axis, the
        ranks, the slice indices and the sizes are named.
    """
    body, ax = lax._axes("ragged_all_to_all", axis_name)
    vectors = (input_offsets, send_sizes, output_offsets, recv_sizes)
    k = _check_arrays(ax, operand, output, vectors)
    names = frozenset(ax.names)
    token, wtoken = lax._IN_LAX.set(True), _contract.WHAT.set("ragged_all_to_all")
    try:
        if body.check:
            operand, output = (lax._make_varying(t, ax, names) for t in (operand, output))
        # Each rank's four vectors and its operand's and output's row counts (they may differ
        # per rank in eager code: a receiver's output is sized by what it receives).
        rows = torch.tensor([operand.shape[0], output.shape[0]], dtype=torch.int64, device=input_offsets.device)
        plan = torch.cat([v.reshape(k).to(torch.int64) for v in vectors] + [rows])  # (4K + 2,)
        every = plan.unsqueeze(0) if ax.n == 1 else lax._gather_raw(plan, ax, 0, False)  # (n, 4K + 2)
        table, sizes = simulation.per_rank(_host)(every, k)  # the same on every rank
        _check_plan(ax, table, sizes)
        order = ax.u_of_g or tuple(range(ax.n))  # the axis index of each group rank
        dev = operand.device
        send_rows = simulation.per_rank(_rows)(table, ax.me, order, True, dev)
        recv_rows = simulation.per_rank(_rows)(table, ax.me, order, False, dev)
        sent = operand.index_select(0, send_rows)
        if ax.n > 1:
            send = simulation.per_rank(_splits)(table, ax.me, order, True)
            recv = simulation.per_rank(_splits)(table, ax.me, order, False)
            sent = lax._apply(_AllToAllV, sent, ax, send, recv)
        out = output.index_copy(0, recv_rows, sent)
    finally:
        _contract.WHAT.reset(wtoken)
        lax._IN_LAX.reset(token)
    if body.check:
        lax.set_vma(out, lax.vma(operand) | lax.vma(output) | names)
    return out


def _host(every: torch.Tensor, k: int) -> tuple[list, list]:
    """``(table [n][4][K], [(operand rows, output rows)] per rank)`` as host ints."""
    rows = every.tolist()
    return [[r[j * k : (j + 1) * k] for j in range(4)] for r in rows], [(r[-2], r[-1]) for r in rows]


def _slices(table: list, me: int, order: Sequence[int], sending: bool) -> list[tuple[int, int]]:
    """``(start row, size)`` of each slice ``me`` sends (rows of its operand) or receives
    (rows of its output), peers in group-rank order, a peer's slices in their order."""
    n, k = len(table), len(table[0][0])
    per = k // n
    if sending:
        mine = table[me]
        return [(mine[_IO][i], mine[_SS][i]) for u in order for i in range(u * per, (u + 1) * per)]
    return [(table[u][_OO][i], table[u][_SS][i]) for u in order for i in range(me * per, (me + 1) * per)]


def _rows(table: list, me: int, order: Sequence[int], sending: bool, device: torch.device) -> torch.Tensor:
    """The rows of :func:`_slices`, concatenated: an int64 index vector."""
    slices = _slices(table, me, order, sending)
    starts = torch.tensor([s for s, _ in slices], dtype=torch.int64)
    sizes = torch.tensor([z for _, z in slices], dtype=torch.int64)
    first = sizes.cumsum(0) - sizes  # each slice's first position in the concatenation
    rows = torch.repeat_interleave(starts - first, sizes) + torch.arange(int(sizes.sum()))
    return rows.to(device)


def _splits(table: list, me: int, order: Sequence[int], sending: bool) -> list[int]:
    """Rows ``me`` sends to (receives from) each group rank."""
    n, k = len(table), len(table[0][0])
    per = k // n
    if sending:
        return [sum(table[me][_SS][u * per : (u + 1) * per]) for u in order]
    return [sum(table[u][_SS][me * per : (me + 1) * per]) for u in order]


# --- checks: one message template, every rank raising alike -----------------------------------
def _error(ax: Any, what: str, fix: str) -> ValueError:
    axes = repr(ax.names[0]) if len(ax.names) == 1 else repr(ax.names)
    return ValueError(f"fs.lax.ragged_all_to_all over {axes} (size {ax.n}): {what}. Fix: {fix}")


def _check_arrays(ax: Any, operand: Any, output: Any, vectors: tuple) -> int:
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


def _check_plan(ax: Any, table: list, sizes: list) -> None:
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

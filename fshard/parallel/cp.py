"""Context parallelism: attention over a sequence split across a ``cp`` mesh axis, per device.

The sequence of ``T`` tokens is cut into ``2n`` chunks of ``c = T / 2n`` (``n``: the size of
the ``cp`` axis). With causal load balancing (``balance=True``, torchtitan's head-tail
order) rank ``i`` holds chunks ``i`` and ``2n-1-i``: an early chunk, which sees few keys,
and a late one, which sees many, so every rank has the same ``2n c^2`` visible
(query, key) pairs. Without it (``balance=False``) rank ``i`` holds the contiguous
``T / n`` tokens from ``i T / n``, and the last rank does ``2n - 1`` times the first's work.

:func:`ring_attention` rotates the K/V blocks around the axis with ``fs.lax.ppermute``
(``n - 1`` transfers of one block each, each in flight while the block before it is
attended to: ``fs.lax.ppermute_start``) and combines each block's softmax online in
log-sum-exp form. Its backward (``backward="explicit"``, ``fshard/parallel/_ring.py``) sends
K/V round again with their gradients beside them and keeps only the rank's own ``q, k, v``,
output and log-sum-exp; ``backward="autograd"`` differentiates the forward (through
``ppermute``'s transpose, the reverse ring). Both are exact. ``kv="gather"`` gathers the
whole K/V once instead (``fs.lax.all_gather``, its transpose a ``psum_scatter``): fewer,
larger transfers, for short rings.

Every function here is SPMD-clean: which blocks a rank combines is decided by tensors of its
``axis_index``, never by a Python branch on the rank, so the same code runs on real ranks and
under ``fs.simulate``; and every rank computes the same FLOPs.

Shapes: ``q``, ``k``, ``v`` are ``(B, H, L, hd)`` with ``L = T / n`` local tokens, in the order
:func:`cp_order` gives (``cp_shard`` puts a batch in it, ``cp_unshard`` takes it back).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fshard import lax
from fshard import tree as tree_util
from fshard.parallel._ring import RingAttention, ring_forward

__all__ = ["cp_order", "cp_positions", "cp_shard", "cp_unshard", "ring_attention"]

_KV = ("ring", "gather")
_BACKWARDS = ("explicit", "autograd")


def _check_len(what: str, seq_len: int, n: int, balance: bool, axis: Any = "cp") -> None:
    if n == 1:  # nothing to split
        return
    parts = 2 * n if balance else n
    if seq_len % parts:
        order = f"2 x cp = {parts} chunks (head-tail load balancing)" if balance else f"cp = {n} blocks"
        raise ValueError(
            f"{what}: sequence length {seq_len} does not split into {order} over axis {axis!r} "
            f"(size {n}). Pad the sequence to a multiple of {parts} (masking the padding out of "
            f"the loss), or pick a cp size n with {'2n' if balance else 'n'} dividing {seq_len}."
        )


def cp_order(seq_len: int, n: int, *, balance: bool = True) -> torch.Tensor:
    """The positions of a ``seq_len`` sequence in sharded order: rank ``r`` of ``n`` holds
    ``cp_order(...)[r * L:(r + 1) * L]`` (``L = seq_len / n``).

    With ``balance``: chunks ``r`` and ``2n-1-r`` of ``2n``; without: ``arange(seq_len)``.
    ``x.index_select(1, cp_order(T, n))`` sharded ``P(None, "cp")`` is :func:`cp_shard`'s
    result, for a data loader that shards on the host.

    Raises:
      ValueError: ``seq_len`` is not a multiple of ``2n`` (``n`` without ``balance``).
    """
    _check_len("fs.parallel.cp_order", seq_len, n, balance)
    pos = torch.arange(seq_len)
    if not balance or n == 1:
        return pos
    chunks = pos.view(2 * n, seq_len // (2 * n))
    return chunks[[i for r in range(n) for i in (r, 2 * n - 1 - r)]].reshape(-1)


def cp_positions(seq_len: int, axis: Any, *, balance: bool = True) -> torch.Tensor:
    """This rank's token positions (``(L,)`` int64), per device: what position embeddings and
    RoPE must use for a sequence sharded by :func:`cp_shard`."""
    n = lax.axis_size(axis)
    order = cp_order(seq_len, n, balance=balance).view(n, -1)
    # index_select, not order[i]: a 0-d index would be read as a host int (per rank).
    return order.index_select(0, lax.axis_index(axis).reshape(1)).squeeze(0)


def cp_shard(x: Any, axis: Any, *, seq_dim: int = 1, balance: bool = True) -> Any:
    """This rank's part of a whole-sequence batch (a tensor or a pytree), per device.

    Every leaf holds the whole sequence on dim ``seq_dim`` (replicated over ``axis``); the
    result holds the ``L = T / n`` tokens :func:`cp_positions` names. Differentiable (its
    transpose places the cotangent back at those positions).

    Raises:
      ValueError: the sequence length does not split (see :func:`cp_order`).
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(seq_dim, cp_positions(t.shape[seq_dim], axis, balance=balance).to(t.device))

    return tree_util.tree_map(one, x)


def cp_unshard(x: Any, axis: Any, *, seq_dim: int = 1, balance: bool = True, to: str = "varying") -> Any:
    """The whole sequence, in natural order, from every rank's part (per device): the inverse
    of :func:`cp_shard`. An ``fs.lax.all_gather`` over ``axis`` (``to`` as there), then a
    reorder."""

    def one(t: torch.Tensor) -> torch.Tensor:
        whole = lax.all_gather(t, axis, axis=seq_dim, tiled=True, to=to)
        order = cp_order(whole.shape[seq_dim], lax.axis_size(axis), balance=balance)
        return whole.index_select(seq_dim, torch.argsort(order).to(t.device))

    return tree_util.tree_map(one, x)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: Any,
    *,
    causal: bool = True,
    balance: bool = True,
    scale: float | None = None,
    kv: str = "ring",
    backward: str = "explicit",
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys, per device.

    Args:
      q, k, v: ``(B, H, L, hd)``, this rank's ``L`` tokens in :func:`cp_order`'s order.
      axis: the context-parallel mesh axis (or tuple of axes).
      causal: each query sees the keys at its position and before.
      balance: the sequence is in head-tail order (:func:`cp_shard`'s default); must match
        how it was sharded.
      scale: the scores' scale (default ``1 / sqrt(hd)``).
      kv: ``"ring"`` (K/V blocks rotate, one block in flight) or ``"gather"`` (the whole K/V
        gathered once).
      backward: with the ring, ``"explicit"`` (K/V go round again in backward with their
        gradients beside them, one block's scores recomputed at a time: each rank saves its
        own ``q, k, v``, output and log-sum-exp only) or ``"autograd"`` (the transposes of the
        forward: every block that reached the rank is kept; also forward mode, ``jvp``, and
        ``vmap``). Both give the same gradients. The explicit one is first-order only: a second
        derivative through it raises.

    Returns:
      ``(B, H, L, hd)``, this rank's rows of the attention output.

    Raises:
      ValueError: mismatched shapes, an unknown ``kv``, or a local length that does not
        split into two chunks (balanced causal).
    """
    _check_args(q, k, v, axis, kv, backward)
    n = lax.axis_size(axis)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    balance = balance and causal and n > 1
    if balance and q.shape[2] % 2:
        _check_len("fs.parallel.ring_attention", q.shape[2] * n, n, True, axis)
    if n == 1:  # nothing to combine: torch's fused kernel (on CPU, flash-style: no T x T scores kept)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if kv == "gather":
        return _gathered(q, k, v, axis, causal, balance, scale)
    if backward == "autograd":
        return ring_forward(q, k, v, axis, causal, balance, scale)[0]
    return RingAttention.apply(q, k, v, axis, causal, balance, scale)[0]


def _check_args(q, k, v, axis, kv, backward) -> None:
    if kv not in _KV:
        raise ValueError(f"fs.parallel.ring_attention: kv={kv!r} is not one of {_KV}")
    if backward not in _BACKWARDS:
        raise ValueError(f"fs.parallel.ring_attention: backward={backward!r} is not one of {_BACKWARDS}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"fs.parallel.ring_attention over {axis!r}: q, k and v must all be (B, H, L, hd) of one shape, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat grouped K/V heads first)."
        )


def _gathered(q, k, v, axis, causal, balance, scale):
    n, L = lax.axis_size(axis), q.shape[2]
    k_all, v_all = (lax.all_gather(t, axis, axis=2, tiled=True) for t in (k, v))  # (B, H, T, hd)
    s = (q @ k_all.transpose(-2, -1)) * scale  # (B, H, L, T)
    if causal:
        mine = cp_positions(L * n, axis, balance=balance).to(q.device)
        keys = cp_order(L * n, n, balance=balance).to(q.device)
        s = s.masked_fill(mine[:, None] < keys[None, :], -math.inf)
    return s.softmax(-1) @ v_all

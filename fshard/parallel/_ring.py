"""The ring of :func:`fshard.parallel.ring_attention`: its forward, and its explicit backward.

Forward: the stacked K/V block goes round the axis (``n - 1`` transfers, each in flight during
a step's compute), each block's partial softmax ``(o, lse)`` is merged online. Differentiated
by autograd (``backward="autograd"``), its backward follows ``ppermute``'s transpose and keeps
every block that reached the rank. :class:`RingAttention` (``backward="ring"``) keeps only
the local ``q, k, v``, the output and its log-sum-exp, and in backward sends K/V round the
ring again with their gradients travelling beside them, recomputing one block's scores at a
time (the flash-attention ring's backward): the same gradients, ``O(L)`` saved per rank.

Which pairs of chunks a step computes is decided by tensors of ``axis_index``, as in
forward, so both directions are SPMD-clean.
"""

from __future__ import annotations

import math

import torch

from fshard import lax

__all__ = ["RingAttention", "ring_forward"]


def _attend(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T) v, logsumexp of the scores)`` of one block; causal on aligned chunks."""
    return _BlockAttention.apply(q, k, v, causal, scale)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


class _BlockAttention(torch.autograd.Function):
    """One block's ``(o, lse)``, flash-style: only q, k, v, o and lse are kept for backward,
    and the ``Lq x Lk`` scores are recomputed there (one block's at a time), so a rank's saved
    bytes do not grow with the blocks it attends to. The backward is the softmax's exact
    transpose, with the cotangent of ``lse`` (the online merge's weights depend on it):
    ``ds = p * (do v^T - rowsum(do * o) + dlse)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, causal, scale):
        s = _scores(q, k, causal, scale)
        lse = s.logsumexp(-1, keepdim=True)  # (B, H, Lq, 1)
        return (s - lse).exp() @ v, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.save_for_forward(q, k, v, *output)

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        p = (_scores(q, k, ctx.causal, ctx.scale) - lse).exp()  # (B, H, Lq, Lk)
        do = torch.zeros_like(o) if do is None else do
        row = (do * o).sum(-1, keepdim=True)
        if dlse is not None:
            row = row - dlse
        ds = p * (do @ v.transpose(-2, -1) - row)
        return (ds @ k) * ctx.scale, (ds.transpose(-2, -1) @ q) * ctx.scale, p.transpose(-2, -1) @ do, None, None

    @staticmethod
    def jvp(ctx, dq, dk, dv, *_):
        q, k, v, o, lse = ctx.saved_tensors
        p = (_scores(q, k, ctx.causal, ctx.scale) - lse).exp()
        ds = torch.zeros_like(p)
        if dq is not None:
            ds = ds + dq @ k.transpose(-2, -1)
        if dk is not None:
            ds = ds + q @ dk.transpose(-2, -1)
        ds = ds * ctx.scale
        dlse = (p * ds).sum(-1, keepdim=True)
        do = (p * (ds - dlse)) @ v
        if dv is not None:
            do = do + p @ dv
        return do, dlse


def _merge(a, b):
    """Two partial softmaxes over disjoint key sets, as one (log-sum-exp weights)."""
    (o1, l1), (o2, l2) = a, b
    lse = torch.logaddexp(l1, l2)
    return o1 * (l1 - lse).exp() + o2 * (l2 - lse).exp(), lse


def _none_if(cond: torch.Tensor, part):
    """``part`` where ``cond`` holds; nothing (a log-weight of -inf) elsewhere, SPMD-clean."""
    o, lse = part
    return o, torch.where(cond, lse, torch.full_like(lse, -math.inf))


def ring_forward(q, k, v, axis, causal, balance, scale):
    """``(o, lse)`` of this rank's queries over the whole ring (differentiable by autograd)."""
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    perm = [(i, (i + 1) % n) for i in range(n)]
    kv = torch.stack([k, v])  # one transfer a step
    if balance:
        q0, q1 = q.chunk(2, dim=2)
    acc = acc0 = acc1 = None
    for j in range(n):  # the block held at step j came from rank r - j
        pending = lax.ppermute_start(kv, axis, perm) if j < n - 1 else None  # in flight during this step
        kj, vj = kv[0], kv[1]
        if not causal:
            part = _attend(q, kj, vj, False, scale)
            acc = part if acc is None else _merge(acc, part)
        elif not balance:
            if j == 0:
                acc = _attend(q, kj, vj, True, scale)
            else:  # visible only from an earlier rank; computed everywhere, discarded where not
                acc = _merge(acc, _none_if(r >= j, _attend(q, kj, vj, False, scale)))
        else:
            (k0, k1), (v0, v1) = kj.chunk(2, dim=2), vj.chunk(2, dim=2)
            if j == 0:
                acc0 = _attend(q0, k0, v0, True, scale)
                acc1 = _merge(_attend(q1, k0, v0, False, scale), _attend(q1, k1, v1, True, scale))
            else:
                acc0, acc1 = _balanced_step(q0, q1, k0, k1, v0, v1, r >= j, acc0, acc1, scale)
        if pending is not None:
            kv = pending()
    if balance:
        return torch.cat([acc0[0], acc1[0]], dim=2), torch.cat([acc0[1], acc1[1]], dim=2)
    return acc


def _balanced_step(q0, q1, k0, k1, v0, v1, earlier, acc0, acc1, scale):
    """One ring step in head-tail order, from a rank ``earlier`` (or later) than this one.

    From an earlier rank both query chunks see its head chunk ``k0`` (and neither its tail);
    from a later one the tail queries ``q1`` see both of its chunks (the head queries none).
    ``(q1, k0)`` is common to both; the other pair is ``(q0, k0)`` or ``(q1, k1)``, picked by
    tensors, so every rank computes two full ``c x c`` blocks.
    """
    acc1 = _merge(acc1, _attend(q1, k0, v0, False, scale))
    qx, kx, vx = (torch.where(earlier, a, b) for a, b in ((q0, q1), (k0, k1), (v0, v1)))
    other = _attend(qx, kx, vx, False, scale)
    acc0 = _merge(acc0, _none_if(earlier, other))
    acc1 = _merge(acc1, _none_if(~earlier, other))
    return acc0, acc1


def _block_grads(q, k, v, do, lse, rowdot, causal: bool, scale: float):
    """``(dq, dk, dv)`` of one block against the final softmax (``p = exp(s - lse)``)."""
    p = (_scores(q, k, causal, scale) - lse).exp()  # (B, H, Lq, Lk), recomputed
    ds = p * (do @ v.transpose(-2, -1) - rowdot)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


def _masked(cond: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.where(cond, g, torch.zeros_like(g))


def ring_backward(q, k, v, o, lse, do, ring, causal, balance, scale):
    """``(dq, dk, dv)`` of :func:`ring_forward`'s ``o`` for the cotangent ``do``.

    ``ring`` is the forward's ``(axes, n, r)``: autograd runs this after the body has returned,
    so the transfers are ``fs.lax``'s raw ones on the axes the forward resolved (as ``ppermute``'s
    own transpose does).
    """
    ax, n, r = ring
    perm = [(i, (i + 1) % n) for i in range(n)]
    rowdot = (do * o).sum(-1, keepdim=True)  # (B, H, L, 1)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv)  # the gradient of the block held, travelling with it
    dq = torch.zeros_like(q)
    for j in range(n):  # as in forward: the block of rank r - j
        pending = lax._permute_start_raw(kv, ax, perm) if j < n - 1 else None  # in flight during this step
        gq, gkv = _step_grads(q, kv, do, lse, rowdot, j, r >= j, causal, balance, scale)
        dq, dkv = dq + gq, dkv + gkv
        dkv = lax._permute_raw(dkv, ax, perm)  # after the last step: home, to the rank it came from
        if pending is not None:
            kv = pending.wait()
    return dq, dkv[0], dkv[1]


def _step_grads(q, kv, do, lse, rowdot, j, earlier, causal, balance, scale):
    """One backward step's ``(dq, dkv)``: the pairs the forward step ``j`` attended to."""
    k, v = kv[0], kv[1]
    if not causal:
        gq, gk, gv = _block_grads(q, k, v, do, lse, rowdot, False, scale)
        return gq, torch.stack([gk, gv])
    if not balance:
        if j == 0:
            gq, gk, gv = _block_grads(q, k, v, do, lse, rowdot, True, scale)
            return gq, torch.stack([gk, gv])
        gq, gk, gv = _block_grads(q, k, v, do, lse, rowdot, False, scale)
        return _masked(earlier, gq), _masked(earlier, torch.stack([gk, gv]))
    (q0, q1), (k0, k1), (v0, v1) = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    (do0, do1), (l0, l1), (d0, d1) = do.chunk(2, dim=2), lse.chunk(2, dim=2), rowdot.chunk(2, dim=2)
    if j == 0:
        a = _block_grads(q0, k0, v0, do0, l0, d0, True, scale)
        b = _block_grads(q1, k0, v0, do1, l1, d1, False, scale)
        c = _block_grads(q1, k1, v1, do1, l1, d1, True, scale)
        gq = torch.cat([a[0], b[0] + c[0]], dim=2)
        return gq, torch.stack([torch.cat([a[1] + b[1], c[1]], dim=2), torch.cat([a[2] + b[2], c[2]], dim=2)])
    b = _block_grads(q1, k0, v0, do1, l1, d1, False, scale)  # (q1, k0): seen from either side
    pick = [torch.where(earlier, x, y) for x, y in ((q0, q1), (k0, k1), (v0, v1), (do0, do1), (l0, l1), (d0, d1))]
    x = _block_grads(*pick, False, scale)  # (q0, k0) from an earlier rank, (q1, k1) from a later one
    gq = torch.cat([_masked(earlier, x[0]), b[0] + _masked(~earlier, x[0])], dim=2)
    gk = torch.cat([b[1] + _masked(earlier, x[1]), _masked(~earlier, x[1])], dim=2)
    gv = torch.cat([b[2] + _masked(earlier, x[2]), _masked(~earlier, x[2])], dim=2)
    return gq, torch.stack([gk, gv])


class RingAttention(torch.autograd.Function):
    """:func:`ring_forward`'s output with :func:`ring_backward` as its backward: saves the
    local ``q, k, v``, the output and its log-sum-exp only."""

    @staticmethod
    def forward(q, k, v, axis, causal, balance, scale):
        return ring_forward(q, k, v, axis, causal, balance, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, axis, ctx.causal, ctx.balance, ctx.scale = inputs
        ctx.ring = (lax._axes("ppermute", axis)[1], lax.axis_size(axis), lax.axis_index(axis))
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = ring_backward(q, k, v, o, lse, do, ctx.ring, ctx.causal, ctx.balance, ctx.scale)
        return (*grads, None, None, None, None)

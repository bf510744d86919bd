"""The ring of :func:`fshard.parallel.ring_attention`: its forward, and its explicit backward.

Forward: the stacked K/V block goes round the axis (``n - 1`` transfers, each in flight during
a step's compute), each block's partial softmax ``(o, lse)`` is merged online. Differentiated
by autograd (``backward="autograd"``), its backward follows ``ppermute``'s transpose and keeps
every block that reached the rank. :class:`RingAttention` (``backward="explicit"``) keeps
only the local ``q, k, v``, the output and its log-sum-exp,
and in backward sends K/V round the ring again with their gradients travelling beside them,
recomputing one block's scores at a time (the flash-attention ring's backward): the same
gradients, ``O(L)`` saved per rank.

A block runs on torch's CPU flash kernel for float32/float64 CPU tensors; elsewhere (CUDA,
half precision, under ``vmap``) on the formula, in at least float32 (the scores, the
log-sum-exp and the merge weights; results in the inputs' dtype), materializing that one
block's scores.

Which pairs of chunks a step computes is decided by tensors of ``axis_index``, as in
forward, so both directions are SPMD-clean.
"""

from __future__ import annotations

import math

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd.function import once_differentiable

from fshard import lax

__all__ = ["RingAttention", "ring_forward"]


def _attend(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T) v, logsumexp of the scores)`` of one block; causal on aligned chunks."""
    return _BlockAttention.apply(q, k, v, causal, scale)


_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs on torch's CPU flash kernel (no scores materialized; its lse is the
    natural-log log-sum-exp of the scaled scores, as here); else the formula below, which also
    serves ``vmap`` (the kernel takes 4-d inputs only, and has no batching rule)."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return False
    return all(i.key() != TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous rows: the CPU kernel reads each row's ``hd`` values in a run (a
    cotangent of ``out.sum()`` is an expanded, stride-0 tensor)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The formula's working dtype: at least float32 (bf16's spacing near an lse of 10 is 0.06)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (_wide(q) * scale) @ _wide(k).transpose(-2, -1)  # (B, H, Lq, Lk), scaled first (fp16 range)
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
        if _fused(q):
            o, lse = _CPU_FWD(_rows(q), _rows(k), _rows(v), 0.0, causal, scale=scale)
            return o, lse.unsqueeze(-1)
        s = _scores(q, k, causal, scale)
        lse = s.logsumexp(-1, keepdim=True)  # (B, H, Lq, 1), at least float32
        return ((s - lse).exp() @ _wide(v)).to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.save_for_forward(q, k, v, *output)

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        return (*_formula_grads(q, k, v, do, o, lse, ctx.causal, ctx.scale, dlse), None, None)

    @staticmethod
    def jvp(ctx, dq, dk, dv, *_):
        q, k, v, o, lse = ctx.saved_tensors
        p = (_scores(q, k, ctx.causal, ctx.scale) - lse).exp()
        ds = torch.zeros_like(p)
        if dq is not None:
            ds = ds + _wide(dq) @ _wide(k).transpose(-2, -1)
        if dk is not None:
            ds = ds + _wide(q) @ _wide(dk).transpose(-2, -1)
        ds = ds * ctx.scale
        dlse = (p * ds).sum(-1, keepdim=True)
        do = (p * (ds - dlse)) @ _wide(v)
        if dv is not None:
            do = do + p @ _wide(dv)
        return do.to(o.dtype), dlse.to(lse.dtype)


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
        return torch.cat([acc0[0], acc1[0]], dim=2).to(q.dtype), torch.cat([acc0[1], acc1[1]], dim=2)
    return acc[0].to(q.dtype), acc[1]  # the merges ran in the log-sum-exp's (at least float32) dtype


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


def _block_grads(q, k, v, do, o, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of one block against the final softmax (``p = exp(s - lse)``, ``o`` the
    final output): what a flash kernel's backward computes, so on CPU it is torch's."""
    if _fused(q):
        return _CPU_BWD(_rows(do), _rows(q), _rows(k), _rows(v), _rows(o), lse.squeeze(-1), 0.0, causal, scale=scale)
    return _formula_grads(q, k, v, do, o, lse, causal, scale)


def _formula_grads(q, k, v, do, o, lse, causal: bool, scale: float, dlse=None):
    """The softmax's transpose for one block, scores recomputed in at least float32:
    ``ds = p * (do v^T - rowsum(do * o) + dlse)`` (``dlse``: the cotangent of the block's own
    log-sum-exp, None against the final one)."""
    p = (_scores(q, k, causal, scale) - lse).exp()  # (B, H, Lq, Lk)
    wdo = _wide(do)
    row = (wdo * _wide(o)).sum(-1, keepdim=True)
    if dlse is not None:
        row = row - dlse
    ds = p * (wdo @ _wide(v).transpose(-2, -1) - row)
    dq, dk = (ds @ _wide(k)) * scale, (ds.transpose(-2, -1) @ _wide(q)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), (p.transpose(-2, -1) @ wdo).to(v.dtype)


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
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv)  # the gradient of the block held, travelling with it
    do = _rows(do)  # a cotangent of out.sum() is stride-0: chunks and kernels need real rows
    dq = torch.zeros_like(q)
    for j in range(n):  # as in forward: the block of rank r - j
        pending = lax._permute_start_raw(kv, ax, perm) if j < n - 1 else None  # in flight during this step
        _accumulate(q, kv, do, o, lse, j, r >= j, causal, balance, scale, dq, dkv)
        # After the last step: home, to the rank it came from. On gloo a group runs one transfer
        # at a time, so the K/V in flight lands first: it overlaps the blocks, not this hop.
        dkv = lax._permute_raw(dkv, ax, perm)
        if pending is not None:
            kv = pending.wait()
    return dq, dkv[0], dkv[1]


def _accumulate(q, kv, do, o, lse, j, earlier, causal, balance, scale, dq, dkv) -> None:
    """Adds one backward step's gradients into ``dq`` and ``dkv`` in place (their chunks' views:
    no step-sized temporaries): the pairs the forward step ``j`` attended to."""
    (k, v), (dk, dv) = kv.unbind(0), dkv.unbind(0)

    def add(dsts, grads, cond=None):
        for dst, g in zip(dsts, grads):
            dst.add_(g if cond is None else _masked(cond, g))

    if not causal or not balance:
        visible = None if (not causal or j == 0) else earlier  # contiguous: only from an earlier rank
        add((dq, dk, dv), _block_grads(q, k, v, do, o, lse, causal and j == 0, scale), visible)
        return
    (q0, q1), (k0, k1), (v0, v1) = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    (do0, do1), (o0, o1), (l0, l1) = do.chunk(2, dim=2), o.chunk(2, dim=2), lse.chunk(2, dim=2)
    (dq0, dq1), (dk0, dk1), (dv0, dv1) = dq.chunk(2, dim=2), dk.chunk(2, dim=2), dv.chunk(2, dim=2)
    add((dq1, dk0, dv0), _block_grads(q1, k0, v0, do1, o1, l1, False, scale))  # (q1, k0): every step
    if j == 0:
        add((dq0, dk0, dv0), _block_grads(q0, k0, v0, do0, o0, l0, True, scale))
        add((dq1, dk1, dv1), _block_grads(q1, k1, v1, do1, o1, l1, True, scale))
        return
    qx, kx, vx, dox, ox, lx = (
        torch.where(earlier, a, b) for a, b in ((q0, q1), (k0, k1), (v0, v1), (do0, do1), (o0, o1), (l0, l1))
    )
    x = _block_grads(qx, kx, vx, dox, ox, lx, False, scale)  # (q0, k0) from an earlier rank, (q1, k1) from a later one
    add((dq0, dk0, dv0), x, earlier)
    add((dq1, dk1, dv1), x, ~earlier)


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
    @once_differentiable  # its transfers are raw (no autograd): a second derivative would be wrong
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = ring_backward(q, k, v, o, lse, do, ctx.ring, ctx.causal, ctx.balance, ctx.scale)
        return (*grads, None, None, None, None)

"""Context parallelism (fs.parallel.ring_attention, cp_shard/cp_unshard) against one process.

Every case runs on real gloo ranks (cp = 2 and 4) and compares the attention output and the
gradients of q, k and v with single-process attention on the whole sequence, in float64 to
1e-12: causal (head-tail balanced and contiguous) and full, the ring and the gathered K/V,
checked and unchecked mode, and both orders (``value_and_grad(shard_map(f))`` and
``shard_map(value_and_grad(f))``). The same program under ``fs.simulate`` gives the real
ranks' bits. The balance is measured: each rank's attention FLOPs (torch's FLOP counter).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fshard as fs
from fshard import P
from fshard.parallel.cp import cp_order, cp_positions, cp_shard, cp_unshard, ring_attention
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated

B, H, T, HD = 2, 2, 16, 4
SEQ = P(None, None, "cp")
# (causal, balance, kv, backward); balance only matters with causal, backward with the ring.
CASES = [(c, b, "ring", back) for c, b in ((True, True), (True, False), (False, True))
         for back in ("explicit", "autograd")] + [(True, True, "gather", "explicit"),
                                                  (True, False, "gather", "explicit"),
                                                  (False, True, "gather", "explicit")]


def _qkvw(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, HD, generator=g, dtype=torch.float64) for _ in range(4)]


def _reference(causal, seed=0):
    """(output, grads of q, k, v) of ``sum(attention(q, k, v) * w)`` in one process."""
    q, k, v, w = _qkvw(seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), grads


def _parity(n, order, check):
    """One rank: the worst difference to the reference, per case, of the output and grads."""
    mesh = fs.make_mesh({"cp": n})
    worst = {}
    for causal, balance, kv, backward in CASES:
        perm = cp_order(T, n, balance=balance)
        q, k, v, w = (t.index_select(2, perm) for t in _qkvw())

        def attn(q, k, v, causal=causal, balance=balance, kv=kv, backward=backward):
            return ring_attention(q, k, v, "cp", causal=causal, balance=balance, kv=kv, backward=backward)

        def loss(q, k, v, w):
            return fs.lax.psum((attn(q, k, v) * w).sum(), "cp")

        out = fs.gather(fs.shard_map(attn, mesh=mesh, in_specs=SEQ, out_specs=SEQ, check=check)(q, k, v))
        if order == "outside":
            step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=SEQ, out_specs=P(), check=check),
                                     argnums=(0, 1, 2))
        else:
            step = fs.shard_map(fs.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=SEQ,
                                out_specs=(P(), (SEQ, SEQ, SEQ)), check=check)
        _, grads = step(q, k, v, w)
        back = torch.argsort(perm)
        ref_out, ref_grads = _reference(causal)
        diffs = [(fs.gather(g).index_select(2, back) - r).abs().max().item() for g, r in zip(grads, ref_grads)]
        worst[(causal, balance, kv, backward)] = max([(out.index_select(2, back) - ref_out).abs().max().item(), *diffs])
    return worst


@pytest.mark.parametrize("n, order, check", [(1, "outside", True), (2, "outside", True), (2, "inside", False),
                                             (4, "inside", True), (4, "outside", False)])
def test_ring_attention_equals_one_process(n, order, check):
    # Each rank's output and grads against single-process SDPA on the whole sequence, every case
    # (cp = 1: the fused kernel itself, no ring).
    for rank, worst in enumerate(run_on_ranks(_parity, n, order, check, world_size=n)):
        bad = {case: d for case, d in worst.items() if not d < 1e-12}
        assert not bad, f"rank {rank}: (causal, balance, kv, backward) -> worst diff {bad}"


def _shard_round_trip(n):
    """cp_shard of a replicated batch, its positions, cp_unshard back, and their gradients."""
    mesh = fs.make_mesh({"cp": n})
    x = torch.randn(B, T, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def body(x):
        mine = cp_shard(x, "cp")
        pos = cp_positions(T, "cp")
        back = cp_unshard(mine * 2, "cp")
        return mine, pos, back, fs.lax.psum((mine * pos[None, :, None]).sum(), "cp")

    mine, pos, back, _ = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(None, "cp"), P("cp"), P(), P()),
                                      check=False)(x)
    grad = fs.grad(lambda x: fs.shard_map(lambda x: body(x)[3], mesh=mesh, in_specs=P(), out_specs=P())(x))(x)
    return fs.gather(mine), fs.gather(pos), fs.gather(back), fs.gather(grad), x


@pytest.mark.parametrize("n", [2, 4])
def test_cp_shard_positions_and_unshard(n):
    mine, pos, back, grad, x = run_on_ranks(_shard_round_trip, n, world_size=n)[0]
    order = cp_order(T, n)
    assert torch.equal(pos, order)
    assert torch.equal(mine, x.index_select(1, order))
    assert torch.equal(back, 2 * x)
    # d/dx sum(x[:, p] * p) over every rank's positions: the position itself, at every token
    assert torch.equal(grad, torch.arange(T, dtype=x.dtype)[None, :, None].expand_as(x))


def test_head_tail_order():
    assert cp_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert cp_order(8, 2, balance=False).tolist() == list(range(8))
    assert cp_order(8, 1).tolist() == list(range(8))
    # rank i holds chunks i and 2n-1-i of 2n
    n, c = 4, 2
    blocks = cp_order(2 * n * c, n).view(n, 2, c)
    assert [(b[0, 0].item() // c, b[1, 0].item() // c) for b in blocks] == [(i, 2 * n - 1 - i) for i in range(n)]


def _count_cpu_flash() -> None:
    """torch's FLOP counter has no formula for the CPU flash kernel the blocks run on: SDPA's
    (every block counted whole; the kernel skips a causal block's masked half)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in fc.flop_registry:
        fc.register_flop_formula(fwd)(lambda q, k, v, *a, **kw: fc.sdpa_flop_count(q, k, v))  # shapes
        fc.register_flop_formula(bwd)(lambda do, q, k, v, *a, **kw: fc.sdpa_backward_flop_count(do, q, k, v))


def _flops(n, balance):
    """This rank's FLOPs of one causal ring_attention call."""
    _count_cpu_flash()
    mesh = fs.make_mesh({"cp": n})
    perm = cp_order(T * 4, n, balance=balance)
    q = torch.randn(1, 1, T * 4, HD, dtype=torch.float64).index_select(2, perm)

    def body(q):
        with FlopCounterMode(display=False) as counter:
            ring_attention(q, q, q, "cp", balance=balance)
        return torch.tensor([float(counter.get_total_flops())], dtype=torch.float64)

    return fs.gather(fs.shard_map(body, mesh=mesh, in_specs=SEQ, out_specs=P("cp"), check=False)(q)).tolist()


def _flops_both(n):
    return _flops(n, True), _flops(n, False)


def test_balance_is_measured_per_rank():
    # Every rank computes the same FLOPs (no branch on the rank), and the head-tail ring computes
    # (2n+1)/4n of the contiguous one's: contiguous ranks compute every block and discard half.
    n, L = 4, T * 4
    balanced, contiguous = run_on_ranks(_flops_both, n, world_size=n)[0]
    assert max(balanced) <= 1.05 * min(balanced), balanced
    assert max(contiguous) <= 1.05 * min(contiguous), contiguous
    assert balanced[0] / contiguous[0] == pytest.approx((2 * n + 1) / (4 * n), rel=0.02)
    # The visible (query, key) pairs per rank: equal with head-tail, 2n-1 to 1 in blocks without.
    visible = {b: [int((cp_order(L, n, balance=b).view(n, -1)[r] + 1).sum()) for r in range(n)]
               for b in (True, False)}
    assert max(visible[True]) <= 1.05 * min(visible[True]), visible
    assert max(visible[False]) > 5 * min(visible[False]), visible


def _ring_values(n):
    mesh = fs.make_mesh({"cp": n})
    q, k, v, w = (t.index_select(2, cp_order(T, n)) for t in _qkvw(3))

    def loss(q, k, v, w):
        return fs.lax.psum((ring_attention(q, k, v, "cp") * w).sum(), "cp")

    step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=SEQ, out_specs=P()), argnums=(0, 1, 2))
    value, grads = step(q, k, v, w)
    return [fs.gather(t).detach().clone() for t in (value, *grads)]


def test_simulated_ring_matches_real_ranks_bitwise():
    real = run_on_ranks(_ring_values, 2, world_size=2)
    simulated = run_simulated(_ring_values, 2, world_size=2)
    assert_bitwise_equal(simulated, real, what="ring attention under fs.simulate")


def _errors(n):
    mesh = fs.make_mesh({"cp": n})
    q = torch.randn(1, 1, 6, 2, dtype=torch.float64)  # 3 local tokens a rank: not two chunks
    messages = []
    for kwargs in ({}, {"kv": "ring2"}, {"backward": "flash"}):
        try:
            fs.shard_map(lambda q: ring_attention(q, q, q, "cp", **kwargs), mesh=mesh, in_specs=SEQ, out_specs=SEQ)(q)
        except ValueError as e:
            messages.append(str(e))
    try:
        fs.shard_map(lambda q: ring_attention(q, q[..., :1], q, "cp"), mesh=mesh, in_specs=SEQ, out_specs=SEQ)(q)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sequence length 10 does not split into 2 x cp = 4 chunks .*\(size 2\)"):
        cp_order(10, 2)
    with pytest.raises(ValueError, match=r"sequence length 10 does not split into cp = 4 blocks"):
        cp_order(10, 4, balance=False)
    odd, kv, backward, shapes = run_on_ranks(_errors, 2, world_size=2)[0]
    assert "sequence length 6 does not split into 2 x cp = 4 chunks" in odd and "'cp'" in odd
    assert "kv='ring2' is not one of ('ring', 'gather')" in kv
    assert "backward='flash' is not one of ('explicit', 'autograd')" in backward
    assert "(1, 1, 3, 2), (1, 1, 3, 1), (1, 1, 3, 2)" in shapes



def _saved_bytes(n, seq_len):
    """This rank's bytes saved for backward by one causal ring_attention (float32, hd 16)."""
    mesh = fs.make_mesh({"cp": n})
    q = torch.randn(1, 1, seq_len, 16).index_select(2, cp_order(seq_len, n))

    def body(q):
        q = q.detach().requires_grad_()
        seen = {}

        def pack(t):
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ring_attention(q, q, q, "cp")
        return torch.tensor([float(sum(seen.values()))])

    return fs.gather(fs.shard_map(body, mesh=mesh, in_specs=SEQ, out_specs=P("cp"), check=False)(q)).tolist()


def _saved_by_size(n):
    return {t: max(_saved_bytes(n, t)) for t in (256, 512)}


def test_saved_memory_per_rank_falls_as_one_over_cp():
    # The explicit backward keeps this rank's q, k, v, output and log-sum-exp only, as one
    # process's fused kernel keeps the whole sequence's: 1/cp of it (measured: exactly).
    one = _saved_by_size(1)
    for n in (2, 4):
        per_rank = run_on_ranks(_saved_by_size, n, world_size=n)[0]
        for t, b in per_rank.items():
            assert b <= 1.05 * one[t] / n, (n, t, b, one[t])
            assert b >= 0.4 * one[t] / n, (n, t, b, one[t])  # the ring saves what it must


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_rules_equal_the_math(causal):
    # The flash-style block (on CPU torch's flash kernel; scores recomputed in backward): its
    # backward, double backward, jvp, vmap and torch.func.grad against autograd through the plain
    # formula, float64.
    from fshard.parallel._ring import _BlockAttention, _scores

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def block(q, k, v):
        return _BlockAttention.apply(q, k, v, causal, 0.7)

    def plain(q, k, v):
        s = _scores(q, k, causal, 0.7)
        lse = s.logsumexp(-1, keepdim=True)
        return (s - lse).exp() @ v, lse

    assert torch.autograd.gradcheck(block, (q, k, v)) and torch.autograd.gradgradcheck(block, (q, k, v))
    tangents = tuple(torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (q, k, v))
    for a, b in zip(torch.func.jvp(block, (q, k, v), tangents)[1], torch.func.jvp(plain, (q, k, v), tangents)[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    # vmap runs the formula (the CPU kernel has no batching rule), the call itself the kernel
    torch.testing.assert_close(torch.func.vmap(block)(q, k, v)[0], block(q, k, v)[0], rtol=0, atol=1e-13)

    def total(f):
        return lambda q, k, v: sum(x.sum() for x in f(q, k, v))

    grads = torch.func.grad(total(block), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, torch.func.grad(total(plain), argnums=(0, 1, 2))(q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def _ring_order(n):
    """The order of one ring step's events on this rank: transfers started and waited, blocks
    computed (forward and backward), recorded by wrapping the ring's own calls."""
    from fshard.parallel import _ring

    events, real = [], _ring.lax
    block_fwd, block_grads = _ring._BlockAttention.forward, _ring._block_grads

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def ppermute_start(self, x, axis, perm):
            events.append("start")
            wait = real.ppermute_start(x, axis, perm)
            return lambda: (events.append("wait"), wait())[1]

        def _permute_start_raw(self, x, ax, perm):
            events.append("start")
            handle = real._permute_start_raw(x, ax, perm)
            return types.SimpleNamespace(wait=lambda: (events.append("wait"), handle.wait())[1])

    def fwd(*a):
        events.append("block")
        return block_fwd(*a)

    def grads(*a):
        events.append("block")
        return block_grads(*a)

    _ring.lax, _ring._BlockAttention.forward, _ring._block_grads = Recording(), staticmethod(fwd), grads
    try:
        mesh = fs.make_mesh({"cp": n})
        q = torch.randn(1, 1, 16, 4, dtype=torch.float64, requires_grad=True)

        def body(q):
            return ring_attention(q, q, q, "cp").sum().reshape(1)

        out = fs.shard_map(body, mesh=mesh, in_specs=SEQ, out_specs=P("cp"), check=False)(q)
        torch.autograd.grad(fs.gather(out).sum(), q)
    finally:
        _ring.lax, _ring._BlockAttention.forward, _ring._block_grads = real, staticmethod(block_fwd), block_grads
    return events


def test_each_transfer_is_in_flight_while_a_block_computes():
    # Forward and backward: every K/V transfer but the last step's is started before that
    # step's blocks and waited after them (the overlap is in the program order).
    n = 4
    events = run_on_ranks(_ring_order, n, world_size=n)[0]
    steps = "".join("S" if e == "start" else "W" if e == "wait" else "b" for e in events)
    # forward: n - 1 steps of (start, 3 or 2 blocks, wait), then the last step's 2 blocks; backward alike
    import re

    assert re.fullmatch(r"(Sb+W){3}b+(Sb+W){3}b+", steps), steps


def _sum_loss_and_formula(n):
    """Worst difference to one process, for the gradients of ``out.sum()`` (a stride-0
    cotangent) on the CPU kernel, and of the dense loss with every block on the formula (CUDA's
    path); and the error a second derivative through the explicit backward raises."""
    from fshard.parallel import _ring

    mesh = fs.make_mesh({"cp": n})
    perm, back = cp_order(T, n), torch.argsort(cp_order(T, n))
    q, k, v, w = (t.index_select(2, perm) for t in _qkvw())
    worst = {}
    for backward in ("explicit", "autograd"):
        def total(q, k, v, backward=backward):
            return fs.lax.psum(ring_attention(q, k, v, "cp", backward=backward).sum(), "cp")

        grads = fs.value_and_grad(fs.shard_map(total, mesh=mesh, in_specs=SEQ, out_specs=P()), argnums=(0, 1, 2))(
            q, k, v)[1]
        qr, kr, vr = (t.clone().requires_grad_() for t in _qkvw()[:3])
        ref = torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).sum(), (qr, kr, vr))
        worst[("sum", backward)] = max((fs.gather(g).index_select(2, back) - r).abs().max().item()
                                       for g, r in zip(grads, ref))
    fused, _ring._fused = _ring._fused, lambda q: False
    try:
        for backward in ("explicit", "autograd"):
            def dense(q, k, v, w, backward=backward):
                return fs.lax.psum((ring_attention(q, k, v, "cp", backward=backward) * w).sum(), "cp")

            grads = fs.value_and_grad(fs.shard_map(dense, mesh=mesh, in_specs=SEQ, out_specs=P()),
                                      argnums=(0, 1, 2))(q, k, v, w)[1]
            worst[("formula", backward)] = max((fs.gather(g).index_select(2, back) - r).abs().max().item()
                                               for g, r in zip(grads, _reference(True)[1]))
    finally:
        _ring._fused = fused

    def twice(q):
        q = q.detach().requires_grad_()
        (g,) = torch.autograd.grad(ring_attention(q, q, q, "cp").sum(), q, create_graph=True)
        torch.autograd.grad(g.sum(), q)

    try:
        fs.shard_map(twice, mesh=mesh, in_specs=SEQ, out_specs=(), check=False)(q)
        second = ""
    except RuntimeError as e:
        second = str(e)
    return worst, second


def test_stride_zero_cotangents_the_formula_path_and_no_second_derivative():
    worst, second = run_on_ranks(_sum_loss_and_formula, 2, world_size=2)[0]
    bad = {case: d for case, d in worst.items() if not d < 1e-12}
    assert not bad, bad
    # once_differentiable: the first derivative carries no graph, so a second one raises
    assert "does not require grad" in second, second

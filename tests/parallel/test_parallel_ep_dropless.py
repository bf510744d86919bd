"""Dropless MoE (``moe_ffn(capacity_factor=None)``): the layer on ep ranks against the
single-process layer (float64, 1e-12, both orders) with uneven routing and an expert that
receives no token, the router's auxiliary losses, and the grouped GEMM against the
per-expert loop. The Transformer compositions (EP x FSDP, DP, TP): test_parallel_ep.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.parallel._dropless import expert_gemms, grouped_mm_fits
from fshard.parallel.ep import _router, ep_specs, moe_ffn, moe_init, router_losses
from fshard.testing import run_on_ranks

DIM, HIDDEN, N_EXPERTS, TOKENS = 16, 32, 8, 12  # TOKENS per rank
DEAD = 5  # the expert no token picks


def _setup(n_ranks):
    p = moe_init(DIM, HIDDEN, N_EXPERTS, 3, dtype=torch.float64, router_std=1.0)
    p["router"]["weight"][DEAD] = -10.0  # with positive tokens, expert DEAD never wins
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n_ranks * TOKENS, DIM, generator=g, dtype=torch.float64).abs()
    return p, x


def _loss(y_aux, n_ranks=1):
    """``sum(y**2) / n_ranks`` plus the router losses: each rank's term, pmean'd, is the
    reference's (aux losses are means over the groups already)."""
    y, aux = y_aux
    return (y**2).sum() / n_ranks + 0.1 * aux["load_balance"] + 0.01 * aux["z_loss"]


def _run(n_ranks, top_k, order, dtype=torch.float64):
    """This rank's ``(loss, grads of params, grad of x)`` as global tensors, and the mesh's specs."""
    mesh = fs.make_mesh({"ep": n_ranks})
    p, x = fs.tree.tree_map(lambda t: t.to(dtype), _setup(n_ranks))
    specs = ep_specs(p, "ep")
    kw = dict(top_k=top_k, capacity_factor=None, return_aux=True)

    def local(p, x):
        return fs.lax.pmean(_loss(moe_ffn(p, x, ep_axis="ep", **kw)), "ep")

    sharded = fs.shard(p, specs, mesh)
    if order == "outside":
        f = fs.shard_map(local, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P())
        loss, (gp, gx) = fs.value_and_grad(f, argnums=(0, 1))(sharded, x)
    else:
        f = fs.shard_map(fs.value_and_grad(local, argnums=(0, 1)), mesh=mesh, in_specs=(specs, P("ep")),
                         out_specs=(P(), (specs, P("ep"))))
        loss, (gp, gx) = f(sharded, x)
    full = lambda t: fs.gather(t) if hasattr(t, "full_tensor") else t  # noqa: E731
    return fs.tree.tree_map(full, (loss, gp, gx))


def _layer(n_ranks, top_k, order):
    loss, gp, gx = _run(n_ranks, top_k, order)
    p, x = _setup(n_ranks)
    kw = dict(top_k=top_k, capacity_factor=None, return_aux=True)
    ref_loss, (rp, rx) = fs.value_and_grad(lambda p, x: _loss(moe_ffn(p, x, n_groups=n_ranks, **kw), n_ranks),
                                           argnums=(0, 1))(p, x)
    diffs = [(a - b).abs().max().item() for a, b in zip(fs.tree.leaves((gp, gx)), fs.tree.leaves((rp, rx)))]
    return abs(loss.item() - ref_loss.item()), max(diffs)


@pytest.mark.parametrize("n_ranks,top_k,order", [(2, 2, "outside"), (2, 1, "inside"), (4, 2, "inside"),
                                                 (4, 2, "outside")])
def test_dropless_layer_equals_the_single_process_layer(n_ranks, top_k, order):
    p, x = _setup(n_ranks)
    _, _, experts = _router(p["router"]["weight"], x, top_k)
    counts = torch.bincount(experts.reshape(-1), minlength=N_EXPERTS)
    assert counts[DEAD] == 0 and counts.max() > 2 * counts.float().mean()  # uneven, one expert idle
    for loss_diff, grad_diff in run_on_ranks(_layer, n_ranks, top_k, order, world_size=n_ranks):
        assert loss_diff <= 1e-12 and grad_diff <= 1e-12, (loss_diff, grad_diff)


@pytest.mark.parametrize("n_ranks,order,dtype", [(2, "outside", torch.float64), (4, "inside", torch.float64),
                                                 (2, "inside", torch.float32)])
def test_simulated_dropless_layer_is_bit_identical_to_real_ranks(n_ranks, order, dtype):
    """Each rank receives its own number of rows (per-rank shapes under fs.simulate); float32
    runs the grouped GEMM, float64 the per-expert loop."""
    real = run_on_ranks(_run, n_ranks, 2, order, dtype, world_size=n_ranks)[0]
    with fs.simulate(n_ranks):
        simulated = fs.tree.tree_map(_one, _run(n_ranks, 2, order, dtype))
    for got, want in zip(fs.tree.leaves(simulated), fs.tree.leaves(real)):
        assert got.dtype == dtype and torch.equal(got, want)


def _one(t):
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[0].clone() if isinstance(t, LocalTensor) else t


def test_dropless_equals_capacity_dispatch_that_drops_nothing():
    p, x = _setup(1)
    a = moe_ffn(p, x, top_k=2, capacity_factor=None)
    b = moe_ffn(p, x, top_k=2, capacity_factor=float(N_EXPERTS))  # C = T: nothing dropped
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_router_losses():
    logits = torch.zeros(6, 4, dtype=torch.float64)  # uniform router
    experts = torch.tensor([[0, 1]] * 6)
    out = router_losses(logits, experts)
    assert out["load_balance"].item() == pytest.approx(1.0, abs=1e-15)  # uniform probabilities: 1
    assert out["z_loss"].item() == pytest.approx(math.log(4) ** 2, abs=1e-15)
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    experts = logits.topk(2, dim=-1).indices
    probs = logits.softmax(-1)
    per_group = []
    for g in range(2):  # by hand: E * sum_e f_e p_e per group of 4 tokens, then the mean
        pr, ex = probs[4 * g : 4 * g + 4], experts[4 * g : 4 * g + 4]
        f = torch.stack([(ex == e).sum() / ex.numel() for e in range(4)]).double()
        per_group.append(4 * (f * pr.mean(0)).sum())
    got = router_losses(logits, experts, n_groups=2)
    assert got["load_balance"].item() == pytest.approx(sum(per_group).item() / 2, abs=1e-15)
    assert got["z_loss"].item() == pytest.approx((logits.logsumexp(-1) ** 2).mean().item(), abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(dtype):
    g = torch.Generator().manual_seed(0)
    w = {"w1": torch.randn(4, 32, 16, generator=g).to(dtype).requires_grad_(),
         "w2": torch.randn(4, 16, 32, generator=g).to(dtype).requires_grad_()}
    x = torch.randn(10, 16, generator=g).to(dtype).requires_grad_()
    sizes = torch.tensor([3, 0, 7, 0])  # two experts with no rows
    assert grouped_mm_fits(x, w)
    out = {}
    for grouped in (True, False):
        y = expert_gemms(w, x, sizes, F.gelu, grouped=grouped)
        grads = torch.autograd.grad(y.sum(), (x, w["w1"], w["w2"]))  # out.sum(): a stride-0 cotangent
        out[grouped] = (y, *grads)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_grouped_gemm_needs_its_dtypes_and_aligned_rows():
    w = {"w1": torch.zeros(2, 8, 6), "w2": torch.zeros(2, 6, 8)}
    assert not grouped_mm_fits(torch.zeros(3, 6), w)  # rows of 6 float32: 24 bytes
    w64 = {k: v.double() for k, v in moe_init(16, 32, 2, 0)["experts"].items()}
    assert not grouped_mm_fits(torch.zeros(3, 16, dtype=torch.float64), w64)  # float64: the loop
    assert grouped_mm_fits(torch.zeros(3, 16), moe_init(16, 32, 2, 0)["experts"])

"""Parameter groups with leaves split over a replicate axis (fshard/parallel/groups.py).

A group's gradients are all-reduced over its replicate axes, except over the axes a leaf's
own spec splits it over: there each rank's block is a different tensor (an expert block
on ``ep``, with the dense leaves replicated over ``ep``). Checked against the
one-process gradient of the same loss, in both orders, on real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.parallel import gather_params, scan_layers
from fshard.testing import run_on_ranks

ROWS = 2  # per data rank


def _params():
    g = torch.Generator().manual_seed(0)
    layer = lambda: {  # noqa: E731
        "w": torch.randn(6, 4, generator=g, dtype=torch.float64),
        "e": torch.randn(4, 3, generator=g, dtype=torch.float64),  # 4 "experts" of one row
    }
    return {"layers": [layer(), layer()]}


def _specs(params, fsdp):
    dense, expert = (P("fsdp"), P(("ep", "fsdp"))) if fsdp else (P(), P("ep"))
    return {"layers": [{"w": dense, "e": expert} for _ in params["layers"]]}


def _block(lp, x):
    """``x`` (b, 4) -> (b, 4); ``lp["e"]`` is this ep rank's block of rows of ``e``."""
    h = torch.tanh(x @ lp["w"].T)[:, :4]  # (b, 4)
    k = lp["e"].shape[0]
    return h + (h[:, :k] @ lp["e"]).sum(-1, keepdim=True)


def _reference(params, x, n_fsdp, n_ep):
    """The mean over data ranks of each rank's loss, each using its ep block of every ``e``."""
    total = 0.0
    for r in range(n_fsdp * n_ep):
        xr, ep = x[r * ROWS : (r + 1) * ROWS], r % n_ep
        for lp in params["layers"]:
            xr = _block({"w": lp["w"], "e": lp["e"].chunk(n_ep)[ep]}, xr)
        total = total + (xr**2).mean()
    return total / (n_fsdp * n_ep)


def _run(n_fsdp, how, order):
    mesh = fs.make_mesh({"fsdp": n_fsdp, "ep": 2} if n_fsdp > 1 else {"ep": 2})
    data = ("fsdp", "ep") if n_fsdp > 1 else ("ep",)
    params = _params()
    specs = _specs(params, n_fsdp > 1)
    sharded = fs.shard(params, specs, mesh)
    x = torch.randn(ROWS * n_fsdp * 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    axis = "fsdp" if n_fsdp > 1 else None

    def body(p, xl):
        if how == "scan":
            h = scan_layers(_block, p["layers"], xl, axis=axis, replicate_axis="ep")
        else:
            h = xl
            for lp in p["layers"]:
                h = _block(gather_params(lp, axis=axis, replicate_axis="ep"), h)
        return fs.lax.pmean((h**2).mean(), data)

    in_specs = (specs, P(data))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P()))
    else:
        step = fs.shard_map(fs.value_and_grad(body), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    loss, grads = step(sharded, x)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: _reference(p, x, n_fsdp, 2))(params)
    diff = max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(fs.gather(grads)), fs.tree.leaves(ref_grads)))
    return abs(loss.item() - ref_loss.item()), diff


@pytest.mark.parametrize("order", ["outside", "inside"])
@pytest.mark.parametrize("how", ["scan", "gather"])
@pytest.mark.parametrize("n_fsdp", [1, 2])
def test_leaf_split_over_a_replicate_axis_is_not_summed_over_it(n_fsdp, how, order):
    for loss_diff, grad_diff in run_on_ranks(_run, n_fsdp, how, order, world_size=2 * n_fsdp):
        assert loss_diff < 1e-12
        assert grad_diff < 1e-12

"""GPU check: ``fs.init()`` picks NCCL on CUDA; a one-rank NCCL mesh runs every ``fs.lax`` op and a step.

What it asserts (one process, started the way ``torchrun --nproc-per-node 1`` starts it):

- ``fs.init()`` picks the machine's backend; on a GPU that is nccl, bound to cuda:0,
  and ``fs.make_mesh`` gives a CUDA mesh;
- inside one ``shard_map`` body every ``fs.lax`` op (psum, pmean, pmax, pmin, pvary,
  all_gather and psum_scatter tiled and not, ppermute, all_to_all tiled and not,
  axis_index, axis_size) returns its one-rank value (trivially: the input, reshaped),
  on CUDA, and the gradient through the differentiable ones is right;
- fs.lax sends nothing over a size-1 axis, so fshard.comm's collectives (all-reduce
  sum/max/min, all-gather, reduce-scatter, all-to-all, point-to-point) and a DTensor
  gather are also called on the mesh's NCCL group directly, and counted;
- an FSDP step (``fsdp_specs`` + ``gather_params`` + ``scan_layers`` under
  ``value_and_grad(shard_map(...))``, float64) equals the plain one-device computation
  on the CPU to 1e-10, and its gradients are on CUDA.

    python bench/gpu_checks/check_nccl.py [--cpu-dry-run] [--result out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Checker, main, one_rank_group  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from fshard import P  # noqa: E402

TOL = 1e-10


def _ops_body(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every fs.lax op on a one-rank axis ``x`` (x: the local (4, 6) block)."""
    lax = fs.lax
    return {
        "psum": lax.psum(x, "x"),
        "pmean": lax.pmean(x, "x"),
        "pmax": lax.pmax(x, "x"),
        "pmin": lax.pmin(x, "x"),
        "pvary": lax.pvary(lax.psum(x, "x"), "x"),
        "all_gather": lax.all_gather(x, "x"),                                  # (1, 4, 6)
        "all_gather_tiled": lax.all_gather(x, "x", axis=1, tiled=True),        # (4, 6)
        "psum_scatter": lax.psum_scatter(x[None], "x"),                        # (4, 6)
        "psum_scatter_tiled": lax.psum_scatter(x, "x", scatter_dimension=1, tiled=True),
        "ppermute": lax.ppermute(x, "x", [(0, 0)]),
        "all_to_all": lax.all_to_all(x[None], "x", 0, 0),                      # (1, 4, 6)
        "all_to_all_tiled": lax.all_to_all(x, "x", 0, 1, tiled=True),          # (4, 6)
        "axis_index": torch.tensor([float(lax.axis_index("x"))], device=x.device),  # (1,): varies
        "axis_size": torch.tensor(float(lax.axis_size("x")), device=x.device),
    }


# Invariant results (P()) and varying ones (P("x")): the specs a checked shard_map needs.
_INVARIANT = {"psum", "pmean", "pmax", "pmin", "all_gather", "all_gather_tiled", "axis_size"}
_DIFFERENTIABLE = ("psum", "pmean", "pvary", "all_gather", "all_gather_tiled", "psum_scatter",
                   "psum_scatter_tiled", "ppermute", "all_to_all", "all_to_all_tiled")


def _expected(x: torch.Tensor) -> dict[str, torch.Tensor]:
    one = {k: x for k in ("psum", "pmean", "pmax", "pmin", "pvary", "all_gather_tiled", "psum_scatter",
                          "psum_scatter_tiled", "ppermute", "all_to_all_tiled")}
    return {**one, "all_gather": x[None], "all_to_all": x[None],
            "axis_index": torch.tensor([0.0], dtype=x.dtype), "axis_size": torch.tensor(1.0, dtype=x.dtype)}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def check_ops(ck: Checker, mesh: fs.Mesh) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    xd = x.to(mesh.device)  # on the device, so that its gradient is too
    names = list(_expected(x))
    out_specs = {k: (P() if k in _INVARIANT else P("x")) for k in names}
    ops = fs.shard_map(_ops_body, mesh=mesh, in_specs=P("x"), out_specs=out_specs)
    with fs.comm_log() as log:
        out = ops(xd)
    ck.figure(collectives=dict(log.counts))
    want = _expected(x)
    wrong = {k: (tuple(_local(out[k]).shape), tuple(want[k].shape)) for k in names
             if tuple(_local(out[k]).shape) != tuple(want[k].shape)
             or not torch.equal(_local(out[k]).cpu(), want[k])}
    ck.require(f"every fs.lax op ({len(names)}) gives its one-rank value", not wrong, wrong)
    devices = {k: _local(v).device.type for k, v in out.items()}
    ck.require_on_device("every fs.lax result is on CUDA",
                         lambda: (set(devices.values()) == {"cuda"}, devices))

    def total(x):
        o = _ops_body(x)
        return sum(o[k].sum() for k in _DIFFERENTIABLE)

    loss_fn = fs.shard_map(total, mesh=mesh, in_specs=P("x"), out_specs=P())
    loss, grad = fs.value_and_grad(loss_fn)(xd)
    grad = _local(grad)
    # Each differentiable op is the identity up to a reshape on one rank, so d(sum)/dx = n_ops.
    ck.require("the gradient through every differentiable fs.lax op is right",
               torch.equal(grad.cpu(), torch.full_like(x, float(len(_DIFFERENTIABLE)))),
               f"got values {grad.unique().tolist()}, want {len(_DIFFERENTIABLE)}")
    ck.require_on_device("the gradient is on CUDA", lambda: (grad.device.type == "cuda", grad.device))


def check_wire(ck: Checker, mesh: fs.Mesh) -> None:
    """The collectives under fs.lax, called on the mesh's group itself.

    fs.lax issues nothing over an axis of size 1 (the values above never reach the
    backend), so this is what makes NCCL itself run: fshard.comm's functional
    collectives and point-to-point exchange, and a DTensor gather.
    """
    from fshard import comm

    group, n, dev = mesh.group("x"), mesh.axis_size("x"), mesh.device
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * n, 6, generator=g, dtype=torch.float32).to(dev)
    with fs.comm_log() as log:
        got = {
            "all_reduce_sum": comm.all_reduce(x, group, "sum", axes=("x",)),
            "all_reduce_max": comm.all_reduce(x, group, "max", axes=("x",)),
            "all_reduce_min": comm.all_reduce(x, group, "min", axes=("x",)),
            "all_gather": comm.all_gather(x, group, n, axes=("x",)),
            "reduce_scatter": comm.reduce_scatter(x, group, n, axes=("x",)),
            "all_to_all": comm.all_to_all(x, group, n, axes=("x",)),
            "permute": comm.permute(x, group, [(0, 0)], 0, axes=("x",)),
            "gather_dtensor": fs.gather(fs.shard(x.cpu(), P("x"), mesh)),
        }
    ck.figure(wire_collectives=dict(log.counts))
    wrong = [k for k, v in got.items() if not torch.equal(v.cpu(), x.cpu())]
    ck.require("fshard.comm's collectives on the mesh's group return their one-rank values", not wrong, wrong)
    ck.require("the collectives reached the backend (counted by comm_log)", log.total() >= 6, dict(log.counts))
    devices = {k: v.device.type for k, v in got.items()}
    ck.require_on_device("the collectives' results are on CUDA", lambda: (set(devices.values()) == {"cuda"}, devices))


def _mlp_init(dim: int = 16, hidden: int = 24, n_layers: int = 3):
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
    return {"proj": {"w": rnd(8, dim)}, "layers": [{"w1": rnd(dim, hidden), "w2": rnd(hidden, dim)}
                                                   for _ in range(n_layers)]}


def _block(lp, h):
    return h + torch.tanh(h @ lp["w1"]) @ lp["w2"]


def _reference_loss(p, x, y):
    h = x @ p["proj"]["w"]
    for lp in p["layers"]:
        h = _block(lp, h)
    return ((h - y) ** 2).mean()


def check_step(ck: Checker, mesh: fs.Mesh) -> None:
    params = _mlp_init()
    specs = fs.parallel.fsdp_specs(params, "x")
    sharded = fs.shard(params, specs, mesh)

    def body(p, x, y):
        root = fs.parallel.gather_params(p["proj"], axis="x")
        h = fs.parallel.scan_layers(_block, p["layers"], x @ root["w"], axis="x")
        return fs.lax.pmean(((h - y) ** 2).mean(), "x")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("x"), P("x")), out_specs=P()))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)
    loss, grads = step(sharded, x, y)
    ref_loss, ref_grads = fs.value_and_grad(_reference_loss)(params, x, y)
    loss_err = abs(float(_local(loss)) - float(ref_loss))
    grad_err = max((_local(a).cpu() - b).abs().max().item()
                   for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(ref_grads)))
    ck.figure(step_loss=float(_local(loss)), step_loss_err=loss_err, step_grad_err=grad_err)
    ck.require("the shard_map FSDP step equals the one-device computation (float64)",
               loss_err <= TOL and grad_err <= TOL, f"loss error {loss_err:.2e}, gradient error {grad_err:.2e}")
    devices = {_local(t).device.type for t in fs.tree.leaves((sharded, grads))}
    ck.require_on_device("the step's shards and gradients are on CUDA", lambda: (devices == {"cuda"}, devices))


def run(ck: Checker, args: argparse.Namespace) -> None:
    backend = one_rank_group()
    ck.figure(backend=backend)
    from fshard.runtime.process import _default_backend

    ck.require("fs.init() picks the backend of this machine", backend == _default_backend(), backend)
    ck.require_on_device("fs.init() picks nccl on CUDA", lambda: (backend == "nccl", backend))
    ck.require_on_device("fs.init() binds the process to cuda:LOCAL_RANK (0)",
                         lambda: (torch.cuda.current_device() == 0, torch.cuda.current_device()))
    mesh = fs.make_mesh({"x": dist.get_world_size()})
    ck.figure(mesh=repr(mesh))
    ck.require_on_device("fs.make_mesh gives a CUDA mesh on nccl", lambda: (mesh.device_type == "cuda", mesh))
    with ck.part("lax_ops"):
        check_ops(ck, mesh)
    with ck.part("nccl_collectives"):
        check_wire(ck, mesh)
    with ck.part("shard_map_step"):
        check_step(ck, mesh)


if __name__ == "__main__":
    main(run, "nccl_init", doc=__doc__)

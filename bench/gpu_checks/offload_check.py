"""GPU check for CPU offload in ``fs.parallel.scan_layers`` / ``gather_params`` (``offload=True``).

UNVERIFIED ON GPU: this script was written on a CPU-only machine and has only been run
there with ``--cpu-dry-run`` (where every "device" is the CPU, so the device assertions
are skipped). Nobody has run it on CUDA yet; a failure here may be a bug in the script
as much as in fshard.

What it asserts, on every rank, after each of a few Adam steps of a small MLP stack (a
root group through ``gather_params`` and 4 layers through ``scan_layers``, float64):

- the parameter shards, their gradients and the optimizer state stay on the CPU
  (shards pinned after ``offload_shards``);
- the gathered parameters ``block_fn`` sees live on CUDA;
- with more than one rank, every host-to-device copy of a flat shard buffer starts
  from pinned memory (so ``non_blocking=True`` really is asynchronous);
- losses, shard values and communication counts match the same run with
  ``offload=False`` (shards on the GPU) to 1e-10.

With one GPU the mesh has one rank: nothing is gathered, so only the per-leaf copy
path runs; use 2+ GPUs to exercise the flat all-gather path.

Run:
    torchrun --nproc-per-node 2 bench/gpu_checks/offload_check.py      # 2 GPUs: gather path
    torchrun --nproc-per-node 1 bench/gpu_checks/offload_check.py      # 1 GPU
    python bench/gpu_checks/offload_check.py                           # 1 GPU, one process
    python bench/gpu_checks/offload_check.py --cpu-dry-run --world 2   # no GPU: script logic only
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fshard as fs  # noqa: E402
from fshard import P  # noqa: E402
from fshard.parallel import groups as groups_mod  # noqa: E402
from fshard.parallel.scan import offload_shards  # noqa: E402

DIM, HIDDEN, N_LAYERS, IN_DIM = 64, 47, 4, 32  # 47: uneven shards, so the flat buffers carry padding


def _params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.2
    return {"proj": {"w": rnd(IN_DIM, DIM)},
            "layers": [{"w1": rnd(DIM, HIDDEN), "w2": rnd(HIDDEN, DIM)} for _ in range(N_LAYERS)]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _run(offload: bool, steps: int, cuda: bool) -> dict[str, Any]:
    n = dist.get_world_size()
    mesh = fs.make_mesh({"fsdp": n})
    params = _params()
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    if offload:
        sharded = offload_shards(sharded)
        if cuda:
            assert all(_local(t).is_pinned() for t in fs.tree.leaves(sharded)), "offload_shards did not pin"
    seen_devices: set[str] = set()

    def block(lp, h):
        seen_devices.update(t.device.type for t in lp.values())
        return h + torch.tanh(h @ lp["w1"]) @ lp["w2"]

    def body(p, x, y):
        root = fs.parallel.gather_params(p["proj"], axis="fsdp", offload=offload)
        seen_devices.add(root["w"].device.type)
        h = fs.parallel.scan_layers(block, p["layers"], x @ root["w"], axis="fsdp", offload=offload)
        return fs.lax.pmean(((h - y) ** 2).mean(), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P()))
    opt = fs.optim.adam(1e-2)
    state = opt.init(sharded)
    copies: list[tuple[str, bool]] = []  # (source device, source pinned) per _to_compute call
    original = groups_mod._to_compute

    def spy(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append((flat.device.type, flat.is_pinned() if flat.device.type == "cpu" else False))
        return original(flat, device)

    groups_mod._to_compute = spy
    losses, counts = [], []
    try:
        for s in range(steps):
            g = torch.Generator().manual_seed(100 + s)
            x = torch.randn(4 * n, IN_DIM, generator=g, dtype=torch.float64)  # 4 rows per rank
            y = torch.randn(4 * n, DIM, generator=g, dtype=torch.float64)
            with fs.comm_log() as log:
                loss, grads = step(sharded, x, y)
            counts.append(dict(log.by_axis))
            losses.append(loss.item())
            if offload:
                bad = [tuple(_local(t).shape) for t in fs.tree.leaves(grads) if _local(t).device.type != "cpu"]
                assert not bad, f"step {s}: shard gradients not on the CPU: {bad}"
            updates, state = opt.update(grads, state, sharded)
            sharded = fs.optim.apply_updates(sharded, updates)
            if offload:
                bad = [tuple(_local(t).shape) for t in fs.tree.leaves((sharded, state)) if _local(t).device.type != "cpu"]
                assert not bad, f"step {s}: shards or optimizer state left the CPU: {bad}"
    finally:
        groups_mod._to_compute = original
    return {"losses": losses, "counts": counts, "devices": seen_devices, "copies": copies,
            "shards": [_local(t).detach().cpu() for t in fs.tree.leaves(sharded)]}


def check(steps: int, cuda: bool) -> str:
    base = _run(False, steps, cuda)
    off = _run(True, steps, cuda)
    rank, n = dist.get_rank(), dist.get_world_size()
    if cuda:
        assert off["devices"] == {"cuda"}, f"gathered parameters were on {off['devices']}, not only CUDA"
        assert base["devices"] == {"cuda"}, base["devices"]
        assert off["copies"] and all(src == "cpu" for src, _ in off["copies"]), "offload made no host-to-device copy"
        if n > 1:  # flat buffers are staged in pinned memory; 1 rank copies the (maybe pageable) leaves
            assert all(pinned for _, pinned in off["copies"]), "a host-to-device copy came from pageable memory"
    for s, (a, b) in enumerate(zip(base["losses"], off["losses"])):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(a)), f"step {s}: loss {b} with offload, {a} without"
    worst = max((a - b).abs().max().item() for a, b in zip(base["shards"], off["shards"]))
    assert worst <= 1e-10, f"shards differ by {worst} after {steps} steps"
    assert base["counts"] == off["counts"], (base["counts"], off["counts"])
    return (f"rank {rank}/{n}: OK on {'CUDA' if cuda else 'CPU (dry run)'}: {steps} steps, losses "
            f"{['%.6f' % v for v in off['losses']]}, max shard diff {worst:.2e}, "
            f"{len(off['copies'])} host-to-device copies, collectives per step {sum(off['counts'][0].values())}")


def _dry_rank(steps: int) -> str:
    return check(steps, cuda=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run the same script on a CPU mesh, skipping the device assertions")
    ap.add_argument("--world", type=int, default=1, help="with --cpu-dry-run: ranks to fork (fs.run_local)")
    args = ap.parse_args()
    if args.cpu_dry_run:
        if "RANK" in os.environ:
            print(_dry_rank(args.steps))
        else:
            for line in fs.run_local(_dry_rank, args.steps, world_size=args.world):
                print(line)
        return
    if not torch.cuda.is_available():
        sys.exit("offload_check: needs CUDA (or pass --cpu-dry-run to check the script's logic on the CPU).")
    if "RANK" in os.environ:
        fs.init(backend="nccl")  # torchrun: binds this process to GPU LOCAL_RANK
    else:  # one process: a one-rank NCCL group, so the mesh computes on CUDA
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print(check(args.steps, cuda=True))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""GPU check for CPU offload in ``fs.parallel.scan_layers`` / ``gather_params`` (``offload=True``).

NOT YET RUN ON A GPU: written on a CPU-only machine and run there with ``--cpu-dry-run``
only (every "device" is the CPU, so the device assertions are skipped, and listed as
skipped in the record). A failure on CUDA may be a bug in the script as much as in fshard.

After each of a few Adam steps of a small MLP stack (a root group through
``gather_params`` and 4 layers through ``scan_layers``, float64), on every rank:

- the parameter shards, their gradients and the optimizer state stay on the CPU (the
  shards pinned after ``offload_shards``);
- the gathered parameters ``block_fn`` sees live on CUDA;
- with more than one rank, every host-to-device copy of a flat shard buffer starts from
  pinned memory (so ``non_blocking=True`` really is asynchronous);
- losses, shard values and communication counts match the same run with
  ``offload=False`` (shards on the GPU) to 1e-10.

Worlds: 2 ranks on one GPU through gloo with CUDA tensors (NCCL refuses two ranks on
one device; this is the flat all-gather path with pinned staging), then 1 rank over
nccl (nothing to gather: the per-leaf copy path). Under torchrun every rank checks
itself over nccl (2+ GPUs: the gather path over NCCL).

    python bench/gpu_checks/offload_check.py                      # 1 GPU: gloo x2, then nccl x1
    torchrun --nproc-per-node 2 bench/gpu_checks/offload_check.py  # 2 GPUs over nccl
    python bench/gpu_checks/offload_check.py --cpu-dry-run        # no GPU: script logic only
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Checker, main, one_rank_group  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from fshard import P  # noqa: E402
from fshard.parallel import groups as groups_mod  # noqa: E402
from fshard.parallel.scan import offload_shards  # noqa: E402

DIM, HIDDEN, N_LAYERS, IN_DIM = 64, 47, 4, 32  # 47: uneven shards, so the flat buffers carry padding
TOL = 1e-10


def _params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.2
    return {"proj": {"w": rnd(IN_DIM, DIM)},
            "layers": [{"w1": rnd(DIM, HIDDEN), "w2": rnd(HIDDEN, DIM)} for _ in range(N_LAYERS)]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _run(offload: bool, steps: int, device_type: str) -> dict[str, Any]:
    n = dist.get_world_size()
    mesh = fs.make_mesh({"fsdp": n}, device_type=device_type)
    params = _params()
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    pinned = None
    if offload:
        sharded = offload_shards(sharded)
        pinned = all(_local(t).is_pinned() for t in fs.tree.leaves(sharded))
    seen_devices: set[str] = set()

    def block(lp, h):
        seen_devices.update(t.device.type for t in lp.values())
        return h + torch.tanh(h @ lp["w1"]) @ lp["w2"]

    def body(p, x, y):
        root = fs.parallel.gather_params(p["proj"], axis="fsdp", offload=offload)
        seen_devices.add(root["w"].device.type)
        h = fs.parallel.scan_layers(block, p["layers"], x @ root["w"], axis="fsdp",
                                    config=fs.parallel.ScanConfig(offload=offload))
        return fs.lax.pmean(((h - y) ** 2).mean(), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P()))
    opt = fs.optim.adam(1e-2)
    state = opt.init(sharded)
    calls, copies = [0], []  # copies: (source device, source pinned) per host-to-device copy
    original = groups_mod.layout.to_compute

    def spy(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        if flat.device != device:
            copies.append((flat.device.type, flat.is_pinned() if flat.device.type == "cpu" else False))
        return original(flat, device)

    groups_mod.layout.to_compute = spy
    losses, counts, off_host = [], [], []
    try:
        for s in range(steps):
            g = torch.Generator().manual_seed(100 + s)
            x = torch.randn(4 * n, IN_DIM, generator=g, dtype=torch.float64)  # 4 rows per rank
            y = torch.randn(4 * n, DIM, generator=g, dtype=torch.float64)
            with fs.comm_log() as log:
                loss, grads = step(sharded, x, y)
            counts.append({f"{k}@{','.join(a)}": v for (k, a), v in log.by_axis.items()})
            losses.append(float(_local(loss)))
            updates, state = opt.update(grads, state, sharded)
            sharded = fs.optim.apply_updates(sharded, updates)
            off_host += [f"step {s}: {what} {tuple(_local(t).shape)} on {_local(t).device}"
                         for what, tree in (("gradient", grads), ("shard", sharded), ("optimizer state", state))
                         for t in fs.tree.leaves(tree)
                         if isinstance(t, torch.Tensor) and _local(t).device.type != "cpu"]
    finally:
        groups_mod.layout.to_compute = original
    return {"losses": losses, "counts": counts, "devices": sorted(seen_devices), "copies": copies,
            "to_compute_calls": calls[0], "pinned_shards": pinned, "off_host": off_host,
            "shards": [_local(t).detach().cpu() for t in fs.tree.leaves(sharded)]}


def rank_run(steps: int, device_type: str) -> dict[str, Any]:
    """One rank: the same steps with and without offload; what it observed (no assertions)."""
    if device_type == "cuda" and dist.get_backend() == "gloo":  # several ranks sharing the GPUs
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        torch.cuda.init()  # before the mesh, which would otherwise pick cuda:LOCAL_RANK
    base = _run(False, steps, device_type)
    off = _run(True, steps, device_type)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "base": {k: v for k, v in base.items() if k != "shards"},
            "off": {k: v for k, v in off.items() if k != "shards"},
            "max_shard_diff": max((a - b).abs().max().item() for a, b in zip(base["shards"], off["shards"]))}


def require_offload(ck: Checker, r: dict[str, Any], where: str) -> None:
    base, off = r["base"], r["off"]
    loss_diff = max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(base["losses"], off["losses"]))
    ck.require(f"{where}: losses with offload equal those without (1e-10)", loss_diff <= TOL, f"{loss_diff:.2e}")
    ck.require(f"{where}: shards after the steps equal (1e-10)", r["max_shard_diff"] <= TOL,
               f"{r['max_shard_diff']:.2e}")
    ck.require(f"{where}: the same collectives per step", base["counts"] == off["counts"],
               (base["counts"], off["counts"]))
    ck.require(f"{where}: gradients, shards and optimizer state stay on the host", not off["off_host"],
               off["off_host"][:5])
    ck.require(f"{where}: offload sends every gathered shard through the host-to-device copy",
               off["to_compute_calls"] > 0 and base["to_compute_calls"] == 0,
               (off["to_compute_calls"], base["to_compute_calls"]))
    ck.require_on_device(f"{where}: offload_shards pinned the shards",
                         lambda: (off["pinned_shards"] is True, off["pinned_shards"]))
    ck.require_on_device(f"{where}: the gathered parameters are on CUDA (with and without offload)",
                         lambda: (off["devices"] == ["cuda"] and base["devices"] == ["cuda"],
                                  (off["devices"], base["devices"])))
    ck.require_on_device(f"{where}: offload copies shards from the host to CUDA",
                         lambda: (len(off["copies"]) > 0 and all(src == "cpu" for src, _ in off["copies"]),
                                  off["copies"][:5]))
    if r["world"] > 1:  # flat buffers are staged in pinned memory; 1 rank copies the (maybe pageable) leaves
        ck.require_on_device(f"{where}: every host-to-device copy comes from pinned memory",
                             lambda: (all(p for _, p in off["copies"]), off["copies"][:5]))


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    return {"backend": r["backend"], "losses": [round(v, 8) for v in r["off"]["losses"]],
            "max_shard_diff": r["max_shard_diff"], "host_to_device_copies": len(r["off"]["copies"]),
            "collectives_per_step": sum(r["off"]["counts"][0].values()) if r["off"]["counts"] else 0}


def run(ck: Checker, args: argparse.Namespace) -> None:
    steps = args.steps
    if "RANK" in os.environ:  # torchrun: this rank checks itself over nccl (gloo in a dry run)
        fs.init(backend=ck.backend)
        r = rank_run(steps, ck.device_type)
        ck.figure(**{f"rank{r['rank']}_{k}": v for k, v in _figures(r).items()})
        require_offload(ck, r, f"rank {r['rank']}/{r['world']}")
        return
    # Forked ranks first: the parent must not have initialized CUDA before it forks.
    for world in sorted(args.world, reverse=True):
        with ck.part(f"world{world}"):
            if world == 1:
                one_rank_group()
                results = [rank_run(steps, ck.device_type)]
            else:
                results = fs.run_local(rank_run, steps, ck.device_type, world_size=world, timeout_s=args.timeout)
            ck.figure(**{f"world{world}_{k}": v for k, v in _figures(results[0]).items()})
            for r in results:
                require_offload(ck, r, f"{r['backend']} rank {r['rank']}/{r['world']}")


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 1],
                    help="worlds to check: N > 1 forks N ranks on the GPU(s) through gloo; 1 is one rank over nccl")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for a forked world")


if __name__ == "__main__":
    main(run, "offload", _args, doc=__doc__)

"""GPU check: ``fs.init_sharded`` on a CUDA mesh gives the CPU init bit for bit, one full parameter at a time.

One process, one-rank mesh (nccl on a GPU). The model is ``fshard.models``' Transformer
(4 blocks; its largest parameter is a small fraction of the whole). What it asserts:

- every leaf equals ``transformer_init(cfg, seed)`` computed on the CPU, bit for bit
  (``torch.equal``), and lives on CUDA;
- the host replay held at most two full parameters' bytes at once
  (``InitStats.peak_bytes <= 2 * max_param_bytes``, as tests/mesh/test_mesh_init.py);
- on the device, ``torch.cuda.max_memory_allocated`` during the call rose by at most the
  result's own bytes plus one full parameter: nothing but the shards and the copy in
  flight was ever on the GPU. (On one rank the result is every parameter; the 2-rank
  version of this bound, where the result is half, runs in check_gloo_cuda.py.)

    python bench/gpu_checks/check_init_sharded.py [--cpu-dry-run] [--result out.json]
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
from fshard.models import TransformerConfig, transformer_init  # noqa: E402

CFG = TransformerConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, max_seq_len=64)
ALLOC_ROUND = 512  # the CUDA caching allocator rounds every block up to 512 bytes


def _round(n: int) -> int:
    return -(-n // ALLOC_ROUND) * ALLOC_ROUND


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def init_and_measure(mesh: fs.Mesh, seed: int) -> dict:
    """Runs init_sharded on ``mesh``; returns the host-side figures and the device peak.

    Shared with check_gloo_cuda.py (2 ranks on one GPU), where each rank's result is half.
    """
    def init_fn(s):
        return transformer_init(CFG, s)

    with torch.device("meta"):
        shapes = init_fn(seed)
    specs = fs.parallel.fsdp_specs(shapes, mesh.axis_names[0])
    cuda = mesh.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    params, stats = fs.init_sharded(init_fn, specs, mesh, seed, return_stats=True, uneven=True)
    peak_rise = torch.cuda.max_memory_allocated() - before if cuda else None
    ref = init_fn(seed)
    full = fs.gather(params)
    mismatched = [p for p, a, b in zip(fs.tree.zip_with_path(full)[0], fs.tree.leaves(full), fs.tree.leaves(ref))
                  if not torch.equal(_local(a).cpu(), b)]
    local_bytes = sum(_round(_local(t).numel() * _local(t).element_size()) for t in fs.tree.leaves(params))
    total_bytes = sum(t.numel() * t.element_size() for t in fs.tree.leaves(ref))
    return {"mismatched": mismatched, "n_leaves": len(fs.tree.leaves(ref)),
            "devices": sorted({_local(t).device.type for t in fs.tree.leaves(params)}),
            "host_peak_bytes": stats.peak_bytes, "max_param_bytes": stats.max_param_bytes,
            "total_bytes": total_bytes, "local_bytes": local_bytes, "device_peak_rise_bytes": peak_rise,
            "device_bound_bytes": local_bytes + _round(stats.max_param_bytes)}


def require_init(ck: Checker, r: dict, where: str) -> None:
    """The assertions on one rank's :func:`init_and_measure` result."""
    ck.require(f"{where}: init_sharded equals the CPU init bit for bit ({r['n_leaves']} leaves)",
               not r["mismatched"], r["mismatched"])
    ck.require(f"{where}: the host replay held at most 2 full parameters at once",
               r["host_peak_bytes"] <= 2 * r["max_param_bytes"],
               f"{r['host_peak_bytes']} B > 2 x {r['max_param_bytes']} B")
    ck.require_on_device(f"{where}: the shards are on CUDA", lambda: (r["devices"] == ["cuda"], r["devices"]))
    ck.require_on_device(
        f"{where}: CUDA memory rose by at most the shards plus one full parameter (max_memory_allocated)",
        lambda: (r["device_peak_rise_bytes"] is not None and r["device_peak_rise_bytes"] <= r["device_bound_bytes"],
                 f"peak rise {r['device_peak_rise_bytes']} B > shards {r['local_bytes']} B + one parameter "
                 f"{r['max_param_bytes']} B"))


def run(ck: Checker, args: argparse.Namespace) -> None:
    one_rank_group()
    mesh = fs.make_mesh({"fsdp": dist.get_world_size()})
    ck.require_on_device("the mesh is a CUDA mesh", lambda: (mesh.device_type == "cuda", mesh))
    r = init_and_measure(mesh, seed=7)
    ck.figure(**{k: v for k, v in r.items() if k not in ("mismatched", "devices")})
    require_init(ck, r, "1 rank")


if __name__ == "__main__":
    main(run, "init_sharded", doc=__doc__)

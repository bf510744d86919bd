"""One gloo worker thread per group (fshard's default) against torch's two, interleaved in one run.

    python bench/gloo_workers.py --mode fsdp --steps 30    # or --mode ddp

fshard builds every gloo group with one worker (``fshard.runtime.gloo_workers``: two workers
race in torch's ``ProcessGroupGloo::runLoop``). This times the cost of that choice: on 2 ranks
it makes one mesh the fshard way (one worker) and one whose group has torch's two workers, then
runs fshard's step (``bench/data_parallel.py``'s model, FSDP or replicate) and torch's
(``fully_shard`` or DDP on the same mesh's group) on both meshes, one after another in each
round. It prints each side's median step and the median of the per-round ratios two / one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import data_parallel as dp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.mesh import mesh as mesh_mod  # noqa: E402
from fshard.models import TransformerConfig  # noqa: E402
from fshard.runtime import gloo_workers  # noqa: E402


def _two_worker_mesh():
    """A ``{"d": world}`` mesh whose group torch builds with its default two workers."""
    mesh_mod._MESH_CACHE.clear()  # the one-worker mesh stays alive in the caller
    saved = gloo_workers.one_worker, mesh_mod._timeout_overrides
    gloo_workers.one_worker = contextlib.nullcontext
    mesh_mod._timeout_overrides = lambda axes, world, backend: {"d": dist.ProcessGroupGloo._Options()}
    try:
        return fs.make_mesh({"d": dist.get_world_size()})
    finally:
        gloo_workers.one_worker, mesh_mod._timeout_overrides = saved
        mesh_mod._MESH_CACHE.clear()


def per_rank(mode: str, steps: int, batch: int):
    torch.set_num_threads(1)
    cfg = TransformerConfig(**dp.CFG)
    meshes = {"one": fs.make_mesh({"d": dist.get_world_size()})}
    meshes["two"] = _two_worker_mesh()
    threads = {k: gloo_workers.worker_threads(m.group("d")) for k, m in meshes.items()}
    args = dp._batches(cfg, batch)
    sides = {}
    for k, mesh in meshes.items():
        fstep, nstep = dp._fshard_step(mode, cfg, mesh), dp._native_step(mode, cfg, device_mesh=mesh.device_mesh)
        sides[f"fshard {k}"] = lambda s=fstep: s(*args["fshard"])
        sides[f"torch {k}"] = lambda s=nstep: s(*args["torch"])
    times, _, _ = dp.timed_rounds(sides, steps)
    return threads, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    threads, times = fs.run_local(per_rank, args.mode, args.steps, args.batch, world_size=2)[0]
    print(
        f"{args.mode}: 2 gloo ranks x batch {args.batch}, median of {args.steps} rounds, "
        f"load {load:.2f} -> {os.getloadavg()[0]:.2f}; worker threads {threads}"
    )
    for k, v in times.items():
        print(f"  {k:12s} {statistics.median(v):.3f} s/step")
    for side in ("fshard", "torch"):
        r = [b / a for a, b in zip(times[f"{side} one"], times[f"{side} two"])]
        print(f"  {side}: two workers / one, median of per-round ratios {statistics.median(r):.3f}")


if __name__ == "__main__":
    main()

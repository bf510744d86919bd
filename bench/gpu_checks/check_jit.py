"""GPU check: ``fs.jit`` (compiled) against eager on CUDA, once ``fs.jit`` exists.

Skipped, with the reason "fs.jit not built", while ``fshard`` has no ``jit``. When it
does: an FSDP train step (``value_and_grad(shard_map(...))`` of an MLP stack through
``scan_layers``, float32, one-rank nccl mesh) runs eager and through ``fs.jit``; the
loss and gradients must agree to 1e-5 relative, and the step times (median after 3
warm-up calls, synchronized) are reported with their ratio. The call form assumed is
``fs.jit(fn)(*args)``, as ``jax.jit``; if ``fs.jit`` takes another form this check
fails and says so.

A CPU dry run compiles with ``backend="aot_eager"``: the same capture (Dynamo and
AOTAutograd, collectives and all) and the same parity assertion, without Inductor's code
generation. On the CPU that is C++ (a cold compile of this step costs 40-90 s of the
suite's time), which is not what a GPU runs (Triton) and so proves nothing about it;
Inductor on the CPU with collectives is tested by tests/jit/test_jit.py.

    python bench/gpu_checks/check_jit.py [--cpu-dry-run] [--result out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Checker, CheckSkipped, main, median, one_rank_group, synchronize  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from fshard import P  # noqa: E402

RTOL = 1e-5
WARMUP = 3


def _block(lp, h):
    return h + torch.tanh(h @ lp["w1"]) @ lp["w2"]


def run(ck: Checker, args: argparse.Namespace) -> None:
    if not hasattr(fs, "jit"):
        raise CheckSkipped("fs.jit not built")
    one_rank_group()
    mesh = fs.make_mesh({"x": dist.get_world_size()})
    # A dry run: tiny, and 2 layers (a layer prefetched during the one before), not 4: the
    # compile's cost grows with the layers, what it checks does not.
    dim, hidden, layers = (16, 32, 2) if ck.dry_run else (1024, 4096, 4)
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"w1": torch.randn(dim, hidden, generator=g) * dim ** -0.5,
                          "w2": torch.randn(hidden, dim, generator=g) * hidden ** -0.5} for _ in range(layers)]}
    specs = fs.parallel.fsdp_specs(params, "x")
    sharded = fs.shard(params, specs, mesh)

    def body(p, x):
        h = fs.parallel.scan_layers(_block, p["layers"], x, axis="x")
        return fs.lax.pmean((h ** 2).mean(), "x")

    eager = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("x")), out_specs=P()))
    backend = "aot_eager" if ck.dry_run else "inductor"  # see the module docstring
    compiled = fs.jit(eager, backend=backend)
    x = torch.randn(8 if ck.dry_run else 64, dim, generator=g)
    times: dict[str, list[float]] = {"eager": [], "jit": []}
    out = {}
    for i in range(WARMUP + (2 if ck.dry_run else 20)):
        for name, fn in (("eager", eager), ("jit", compiled)):
            synchronize(mesh.device)
            t0 = time.perf_counter()
            out[name] = fn(sharded, x)
            synchronize(mesh.device)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    (le, ge), (lj, gj) = out["eager"], out["jit"]

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    err = max([abs(float(local(le)) - float(local(lj))) / abs(float(local(le)))]
              + [((local(a) - local(b)).abs().max() / local(a).abs().max().clamp_min(1e-30)).item()
                 for a, b in zip(fs.tree.leaves(ge), fs.tree.leaves(gj))])
    ck.figure(backend=backend, eager_s=median(times["eager"]), jit_s=median(times["jit"]),
              speedup=median(times["eager"]) / median(times["jit"]), max_rel_err=err)
    ck.require(f"fs.jit gives eager's loss and gradients (rtol {RTOL})", err <= RTOL, f"{err:.2e}")
    devices = {local(t).device.type for t in fs.tree.leaves(out["jit"])}
    ck.require_on_device("the compiled step's results are on CUDA", lambda: (devices == {"cuda"}, devices))


if __name__ == "__main__":
    main(run, "jit", doc=__doc__)

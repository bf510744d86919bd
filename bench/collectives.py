"""Overhead of fshard's collectives vs calling torch.distributed directly (same sizes, same run).

    python bench/collectives.py [--world-size 2] [--iters 200] [--compiled [--backend inductor]]

Each rank runs, inside one shard_map body (unchecked and checked), a loop of
fs.lax.{psum, all_gather, psum_scatter, all_to_all} and the same collective through
torch.distributed's c10d API (``dist.all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``) on the same tensor sizes, and reports
the median time per call and the ratio fshard / torch.

``--compiled`` adds a third mode, compiled against compiled, timed call by call from
outside (each call is a whole compiled program): ``fs.jit`` of an unchecked shard_map whose
body is the one fs.lax collective (its input sharded ``P("x")``, the same local block), and
``torch.compile(fullgraph=True)`` of the same collective through
``torch.distributed._functional_collectives`` (the ops Dynamo traces into a graph; the c10d
calls above are in-place and not traceable as they are), both compiled by ``--backend``.
Each compiled call's result is checked against the eager call of the same function.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs
from fshard import P


# torch 2.13 renamed these; take whichever this torch has.
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _time(fn, iters):
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _compiled(mesh, numel, iters, backend):
    """``{collective: (torch.compile, fs.jit)}``: median seconds per call for a local block of
    ``numel`` float32 elements. Raises if a compiled result differs from its eager call's, or
    fs.jit's from torch's (the same collective on the same block)."""
    import torch.distributed._functional_collectives as funcol

    n, r = dist.get_world_size(), dist.get_rank()
    g = mesh.group("x")
    # The same global input on every rank (seeded): this rank's block of it is the native input.
    xg = torch.randn(numel * n, generator=torch.Generator().manual_seed(0))
    xs, local = fs.shard(xg, P("x"), mesh), xg.chunk(n)[r]
    # torch 2.13 renamed these too (same arguments); take whichever this torch has.
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    native = {
        "psum": lambda x: funcol.all_reduce(x, "sum", g),
        "all_gather": lambda x: ag(x, 0, g),
        "psum_scatter": lambda x: rs(x, "sum", 0, g),
        "all_to_all": lambda x: funcol.all_to_all_single(x, None, None, g),
    }
    ours = {  # (the collective on the local block, the out spec of its result)
        "psum": (lambda b: fs.lax.psum(b, "x"), P()),
        "all_gather": (lambda b: fs.lax.all_gather(b, "x", tiled=True), P()),
        "psum_scatter": (lambda b: fs.lax.psum_scatter(b, "x", tiled=True), P("x")),
        "all_to_all": (lambda b: fs.lax.all_to_all(b, "x", 0, 0, tiled=True), P("x")),
    }
    res = {}
    for k in native:
        tc = torch.compile(native[k], fullgraph=True, backend=backend)
        body, spec = ours[k]
        f = fs.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=spec, check=False)
        jf = fs.jit(f, backend=backend)
        want_native = funcol.wait_tensor(native[k](local))
        want_ours = f(xs).to_local()
        got_native, got_ours = tc(local), jf(xs).to_local()
        for what, got, want in (("torch.compile", got_native, want_native), ("fs.jit", got_ours, want_ours),
                                ("fs.jit (against torch.compile)", got_ours, got_native)):
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
                raise RuntimeError(f"{k}, {numel * 4} bytes: {what} differs from its eager call by "
                                   f"{(got - want).abs().max().item()}")
        res[k] = (_time(lambda: tc(local), iters), _time(lambda: jf(xs), iters))
    return res


def per_rank(iters, sizes, compiled=False, backend="inductor"):
    n = dist.get_world_size()
    mesh = fs.make_mesh({"x": n})
    g = mesh.group("x")
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        out_ag = torch.empty(numel * n)
        out_rs = torch.empty(numel // n)
        out_a2a = torch.empty(numel)
        native = {
            "psum": lambda: dist.all_reduce(x.clone(), group=g),
            "all_gather": lambda: _ag(out_ag, x, group=g),
            "psum_scatter": lambda: _rs(out_rs, x, group=g),
            "all_to_all": lambda: dist.all_to_all_single(out_a2a, x, group=g),
        }
        ours = {
            "psum": lambda: fs.lax.psum(x, "x"),
            "all_gather": lambda: fs.lax.all_gather(x, "x", tiled=True),
            "psum_scatter": lambda: fs.lax.psum_scatter(x, "x", tiled=True),
            "all_to_all": lambda: fs.lax.all_to_all(x, "x", 0, 0, tiled=True),
        }
        for check in (False, True):
            def body(_):
                res = {}
                for k in native:
                    t_native = _time(native[k], iters)
                    t_ours = _time(ours[k], iters)
                    res[k] = (t_native, t_ours)
                return torch.zeros(1), res
            f = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(), None), check=check)
            _, res = f(torch.zeros(1))
            for k, (tn, to) in res.items():
                rows.append((numel * 4, k, "checked" if check else "unchecked", tn, to))
        if compiled:
            for k, (tn, to) in _compiled(mesh, numel, iters, backend).items():
                rows.append((numel * 4, k, "compiled", tn, to))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--compiled", action="store_true",
                    help="also each collective under fs.jit against torch.compile of its functional collective")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    sizes = [1024, 256 * 1024, 4 * 1024 * 1024 // 4]
    rows = fs.run_local(per_rank, args.iters, sizes, args.compiled, args.backend, world_size=args.world_size,
                        timeout_s=3000)[0]
    print(f"world size {args.world_size}, gloo, median of {args.iters} calls"
          + (f"; compiled: fs.jit / torch.compile, backend {args.backend}" if args.compiled else ""))
    print(f"{'bytes':>10} {'collective':>13} {'mode':>9} {'torch us':>10} {'fshard us':>10} {'ratio':>6}")
    for nbytes, k, mode, tn, to in rows:
        print(f"{nbytes:>10} {k:>13} {mode:>9} {tn * 1e6:>10.1f} {to * 1e6:>10.1f} {to / tn:>6.2f}")


if __name__ == "__main__":
    main()

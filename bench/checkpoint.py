"""Checkpoint throughput: fs.checkpoint.save / load of a ~50 MB sharded pytree on 2 ranks.

Two local gloo ranks (fs.run_local) hold float32 params sharded P("x"); each rank
writes and reads its half. Timed: a blocking save (DCP write with fsync, then the
commit rename), the time a non-blocking save takes to return (the copy to CPU
memory) and its total time, a load onto the same mesh, and a resharding load of the
whole tree onto P() (every rank reads everything). Repeats and prints medians.

    PYTHONPATH=. python bench/checkpoint.py [--mb 50] [--repeats 3] [--dir /tmp]

MB/s counts the tree's bytes (for the resharding load: the bytes each rank reads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fshard as fs
import fshard.checkpoint as ckpt
from fshard import P
from fshard import tree as tree_util


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _tree(mb: int) -> dict:
    n_layers = 8
    per = mb * 2**20 // 4 // (n_layers + 1)
    cols = 1024
    rows = max(2, per // cols // 2 * 2)
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(rows, cols, generator=g),
            "layers": [{"w": torch.randn(rows, cols, generator=g)} for _ in range(n_layers)],
            "step": 10}


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _body(root: str, mb: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"x": dist.get_world_size()})
    params = fs.shard(_tree(mb), P("x"), mesh)
    nbytes = sum(x.numel() * x.element_size() for x in tree_util.leaves(params) if isinstance(x, torch.Tensor))
    path = os.path.join(root, "ck")
    like_full = fs.shard(tree_util.tree_map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x,
                                            _tree(mb)), P(), mesh)
    out: dict[str, list[float]] = {"save": [], "async_return": [], "async_total": [], "load": [], "load_P()": []}
    for _ in range(repeats):
        out["save"].append(_timed(lambda: ckpt.save(path, params)))
        box = {}

        def run_async():
            t0 = time.perf_counter()
            box["h"] = ckpt.save(path, params, blocking=False)
            box["ret"] = time.perf_counter() - t0
            box["h"].wait()

        out["async_total"].append(_timed(run_async))
        out["async_return"].append(box["ret"])
        out["load"].append(_timed(lambda: ckpt.load(path, like=params)))
        out["load_P()"].append(_timed(lambda: ckpt.load(path, like=like_full)))
    return {"bytes": nbytes, **{k: statistics.median(v) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fshard-ckpt-bench-", dir=args.dir)
    try:
        r = fs.run_local(_body, root, args.mb, args.repeats, world_size=args.ranks)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = r["bytes"] / 2**20
    print(f"{mb:.1f} MB float32 sharded P('x') on {args.ranks} ranks, median of {args.repeats}:")
    for name, what in [("save", "save (blocking; fsync + commit)"),
                       ("async_total", "save (blocking=False), until wait() returns"),
                       ("load", "load onto the same mesh"),
                       ("load_P()", "load resharded to P() (each rank reads all)")]:
        print(f"  {what:<48} {r[name] * 1e3:8.1f} ms  {mb / r[name]:8.1f} MB/s")
    print(f"  save(blocking=False) returned after            {r['async_return'] * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

"""4 ranks: all-reduces on the whole world (n=4) and on pairs (tp, fsdp of a 2x2 mesh) while idle (docs/plan.md, 2026-11-27). Run from the repo root: torchrun --standalone --nproc-per-node 4 THIS"""
import sys, time, statistics, torch
torch.set_num_threads(1)
import torch.distributed as dist
import fshard as fs
from fshard import comm
cal = sys.modules["fshard.plan.calibrate"]
fs.init()
r0 = dist.get_rank() == 0
m4 = fs.make_mesh({"ranks": 4})
m22 = fs.make_mesh({"fsdp": 2, "tp": 2})
res = {}
for nb in (2**16, 2**20, 2**22):
    x = torch.ones(nb // 4)
    for name, mesh, axis in (("n4", m4, "ranks"), ("tp2", m22, "tp"), ("fsdp2", m22, "fsdp")):
        g = mesh.group(axis); n = mesh.shape[axis]
        f = lambda: comm.all_reduce(x, g, "sum", axes=(axis,))
        ts = []
        for _ in range(3):
            dist.barrier(); ts.append(cal._timeit(f, repeat=11, sync=lambda: None))
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[(name, nb)] = float(t)
        # beside compute: the other ranks compute while this group reduces? (tp pairs: every pair reduces)
if r0:
    for k, v in res.items():
        n = 4 if k[0] == "n4" else 2
        print(k, f"{v*1e3:.2f} ms; per step {(v/(2*(n-1)))*1e3:.2f} ms, x_step {k[1]/n/1e6:.3f} MB", flush=True)
fs.shutdown()

"""All ranks: a matmul loop, a blocking all-reduce (pairs or the world), and the two interleaved; prints the extra time per collective beside compute (docs/plan.md, 2026-11-27). Run: torchrun --nproc-per-node 4 sync.py"""
import os, time, torch, statistics
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = pairs[r // 2]
world = dist.group.WORLD
a = torch.randn(256, 256)
def comp(k):
    for _ in range(k): torch.mm(a, a)
def timed(fn, n):
    dist.barrier(); t0 = time.perf_counter()
    for _ in range(n): fn()
    t = torch.tensor([time.perf_counter() - t0]); dist.all_reduce(t, op=dist.ReduceOp.MAX); return float(t) / n
res = {}
for rnd in range(3):
    for nbytes in (4096, 262144, 1048576):
        x = torch.ones(nbytes // 4)
        for gname, g in (("pair", mine), ("world", world)):
            for k in (2, 8):
                tc = timed(lambda: comp(k), 60)
                tx = timed(lambda: dist.all_reduce(x, group=g), 60)
                tb = timed(lambda: (comp(k), dist.all_reduce(x, group=g)), 60)
                res.setdefault((nbytes, gname, k), []).append((tc*1e3, tx*1e3, (tb - tc - tx)*1e3))
if r == 0:
    for key, v in sorted(res.items()):
        print(key, " | ".join(f"comp {c:.2f} coll {x:.2f} extra {e:+.2f}" for c, x, e in v))
dist.destroy_process_group()

"""Time value_and_grad(shard_map) over n distinct blocks at b samples, all ranks at once (sustained). Run: torchrun --nproc-per-node 4 blocks.py (fs.plan validation of 2026-11-27, docs/plan.md)."""
import os, sys, time, torch, optree
import torch.distributed as dist
torch.set_num_threads(1)
import fshard as fs
from fshard.mesh.spec import PartitionSpec as P
from fshard.models import transformer_init, TransformerConfig
from fshard.models.transformer import block as block_fn
from fshard.plan.calibrate import _sustained
dist.init_process_group("gloo")
mesh = fs.make_mesh({"ranks": dist.get_world_size()})
cfg = TransformerConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
g = torch.Generator().manual_seed(0)
with torch.device("meta"):
    shapes = transformer_init(cfg, 0)["layers"]
params = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.02), shapes)
def make(n):
    def f(ps, x):
        for p in ps[:n]:
            x = block_fn(p, x, cfg)
        return x.sum()
    return fs.value_and_grad(fs.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P()), argnums=(0, 1))
min_s = float(os.environ.get("MIN_S", "0.15"))
res = {}
for rep in range(int(os.environ.get("REPS", "3"))):
    for n in (1, 2, 4):
        for b in (1, 4):
            x = torch.randn(b, 128, 256, generator=g)
            gf = make(n)
            t = _sustained(lambda: gf(params, x), repeat=3, sync=lambda: None, barrier=dist.barrier,
                           device=torch.device("cpu"), min_s=min_s)
            res.setdefault((n, b), []).append(t * 1e3)
if dist.get_rank() == 0:
    for k, v in sorted(res.items()):
        print(k, " ".join(f"{x:6.1f}" for x in v))
dist.destroy_process_group()

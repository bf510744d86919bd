"""(docs/plan.md, 2026-11-27; run from the repo root) 4 ranks: one block's fwd+bwd under value_and_grad(shard_map), with and without remat, 1 and 4 samples."""
import sys, functools, torch, optree
torch.set_num_threads(1)
import torch.distributed as dist
import fshard as fs
from fshard.mesh.spec import PartitionSpec as P
from fshard.models import transformer_init, TransformerConfig
from fshard.models.transformer import block as block_fn
from fshard.transforms.remat import remat as remat_fn
cal = sys.modules["fshard.plan.calibrate"]
fs.init()
mesh = fs.make_mesh({"ranks": 4})
cfg = TransformerConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, max_seq_len=128)
with torch.device("meta"):
    shapes = transformer_init(cfg, 0)["layers"][0]
g = torch.Generator().manual_seed(0)
params = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.02), shapes)
def body(n, remat):
    def f(p, x):
        for _ in range(n):
            x = remat_fn(lambda p, x: block_fn(p, x, cfg))(p, x) if remat else block_fn(p, x, cfg)
        return x.sum()
    return f
fns = {}
for n in (1, 4):
    for b in (1, 4):
        x = torch.randn(b, 128, 256, generator=g)
        for r in (False, True):
            vg = fs.value_and_grad(fs.shard_map(body(n, r), mesh=mesh, in_specs=(P(), P()), out_specs=P()), argnums=(0, 1))
            fns[(n, b, r)] = functools.partial(vg, params, x)
t = cal._medians_in_turn(fns, 3, repeat=3, sync=lambda: None, barrier=dist.barrier, device=torch.device("cpu"))
if dist.get_rank() == 0:
    for (n, b, r), v in t.items():
        print(n, b, "remat" if r else "plain", f"{v*1e3:.1f} ms", flush=True)
fs.shutdown()

"""One process: a block forward + backward under value_and_grad(shard_map) against plain autograd, 1 and 4 blocks per call, 1 and 4 samples (docs/plan.md, 2026-11-27). Run: python sm.py"""
import time, torch, optree, statistics
torch.set_num_threads(1)
import fshard as fs
from fshard.mesh.spec import PartitionSpec as P
from fshard.models import transformer_init, TransformerConfig
from fshard.models.transformer import block as block_fn
cfg = TransformerConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, max_seq_len=128)
with torch.device("meta"):
    shapes = transformer_init(cfg, 0)["layers"][0]
g = torch.Generator().manual_seed(0)
p = optree.tree_map(lambda t: (torch.randn(t.shape, generator=g) * 0.02).requires_grad_(), shapes)
mesh = fs.make_mesh({"r": 1})
def body(n):
    def f(p, x):
        for _ in range(n): x = block_fn(p, x, cfg)
        return x.sum()
    return f
def t(fn, k=8):
    for _ in range(2): fn()
    ts=[]
    for _ in range(k):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    return statistics.median(ts)*1e3
for n in (1, 4):
    for b in (1, 4):
        x = torch.randn(b, 128, 256)
        sm = fs.value_and_grad(fs.shard_map(body(n), mesh=mesh, in_specs=(P(), P()), out_specs=P()), argnums=(0, 1))
        leaves = optree.tree_leaves(p)
        def plain():
            loss = body(n)(p, x); torch.autograd.grad(loss, leaves)
        print(n, b, f"shard_map {t(lambda: sm(p, x)):.1f} ms, plain autograd {t(plain):.1f} ms", flush=True)

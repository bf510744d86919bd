"""(docs/plan.md, 2026-11-27; run from the repo root) 4 ranks: calibrate, then time the model's own replicated step body and update against the estimate's parts."""
import sys, time, statistics, functools, json
sys.path.insert(0, "examples")
import torch, torch.nn.functional as F, optree
torch.set_num_threads(1)
import torch.distributed as dist
import fshard as fs
import fshard.plan as plan
from fshard.mesh.spec import PartitionSpec as P
from fshard.mesh.sharding import shard
from fshard.models import transformer_init
from fshard.models.transformer import embed, block, head
import train_lm
cal = sys.modules["fshard.plan.calibrate"]
est_mod = sys.modules["fshard.plan.estimate"]

dist.init_process_group("gloo")
mesh = fs.make_mesh({"ranks": 4})
args = train_lm.parse_args(["--dim", "256", "--layers", "4", "--heads", "4", "--seq-len", "128", "--batch-size", "16"])
corpus = train_lm.CharCorpus.load(args.data)
cfg = train_lm.model_config(args, corpus)
t0 = time.time()
machine = plan.calibrate(mesh, path="", quick="quick" in sys.argv, block=cfg)
if dist.get_rank() == 0: print("calibrate", time.time() - t0, "s;", machine.notes[:400], flush=True)
sync = lambda: None
barrier = dist.barrier
g = torch.Generator().manual_seed(0)
params = transformer_init(cfg, 0)
b = int(dict(a.split("=") for a in sys.argv[1:] if "=" in a).get("b", 1))
tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_seq_len), generator=g)
targets = torch.randint(0, cfg.vocab_size, (b, cfg.max_seq_len), generator=g)

def loss_fn(p, tok, tgt):
    root = {k: v for k, v in p.items() if k != "layers"}
    x = embed(root, tok, cfg)
    x = fs.parallel.scan_layers(lambda l, x: block(l, x, cfg), p["layers"], x, axis=None)
    logits = head(root, x, cfg)
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())

vg = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P()))
dparams = shard(params, P(), mesh) if False else None
def body():
    loss, gr = vg(params, tokens, targets)
    float(loss)
dtp = shard(params, P(), mesh)
dtok, dtgt = shard(tokens, P(), mesh), shard(targets, P(), mesh)
def dbody():
    loss, gr = vg(dtp, dtok, dtgt)
    float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
# update on the model's own leaves as DTensors (replicated)
leaves, treedef = optree.tree_flatten(params)
dp = [shard(t.detach().clone(), P(), mesh) for t in leaves]
dg = [shard(torch.randn(t.shape, generator=g) * 1e-3, P(), mesh) for t in leaves]
opt = fs.optim.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
box = [dp, opt.init(dp)]
def update():
    norm = float(fs.optim.global_norm(dg))
    clipped = [x * (1.0 / (norm + 1e-6)) for x in dg]
    with fs.optim.donate():
        u, box[1] = opt.update(clipped, box[1], box[0])
        box[0] = fs.optim.apply_updates(box[0], u)
t = cal._medians_in_turn({"body": body, "dbody": dbody, "update": update}, 3, repeat=3, sync=sync, barrier=barrier, device=mesh.device)
model = plan.describe_transformer(cfg, seq_len=cfg.max_seq_len, dtype="float32")
e = plan.estimate(model, machine, plan.Layout({"dp": 4}, batch=4 * b))
if dist.get_rank() == 0:
    print(f"b={b} leaves {len(leaves)}; measured body {t['body']*1e3:.1f} ms, dtensor body {t['dbody']*1e3:.1f}, update {t['update']*1e3:.1f} ms", flush=True)
    print("estimate dp=4:", {k: round(v * 1e3, 1) for k, v in e.breakdown.items()}, flush=True)
    print("machine call", machine.call_overhead_s*1e3, "layer", machine.layer_overhead_s*1e3, "eff", machine.matmul_efficiency, "optleaf", machine.optimizer_leaf_overhead_s*1e3)
dist.destroy_process_group()

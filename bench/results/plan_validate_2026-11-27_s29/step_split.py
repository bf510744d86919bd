"""(docs/plan.md, 2026-11-27; run from the repo root) 4 ranks: train_lm's own grad call and update timed apart, per layout, against the estimate's parts.
usage: torchrun --nproc-per-node 4 step_split.py [quick]"""
import sys, time, statistics, functools
sys.path.insert(0, "examples")
import torch
torch.set_num_threads(1)
import torch.distributed as dist
import fshard as fs
import fshard.plan as plan
import train_lm
cal = sys.modules["fshard.plan.calibrate"]
fs.init()
MODEL = ["--dim", "256", "--layers", "4", "--heads", "4", "--seq-len", "128", "--batch-size", "16"]
base = train_lm.parse_args(MODEL)
corpus = train_lm.CharCorpus.load(base.data)
cfg0 = train_lm.model_config(base, corpus)
machine = plan.calibrate(fs.make_mesh({"ranks": 4}), path="", quick="quick" in sys.argv, block=cfg0)
rank0 = dist.get_rank() == 0
if rank0: print(machine.notes[:300], flush=True)
fns = {}
preds = {}
for mesh_s, extra in [("dp=4", []), ("fsdp=4", []), ("fsdp=2,tp=2", [])]:
    args = train_lm.parse_args(MODEL + ["--mesh", mesh_s] + extra)
    mesh = fs.make_mesh(train_lm.parse_mesh(args.mesh, 4))
    cfg, pl, model, pipe, mb = train_lm.configure(args, mesh, corpus)
    params, specs = train_lm.init_params(cfg, pl, 0, pipe)
    opt = train_lm.make_optimizer(args)
    st = [params, opt.init(params)]
    grad_fn = train_lm.make_grad_fn(model, pl, specs)
    tok, tgt = corpus.batch(0, 16, 128, 0)
    with torch.device("meta"):
        paths, _, _ = fs.tree.zip_with_path(train_lm.transformer_init(cfg, 0))
    order = {p: i for i, p in enumerate(paths)}
    saved = {}
    def grads(grad_fn=grad_fn, st=st, tok=tok, tgt=tgt, saved=saved):
        loss, g = grad_fn(st[0], tok, tgt, None, True)
        float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        saved["g"], saved["loss"] = g, loss
    grads()
    def update(st=st, saved=saved, opt=opt, pl=pl, order=order):
        # a fresh copy of the grads: apply_gradients' clip makes new ones anyway
        st[0], st[1], _, _ = train_lm.apply_gradients(st[0], st[1], saved["g"], saved["loss"], opt, pl, 1.0, order)
    def step(grads=grads, update=update):
        grads(); update()
    fns[mesh_s + " grad"] = grads
    fns[mesh_s + " update"] = update
    fns[mesh_s + " step"] = step
    e = plan.estimate(plan.describe_transformer(cfg, seq_len=128, dtype="float32"), machine,
                      train_lm.plan_layout(args, dict(mesh.shape), mb))
    preds[mesh_s] = e.breakdown
t = cal._medians_in_turn(fns, 1 if "quick" in sys.argv else 3, repeat=3, sync=lambda: None, barrier=dist.barrier,
                         device=torch.device("cpu"))
if rank0:
    for k, v in t.items():
        print(f"{k:24s} {v*1e3:7.1f} ms", flush=True)
    for k, b in preds.items():
        print(k, {kk: round(v * 1e3, 1) for kk, v in b.items()}, "total", round(sum(b.values()) * 1e3, 1), flush=True)
fs.shutdown()

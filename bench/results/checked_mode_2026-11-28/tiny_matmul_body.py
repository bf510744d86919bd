import time, statistics, torch
import fshard as fs
from fshard import P
torch.set_num_threads(1)
mesh = fs.make_mesh({"dp": 1})
torch.manual_seed(0)
W = [torch.randn(64, 64) for _ in range(8)]
x = torch.randn(16, 64)
def loss(W, x):
    h = x
    for w in W:
        h = torch.tanh(h @ w) + h * 0.5
        h = h - h.mean(-1, keepdim=True)
    return fs.lax.pmean((h ** 2).mean(), "dp")
steps = {c: fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), check=c) for c in (True, False)}
for s in steps.values():
    for _ in range(5): s(W, x)
ts = {True: [], False: []}
for _ in range(200):
    for c, s in steps.items():
        t0 = time.thread_time(); s(W, x); ts[c].append(time.thread_time() - t0)
q = {c: sorted(v)[len(v)//10] for c, v in ts.items()}  # 10th percentile: the least disturbed
print(f"checked {q[True]*1e3:.3f} ms unchecked {q[False]*1e3:.3f} ms extra {(q[True]-q[False])*1e3:.3f} ms")

"""BatchNorm running statistics under fsdp_apply's DDP: a small ResNet-style conv net,
float64, per-rank-different batches, 4 AdamW steps, against a one-process torch reference.

The forward normalizes with each rank's own batch statistics (torch DDP without
SyncBatchNorm). ``sync_buffers="local"`` returns rank 0's running statistics on every
rank (torch DDP's ``broadcast_buffers``); ``"mean"`` averages them over the data axis.
The reference runs the module on each rank's rows with its own copy of the buffers and
averages the losses.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

STEPS, ROWS, LR = 4, 3, 1e-2


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Net(nn.Module):
    def __init__(self, c=4, classes=5):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.layers = nn.ModuleList([ResBlock(c), ResBlock(c)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x):  # (B, 3, H, W) -> (B, classes)
        h = F.relu(self.bn(self.stem(x)))
        for layer in self.layers:
            h = layer(h)
        return self.fc(h.mean((2, 3)))


def _batch(step, n):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n * ROWS, 3, 5, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (n * ROWS,), generator=g)


def _ref_step(ref, opt, x, y, n, mode):
    """One step of the n-rank program in one process: each rank's rows with its own buffer copy."""
    params = dict(ref.named_parameters())
    buffers = dict(ref.named_buffers())
    losses, copies = [], []
    for r in range(n):
        mine = {k: v.clone() for k, v in buffers.items()}
        out = torch.func.functional_call(ref, {**params, **mine}, (x[r * ROWS:(r + 1) * ROWS],))
        losses.append(F.cross_entropy(out, y[r * ROWS:(r + 1) * ROWS]))
        copies.append(mine)
    loss = torch.stack(losses).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for k, b in buffers.items():
            if mode == "mean" and b.is_floating_point():
                b.copy_(torch.stack([c[k] for c in copies]).mean(0))
            else:
                b.copy_(copies[0][k])
    return loss.item()


def _train(mode, order, n=2):
    mesh = fs.make_mesh({"dp": n})
    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    apply, params, buffers = fs.nn.functionalize(model)
    ddp = fs.parallel.fsdp_apply(apply, blocks="layers", axis=None, replicate_axis="dp", sync_buffers=mode)
    specs, bspecs = fs.parallel.replicate_specs(params), fs.parallel.replicate_specs(buffers)
    opt = fs.optim.adamw(LR)

    def loss_fn(p, b, x, y):
        out, new_b = ddp(p, x, buffers=b, return_buffers=True)
        return fs.lax.pmean(F.cross_entropy(out, y), "dp"), new_b

    in_specs = (specs, bspecs, P("dp"), P("dp"))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=in_specs, out_specs=(P(), bspecs)),
                                 has_aux=True)
    else:
        step = fs.shard_map(fs.value_and_grad(loss_fn, has_aux=True), mesh=mesh, in_specs=in_specs,
                            out_specs=((P(), bspecs), specs))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    p, b, losses = fs.shard(params, specs, mesh), fs.shard(buffers, bspecs, mesh), []
    state = opt.init(p)
    for s in range(STEPS):
        x, y = _batch(s, n)
        (loss, b), grads = step(p, b, x, y)
        updates, state = opt.update(grads, state, p)
        p = fs.optim.apply_updates(p, updates)
        losses.append((loss.item(), _ref_step(ref, ref_opt, x, y, n, mode)))
    _, want_p, want_b = fs.nn.functionalize(ref)
    diff = lambda a, w: max((u.double() - v.double()).abs().max().item()
                            for u, v in zip(fs.tree.leaves(fs.gather(a)), fs.tree.leaves(w)))
    return losses, diff(p, want_p), diff(b, want_b), fs.gather(b), p


def _torch_ddp(n=2):
    """torch's own DDP (broadcast_buffers=True) on the same data: rank 0's module after the steps."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net().double())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    r = torch.distributed.get_rank()
    for s in range(STEPS):
        x, y = _batch(s, n)
        opt.zero_grad()
        F.cross_entropy(ddp(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]).backward()
        opt.step()
    return fs.nn.functionalize(ddp.module)[1:]


def _both():
    local, mean = _train("local", "outside"), _train("mean", "inside")
    params, buffers = _torch_ddp()
    b = local[3]
    diff = lambda a, w: max((u.double() - v.double()).abs().max().item()
                            for u, v in zip(fs.tree.leaves(a), fs.tree.leaves(w)))
    # Only torch's rank 0 holds rank 0's statistics after the last step (the others apply
    # theirs until the next forward broadcasts rank 0's).
    vs_torch_b = diff(b, buffers) if torch.distributed.get_rank() == 0 else 0.0
    return local[:3], mean[:3], diff(b, mean[3]), vs_torch_b, diff(fs.gather(local[4]), params)


def test_batchnorm_buffers_under_ddp():
    for local, mean, modes_apart, vs_torch_b, vs_torch_p in run_on_ranks(_both, world_size=2):
        for losses, dp, db in (local, mean):
            for got, want in losses:
                assert abs(got - want) < 1e-10, (got, want)
            assert dp < 1e-10 and db < 1e-10, (dp, db)
        assert modes_apart > 1e-4  # the two modes really differ (a flag that did nothing would pass above)
        # "local" is torch DDP's behaviour: its rank 0 holds the same buffers and parameters.
        assert vs_torch_b < 1e-10 and vs_torch_p < 1e-10, (vs_torch_b, vs_torch_p)

"""Dropless MoE vs capacity dispatch vs torchtitan's recipe on native PyTorch, one MoE layer.

    python bench/moe.py [--ep 2 4] [--tokens 2048] [--steps 5]

The layer: ``T`` tokens per rank of width ``D = 128``, ``E = 8`` experts of hidden ``H =
256`` (GELU), top-2 softmax routing, float32, forward and backward (gradients of the
tokens, the router and the experts for a fixed cotangent), experts split over ``ep`` gloo
ranks, one thread per rank. The router is skewed (a bias towards expert 0), so experts
get uneven rows, as trained routers give them.

- ``dropless``: ``fs.parallel.moe_ffn(capacity_factor=None)`` in a ``shard_map``: every
  assignment reaches its expert (``fs.lax.ragged_all_to_all`` twice, ``torch._grouped_mm``).
- ``dropless loop``: the same with the experts as one matmul per expert.
- ``capacity 1.25``: ``moe_ffn(capacity_factor=1.25)``: fixed slots, ``all_to_all``, tokens
  over capacity dropped, padding computed and sent.
- ``native``: torchtitan's recipe on torch alone: counts by ``all_to_all_single``, the
  tokens by ``funcol.all_to_all_single_autograd`` (as torchtitan) with per-peer split
  sizes, a permutation to expert-major rows, ``torch._grouped_mm``, and back.

The dropless sides and native compute the same function: outputs and gradients are
compared (float32: 1e-4) before timing. Step time = slowest rank, median of ``--steps``
rounds after 2 warm-ups, the sides alternating in the same processes. Bytes: what one rank
sends per step (``fs.comm_log``'s wire bytes for fshard's sides; the split sizes for native).

Physical limit (``bench/_limits.py``): compute = the dropless step with both exchanges taken
out (the same kernels on the same shapes, every rank timing at once); wire = native's bytes
at the rate of a large all-reduce on the same group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.parallel import _dropless
from fshard.parallel.ep import ep_specs, moe_ffn, moe_init

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _limits import Limit, cores, link_rate, slowest  # noqa: E402
from data_parallel import timed_rounds  # noqa: E402

D, H, E, TOP_K = 128, 256, 8, 2
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")  # time what a torchrun job runs


def _inputs(n_ranks: int, tokens: int):
    p = moe_init(D, H, E, 0, router_std=0.5)
    p["router"]["weight"][0] += 0.3  # skew: expert 0 is popular
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_ranks * tokens, D, generator=g).abs()
    dy = torch.randn(n_ranks * tokens, D, generator=g)
    return p, x, dy


def native_layer(p, x, group, n_ep):
    """torchtitan's dispatch (``all_to_all_single`` + ``_grouped_mm``) on this rank's tokens
    ``x`` and its ``E / ep`` experts ``p["experts"]``: ``(N, D)``."""
    n, e_local = x.shape[0], E // n_ep
    logits = F.linear(x, p["router"]["weight"])
    top_p, experts = logits.softmax(-1).topk(TOP_K, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order.div(TOP_K, rounding_mode="floor"))
    counts = torch.bincount(flat, minlength=E)  # rows per global expert, sorted by expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # (source, local expert)
    send = counts.view(n_ep, e_local).sum(1).tolist()
    recv_ce = recv_counts.view(n_ep, e_local)
    recv = recv_ce.sum(1).tolist()
    got = funcol.all_to_all_single_autograd(rows, recv, send, group)
    # Received rows are (source, local expert)-major; the GEMM wants expert-major.
    src_start = (recv_ce.reshape(-1).cumsum(0) - recv_ce.reshape(-1)).view(n_ep, e_local)
    perm = torch.cat([torch.arange(int(src_start[s, j]), int(src_start[s, j] + recv_ce[s, j]))
                      for j in range(e_local) for s in range(n_ep)])
    xe = got.index_select(0, perm)
    offs = recv_ce.sum(0).cumsum(0).to(torch.int32)
    w = p["experts"]
    h = F.gelu(torch._grouped_mm(xe, w["w1"].transpose(-2, -1), offs=offs))
    ye = torch._grouped_mm(h, w["w2"].transpose(-2, -1), offs=offs)
    back = torch.empty_like(ye).index_copy(0, perm, ye)
    out = funcol.all_to_all_single_autograd(back.contiguous(), send, recv, group)
    out = torch.empty_like(out).index_copy(0, order, out).view(n, TOP_K, D)
    me = dist.get_rank(group)
    return (out * gates.unsqueeze(-1)).sum(1), sum(send) - send[me] + sum(recv) - recv[me]


def _sides(n_ep: int, tokens: int):
    mesh = fs.make_mesh({"ep": n_ep})
    p, x, dy = _inputs(n_ep, tokens)
    specs = ep_specs(p, "ep")
    sharded = fs.shard(p, specs, mesh)
    me = dist.get_rank()
    local_x, local_dy = (t[me * tokens : (me + 1) * tokens] for t in (x, dy))

    def fshard_side(cf, grouped=None):
        def body(p, x, dy):
            p, x = fs.tree.tree_map(lambda t: t.detach().requires_grad_(), (p, x))
            saved = _dropless.expert_gemms
            if grouped is not None:
                _dropless.expert_gemms = lambda *a, **k: saved(*a, **{**k, "grouped": grouped})
            try:
                y = moe_ffn(p, x, top_k=TOP_K, capacity_factor=cf, ep_axis="ep")
            finally:
                _dropless.expert_gemms = saved
            gx, gr, g1, g2 = torch.autograd.grad(y, (x, p["router"]["weight"], p["experts"]["w1"],
                                                     p["experts"]["w2"]), dy)
            return y.detach(), gx, fs.lax.psum(gr, "ep"), g1, g2

        out = (P("ep"), P("ep"), P(), P("ep"), P("ep"))
        return fs.shard_map(body, mesh=mesh, in_specs=(specs, P("ep"), P("ep")), out_specs=out, check=False)

    group = mesh.group(("ep",))
    local_p = {"router": {"weight": p["router"]["weight"]},
               "experts": {k: v.chunk(n_ep)[me] for k, v in p["experts"].items()}}

    def native():
        q = fs.tree.tree_map(lambda t: t.detach().requires_grad_(), local_p)
        xx = local_x.detach().requires_grad_()
        y, sent = native_layer(q, xx, group, n_ep)
        gx, gr, g1, g2 = torch.autograd.grad(y, (xx, q["router"]["weight"], q["experts"]["w1"], q["experts"]["w2"]),
                                             local_dy)
        dist.all_reduce(gr, group=group)  # the router is replicated: its gradient summed, as shard_map's P()
        return (y.detach(), gx, gr, g1, g2), sent  # sent: rows this rank sends to others per forward

    sides = {"dropless": (fshard_side(None), (sharded, x, dy)),
             "dropless loop": (fshard_side(None, grouped=False), (sharded, x, dy)),
             "capacity 1.25": (fshard_side(1.25), (sharded, x, dy))}
    return sides, native


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def per_rank(n_ep: int, tokens: int, steps: int) -> dict:
    sides, native = _sides(n_ep, tokens)
    ref = [_local(t) for t in sides["dropless"][0](*sides["dropless"][1])]
    mine, sent_rows = native()
    worst = max((a - b).abs().max().item() for a, b in zip(ref, mine))
    assert worst < 1e-4, f"dropless and native differ by {worst}"
    wire = {}
    for name, (f, args) in sides.items():
        with fs.comm_log() as log:
            f(*args)
        wire[name] = dict(log.wire)  # bytes sent per kind
    # Rows to other ranks: dispatch (sent) and combine (received), each again in backward.
    native_bytes = 2 * sent_rows * D * 4
    wire["native"] = {"all_to_all_single": native_bytes}
    steps_of = {name: (lambda f=f, a=args: f(*a)) for name, (f, args) in sides.items()}
    steps_of["native"] = native
    times, _, _ = timed_rounds(steps_of, steps, warmup=2)
    compute = _no_exchange(sides["dropless"], steps)
    busiest = int(slowest(float(native_bytes)))  # the rank that sends the most bounds the step
    limit = Limit(compute, busiest, link_rate(), ranks=n_ep, cores=cores())
    return {"times": {k: statistics.median(t) for k, t in times.items()}, "wire": wire, "worst": worst,
            "limit": limit}


def _no_exchange(side, steps: int) -> float:
    """The dropless step with both ragged exchanges returning their output buffers: the same
    GEMMs on the same shapes, no token bytes moved (the counts' all_gather stays); the slowest
    rank's median."""
    f, args = side
    saved, calls = _dropless.lax._ragged_planned, []

    def local(operand, output, table, axis_name):
        calls.append(1)
        return output + operand.sum() * 0  # keeps the operand in the graph: backward runs too

    _dropless.lax._ragged_planned = local
    try:
        out = []
        for _ in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            f(*args)
            out.append(slowest(time.perf_counter() - t0))
    finally:
        _dropless.lax._ragged_planned = saved
    assert calls, "the dropless layer no longer calls fs.lax._ragged_planned: the limit would time the exchanges"
    return statistics.median(out[1:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"MoE layer: D={D} H={H} E={E} top-{TOP_K}, float32, forward + backward; load {os.getloadavg()[0]:.1f}")
    for n in args.ep:
        r = fs.run_local(per_rank, n, args.tokens, args.steps, world_size=n, timeout_s=3000)[0]
        t, w = r["times"], r["wire"]
        print(f"ep={n}, {args.tokens} tokens per rank (dropless vs native differ by {r['worst']:.1e}):")
        for k in t:
            print(f"  {k:>14}: {t[k] * 1e3:7.1f} ms  {t[k] / t['native']:.2f} x native  {sum(w[k].values()) / 2**20:6.2f} MiB sent")
        print(f"    {r['limit'].line(t)}")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

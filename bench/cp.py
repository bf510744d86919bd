"""fshard's ring attention vs torch's context_parallel, same attention, same sequence, same run.

    python bench/cp.py [--seq 1024 2048 4096] [--cp 2 4] [--steps 5] [--memory-cp 1 2 4] [--model-memory]

The attention: causal softmax attention of ``B = 2`` sequences, ``H = 4`` heads of ``hd =
16``, float32, forward and backward (the gradients of q, k and v for a fixed cotangent), each
sequence split over ``cp`` gloo ranks in torchtitan's head-tail order, one thread per rank.

- fshard: ``fs.parallel.ring_attention(q, k, v, "cp")`` in a ``shard_map`` (K/V rotating by
  ``ppermute``, each transfer in flight during a block's compute; the explicit backward).
- torch: ``torch.distributed.tensor.experimental.context_parallel`` around
  ``F.scaled_dot_product_attention`` (its ``_HeadTailLoadBalancer``, K/V all-gathered, its
  default ``set_rotate_method("allgather")``; dK/dV by all-to-all). torch's CP handles only
  CUDA's SDPA kernels; on CPU it raises ("_scaled_dot_product_flash_attention_for_cpu does
  not have a sharding strategy registered"). :func:`torch_cpu_shim` registers that kernel
  and its backward with CP's own dispatcher table, each calling torch's own
  ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` on the CPU kernel:
  the ring, the balancer and the merge stay torch's.

Both sides start from the same q, k, v and cotangent; their outputs and gradients are
compared (float32: 1e-4) before any timing counts. Step time = slowest rank, median of
``--steps`` rounds after 2 warm-up rounds, the sides alternating in the same processes.

Physical limit (``bench/_limits.py``'s terms), measured in the same processes: compute =
fshard's step with every transfer taken out (:class:`_NoTransfer`: the same blocks on the
same kernels, every rank timing at once; the balanced schedule's blocks are ``1 / cp`` of one
process's causal work); wire = the bytes a rank must send (K/V gathered, then again for
backward, and dK/dV reduce-scattered: ``3 (cp - 1)`` local K/V blocks) at the rate of a large
all-reduce on the same group.

Peak memory per rank (``--memory-cp``, every ``--seq``): the allocator's peak during one
forward and backward after a warm-up (``torch.profiler`` memory events, as
``fs.plan.StepProbe`` reads them), beyond the whole-sequence inputs prepared before the step
(each side's copy of this rank's share, its activations, gradients and transfer buffers).
``--model-memory``: the same for a whole train step of ``examples/train_lm.py --mesh cp=N``
(a small Transformer, its ``--log-json`` peak), where attention's ring is one part of a
block's activations.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
from fshard import P, lax
from fshard.parallel import _ring, cp_order, cp_shard, ring_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _limits import Limit, cores, link_rate, slowest  # noqa: E402
from data_parallel import timed_rounds  # noqa: E402

B, H, HD = 2, 4, 16
SEQ = P(None, None, "cp")
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")  # time what a torchrun job runs


def torch_cpu_shim() -> None:
    """Lets torch's ``context_parallel`` run on CPU: its dispatcher table (``custom_ops``, put
    into DTensor's handlers on entering the context) gains the CPU SDPA kernel and its
    backward, each run by torch's own templated ring on the local shards."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def wrap(local, mesh):
        shape = list(local.shape)
        shape[2] *= mesh.size()
        meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
        return DTensor(local, DTensorSpec(mesh, (Shard(2),), tensor_meta=meta), requires_grad=False)

    def forward(op, args, kwargs):
        q, k, v = args[:3]
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None or (args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)):
            raise NotImplementedError("bench/cp.py's shim: no attn_mask, no dropout")
        mesh = q.device_mesh
        out, lse = cp._templated_ring_attention(mesh.get_group(), 2, fwd, q.to_local(), k.to_local(), v.to_local(),
                                                is_causal=causal, dropout_p=0.0, scale=kwargs.get("scale"))
        return wrap(out, mesh), wrap(lse, mesh)

    def backward(op, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        a = {**dict(zip(names, args)), **kwargs}
        mesh = a["query"].device_mesh
        local = {n: a[n].to_local() if isinstance(a[n], DTensor) else a[n] for n in names[:6]}
        grads = cp._templated_ring_attention_backward(mesh.get_group(), 2, bwd, grad_out_name="grad_out",
                                                      is_causal=a["is_causal"], dropout_p=0.0, scale=a.get("scale"),
                                                      **local)
        return tuple(wrap(g, mesh) for g in grads)

    cp.custom_ops[fwd] = forward
    cp.custom_ops[bwd] = backward


def _inputs(T: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, HD, generator=g) for _ in range(4)]  # q, k, v, the cotangent


def _sides(T: int, n: int):
    """``{name: (prepare, run)}`` on this rank (``run(prepare())`` is one step: ``prepare`` is
    the harness's, outside the memory probe), and each side's results in natural order."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard

    mesh = fs.make_mesh({"cp": n})
    order = cp_order(T, n)
    whole = _inputs(T)

    def body(q, k, v, do):  # every rank holds the whole sequences and keeps its share, as torch's CP does
        q, k, v, do = cp_shard([q, k, v, do], "cp", seq_dim=2)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, "cp")
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))

    fsh = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(SEQ,) * 4, check=False)
    torch_mesh = mesh.device_mesh

    def torch_run(bufs):
        # torchtitan's use: the step's tensors sharded in place on entry, not restored on exit.
        with context_parallel(torch_mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
            q, k, v = (t.detach().requires_grad_() for t in bufs[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), bufs[3])
        return (out.detach(), *grads)

    def natural_fshard(res):
        back = torch.argsort(order)
        return [fs.gather(t).index_select(2, back) for t in res]

    def natural_torch(res):
        # context_parallel_unshard gathers torch's local shards back into natural order.
        return [t.to_local() if hasattr(t, "to_local") else t
                for t in context_parallel_unshard(torch_mesh, list(res), [2, 2, 2, 2])]

    sides = {"fshard": (lambda: whole, lambda a: fsh(*a)),
             "torch": (lambda: [t.clone() for t in whole], torch_run)}
    return sides, natural_fshard, natural_torch


def _steps(sides):
    return {name: (lambda p=prepare, r=run: r(p())) for name, (prepare, run) in sides.items()}


def per_rank(T: int, n: int, steps: int) -> dict:
    torch_cpu_shim()
    sides, nat_f, nat_t = _sides(T, n)
    steps_of = _steps(sides)
    a, b = nat_f(steps_of["fshard"]()), nat_t(steps_of["torch"]())
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst < 1e-4, f"the sides differ: {worst}"
    times, _, _ = timed_rounds(steps_of, steps, warmup=2)
    with _no_wire():  # fshard's ring, its transfers taken out: this rank's blocks, kernels and merges
        compute = _median_all(steps_of["fshard"], 3)
    kv_local = 2 * B * H * (T // n) * HD * 4
    limit = Limit(compute, 3 * (n - 1) * kv_local, link_rate(), ranks=n, cores=cores())
    return {"times": {k: statistics.median(t) for k, t in times.items()}, "worst": worst, "limit": limit}


class _NoTransfer:
    """``fs.lax`` as the ring sees it, with every point-to-point transfer returning its input:
    the same blocks on the same shapes (wrong values), no bytes on the wire."""

    def __getattr__(self, name):
        return getattr(lax, name)

    @staticmethod
    def ppermute_start(x, axis, perm):
        return lambda: x

    @staticmethod
    def _permute_start_raw(x, ax, perm):
        return types.SimpleNamespace(wait=lambda: x)

    @staticmethod
    def _permute_raw(x, ax, perm):
        return x


@contextlib.contextmanager
def _no_wire():
    saved, _ring.lax = _ring.lax, _NoTransfer()
    try:
        yield
    finally:
        _ring.lax = saved


def _median_all(fn, steps: int) -> float:
    """The slowest rank's median seconds of ``fn()``, every rank timing at once (one warm-up)."""
    out = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(slowest(time.perf_counter() - t0))
    return statistics.median(out[1:])


def peak_memory(T: int, n: int) -> dict[str, float]:
    """Each side's peak MiB on this rank (the largest rank's): what one forward and backward
    allocates beyond the whole-sequence inputs prepared before it (after a warm-up)."""
    from fshard.plan.probe import StepProbe

    torch_cpu_shim()
    if n == 1:
        def sdpa(args):
            q, k, v, do = args
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

        prepare = lambda: [t.requires_grad_(i < 3) for i, t in enumerate(_inputs(T))]  # noqa: E731
        sides = {"fshard": (prepare, sdpa), "torch": (prepare, sdpa)}  # ring_attention over one rank is SDPA
    else:
        sides = _sides(T, n)[0]
    out = {}
    for name, (prepare, run) in sides.items():
        probe = StepProbe(warmup=1)
        probed = probe.wrap(lambda params, state, args: run(args))
        for _ in range(2):
            args = prepare()
            if dist.is_initialized():
                dist.barrier()
            probed((), (), args)
        peak = torch.tensor([float(probe.peak_bytes)])
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[name] = peak.item() / 2**20
    return out


MODEL = ["--dim", "64", "--layers", "2", "--heads", "4", "--batch-size", "2", "--steps", "4", "--quiet",
         "--sample-chars", "0", "--machine", "h100"]


def model_memory(T: int, n: int, log: str) -> float:
    """``examples/train_lm.py --mesh cp=n --seq-len T`` on this rank: the largest rank's peak MiB
    of one train step (its ``--log-json`` measurement: ``fs.plan.StepProbe``)."""
    from _examples import example

    from fshard.recipes.sinks import read_log

    example("train_lm").main(MODEL + ["--mesh", f"cp={n}", "--seq-len", str(T), "--log-json", log])
    if dist.is_initialized():
        dist.barrier()
    return read_log(log, "summary")[-1]["measured_peak_mib"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--cp", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--memory-cp", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model-memory", action="store_true", help="also train_lm.py's peak per rank at each --seq "
                    "and --memory-cp")
    args = ap.parse_args()
    print(f"causal attention, B={B} H={H} hd={HD} float32, forward + backward; load {os.getloadavg()[0]:.1f}")
    for n in args.cp:
        for T in args.seq:
            r = fs.run_local(per_rank, T, n, args.steps, world_size=n, timeout_s=3000)[0]
            t, lim = r["times"], r["limit"]
            print(f"cp={n} T={T}: fshard {t['fshard'] * 1e3:.1f} ms, torch {t['torch'] * 1e3:.1f} ms, "
                  f"fshard/torch {t['fshard'] / t['torch']:.2f} (sides differ by {r['worst']:.1e})")
            print(f"    {lim.line(t)}")
    for T in args.seq:
        row = []
        for n in args.memory_cp:
            res = fs.run_local(peak_memory, T, n, world_size=n, timeout_s=3000)[0] if n > 1 else peak_memory(T, 1)
            row.append(f"cp={n} fshard {res['fshard']:.1f} / torch {res['torch']:.1f} MiB")
        print(f"peak per rank, T={T}: " + "; ".join(row))
    if args.model_memory:
        import tempfile

        print("train_lm.py " + " ".join(MODEL[:8]) + ": peak per rank of a train step")
        for T in args.seq:
            row = []
            for n in args.memory_cp:
                with tempfile.TemporaryDirectory() as d:
                    log = os.path.join(d, "log.json")
                    mib = fs.run_local(model_memory, T, n, log, world_size=n, timeout_s=3000)[0]
                row.append(f"cp={n} {mib:.1f} MiB")
            print(f"  T={T}: " + "; ".join(row))
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""fs.jit vs eager fshard vs torch's fully_shard / DDP: the data-parallel bench step, compiled.

    python bench/jit_step.py [--mode fsdp|replicate] [--steps 10] [--backend inductor]

The model and step of ``bench/data_parallel.py`` (Transformer vocab 512, dim 256, 4 layers,
seq 128, fp32, AdamW, 2 gloo ranks x batch 8): fshard's step (gather_params + scan_layers +
value_and_grad + adamw, ``fshard.testing.transformer_train_step``, which the fs.jit tests
run too) eagerly, the same step under ``fs.jit`` (one captured graph, compiled
by ``--backend``), and the native side. Step time = slowest rank, median over ``--steps``
after 2 warm-up steps, the sides interleaved; ratio = median of per-step ratios to native.
The first jit call's time (trace + compile) is reported: set ``TORCHINDUCTOR_CACHE_DIR`` to
an empty directory for a cold compile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs
from fshard.models import TransformerConfig
from fshard.testing import transformer_train_step

CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)


def per_rank(mode, steps, backend):
    from data_parallel import _native_step  # bench/ is the working directory's sibling: run from the repo root

    torch.set_num_threads(1)
    cfg = TransformerConfig(**CFG)
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (8 * n, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)
    native = _native_step(mode, cfg)
    step, p0, s0 = transformer_train_step(mode, cfg, mesh)
    jstep = fs.jit(step, backend=backend)
    state = {"eager": (p0, s0), "jit": (p0, s0)}
    t0 = time.perf_counter()
    jstep(*state["jit"], tok, tgt)  # the step is functional: its result is dropped, the sides start equal
    first = time.perf_counter() - t0
    rows = slice(r * 8, (r + 1) * 8)
    sides = {
        "native": lambda: native(tok[rows], tgt[rows]),
        "eager": lambda: step(*state["eager"], tok, tgt),
        "jit": lambda: jstep(*state["jit"], tok, tgt),
    }
    times = {k: [] for k in sides}
    losses = {"eager": [], "jit": []}
    for i in range(steps + 2):
        for k, f in sides.items():
            dist.barrier()
            t = time.perf_counter()
            out = f()
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if k != "native":
                state[k] = tuple(out[1:])
                losses[k].append(out[0].full_tensor().item())
            if i >= 2:
                times[k].append(dt.item())
    ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["native"])) for k in times}
    return first, {k: statistics.median(v) for k, v in times.items()}, ratio, losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fsdp", choices=["fsdp", "replicate"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    first, med, ratio, losses = fs.run_local(per_rank, args.mode, args.steps, args.backend, world_size=2)[0]
    native = "fully_shard" if args.mode == "fsdp" else "DDP"
    print(f"{args.mode}, 2 gloo ranks, backend {args.backend}: first jit call (trace + compile) {first:.1f} s")
    for k in ("native", "eager", "jit"):
        print(f"{(native if k == 'native' else 'fshard ' + k):>16}: {med[k] * 1e3:8.1f} ms/step  ratio to {native} {ratio[k]:.2f}")
    print("max |loss eager - loss jit|:", max(abs(a - b) for a, b in zip(losses["eager"], losses["jit"])))


if __name__ == "__main__":
    main()

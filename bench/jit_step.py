"""fs.jit vs eager fshard vs torch's fully_shard / DDP: the data-parallel bench step, compiled.

    python bench/jit_step.py [--mode fsdp|replicate] [--steps 10] [--backend inductor]

The model and step of ``bench/data_parallel.py`` (Transformer vocab 512, dim 256, 4 layers,
seq 128, fp32, AdamW, 2 gloo ranks x batch 8): fshard's step (gather_params + scan_layers +
value_and_grad + adamw, ``fshard.testing.transformer_train_step``, which the fs.jit tests
run too) eagerly, the same step under ``fs.jit`` (one captured graph, compiled
by ``--backend``), and the native side. Step time = slowest rank, median over ``--steps``
after 2 warm-up steps, the sides interleaved; ratio = median of per-step ratios to native.
The native side runs twice: eager, and compiled (``--backend``; FSDP: each block
``torch.compile(block, fullgraph=True)`` before ``fully_shard``, torchtitan's recipe; DDP:
the module compiled, then wrapped; see ``bench/data_parallel.py``'s ``_native_step``); ratios
are given to both. The first call's time (trace + compile) of fs.jit and of torch compiled
is reported: set ``TORCHINDUCTOR_CACHE_DIR`` to an empty directory for a cold compile.
``bench/fsdp.py --compiled`` / ``bench/ddp.py --compiled`` time the same compiled sides next
to fshard's eager step with ``fs.optim.donate()`` (this script's eager side is the pure
step that fs.jit compiles) and add peak memory.
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


def per_rank(mode, steps, backend, cfg=None):
    from data_parallel import _native_step, timed_rounds  # bench/ is the working directory's sibling: run from the repo root

    torch.set_num_threads(1)
    cfg = TransformerConfig(**(cfg or CFG))
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (8 * n, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)
    native = _native_step(mode, cfg)
    native_compiled = _native_step(mode, cfg, compiled=True, backend=backend)
    step, p0, s0 = transformer_train_step(mode, cfg, mesh)
    jstep = fs.jit(step, backend=backend)
    state = {"eager": (p0, s0), "jit": (p0, s0)}
    rows = slice(r * 8, (r + 1) * 8)
    t0 = time.perf_counter()
    jstep(*state["jit"], tok, tgt)  # the step is functional: its result is dropped, the sides start equal
    first = {"jit": time.perf_counter() - t0}
    # torch's compiled step is not: its first call is the first of its steps (a warm-up step).
    t0 = time.perf_counter()
    native_compiled(tok[rows], tgt[rows])
    first["native compiled"] = time.perf_counter() - t0

    def fshard(k, f):
        def call():
            loss, *rest = f(*state[k], tok, tgt)
            state[k] = tuple(rest)
            return loss
        return call

    sides = {
        "native": lambda: native(tok[rows], tgt[rows]),
        "native compiled": lambda: native_compiled(tok[rows], tgt[rows]),
        "eager": fshard("eager", step),
        "jit": fshard("jit", jstep),
    }
    times, _, raw = timed_rounds(sides, steps, warmup=2)
    losses = {k: [v.full_tensor().item() for v in raw[k]] for k in ("eager", "jit")}
    ratio = {k: {ref: statistics.median(a / b for a, b in zip(times[k], times[ref])) for ref in ("native", "native compiled")}
             for k in times}
    return first, {k: statistics.median(v) for k, v in times.items()}, ratio, losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fsdp", choices=["fsdp", "replicate"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    # Compiling takes minutes on a loaded 2-core machine: the default 300 s limit of the call is too short.
    first, med, ratio, losses = fs.run_local(per_rank, args.mode, args.steps, args.backend, world_size=2,
                                             timeout_s=3000)[0]
    native = "fully_shard" if args.mode == "fsdp" else "DDP"
    print(f"{args.mode}, 2 gloo ranks, backend {args.backend}: first call (trace + compile): fs.jit "
          f"{first['jit']:.1f} s, {native} compiled {first['native compiled']:.1f} s")
    names = {"native": native, "native compiled": f"{native} compiled", "eager": "fshard eager", "jit": "fshard jit"}
    for k, name in names.items():
        print(f"{name:>20}: {med[k] * 1e3:8.1f} ms/step  ratio to {native} {ratio[k]['native']:.2f}"
              f"  to {native} compiled {ratio[k]['native compiled']:.2f}")
    print("max |loss eager - loss jit|:", max(abs(a - b) for a, b in zip(losses["eager"], losses["jit"])))


if __name__ == "__main__":
    main()

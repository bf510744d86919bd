"""fs.jit vs eager fshard vs torch's fully_shard / DDP: the data-parallel bench step, compiled.

    python bench/jit_step.py [--mode fsdp|replicate] [--steps 10] [--backend inductor] [--comm-passes on,off]
                             [--profile N]

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
``--comm-passes on,off`` (also ``bucket``, ``overlap``, ``reorder``) runs one fs.jit side per
setting of fs.jit's collective passes (``fshard/jit/passes/bucket.py``: bucketing, fshard's overlap
scheduling ``fshard/jit/passes/overlap.py``, torch's overlap scheduling), interleaved, and gives
each one's ratio to the others; ``on,bucket`` compares with and without fshard's overlap
scheduling (the FSDP step has nothing to bucket).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs
from fshard.jit.passes.bucket import without_collective_passes
from fshard.models import TransformerConfig
from fshard.testing import collective_calls, inductor_output_code, transformer_train_step

CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)

# --comm-passes: fs.jit sides by which of its collective passes (fshard/jit/passes/bucket.py) run.
_JIT_SIDE = {"on": "jit", "off": "jit, comm passes off", "bucket": "jit, bucketing only",
             "overlap": "jit, overlap only", "reorder": "jit, torch reordering only"}
_JIT_OPTIONS = {"on": lambda: None, "off": without_collective_passes,
                "bucket": lambda: without_collective_passes(bucketing=True),
                "overlap": lambda: without_collective_passes(overlap=True),
                "reorder": lambda: without_collective_passes(reorder=True)}


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def per_rank(mode, steps, backend, cfg=None, variants=("on",), bucket_mb=None, profile_steps=0):
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
    jsteps = {_JIT_SIDE[v]: fs.jit(step, backend=backend, options=_JIT_OPTIONS[v]()) for v in variants}
    if bucket_mb is not None:  # replicate: the same step with smaller gradient buckets, jitted
        bstep, _, _ = transformer_train_step(mode, cfg, mesh, bucket_bytes=int(bucket_mb * 2**20))
        jsteps[f"jit, {bucket_mb:g} MB buckets"] = fs.jit(bstep, backend=backend)
    state = {"eager": (p0, s0), **{k: (p0, s0) for k in jsteps}}
    rows = slice(r * 8, (r + 1) * 8)
    first, calls = {}, {}
    for k, jstep in jsteps.items():
        with inductor_output_code() as codes:  # the code Inductor compiled or loaded
            t0 = time.perf_counter()
            jstep(*state[k], tok, tgt)  # the step is functional: its result is dropped, the sides start equal
            first[k] = time.perf_counter() - t0
        calls[k] = dict(collections.Counter(c for code in codes for c in collective_calls(code)))
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
        **{k: fshard(k, jstep) for k, jstep in jsteps.items()},
    }
    # This rank's CPU seconds per call: the process (compute, and gloo's worker threads that
    # move the bytes) and the calling thread alone (compute).
    cpu = {k: [] for k in sides}

    def with_cpu(k, f):
        def call():
            t0, m0 = time.process_time(), time.thread_time()
            out = f()
            cpu[k].append((time.process_time() - t0, time.thread_time() - m0))
            return out
        return call

    times, _, raw = timed_rounds({k: with_cpu(k, f) for k, f in sides.items()}, steps, warmup=2)
    # CPU per step summed over the ranks, median over the timed steps.
    both = torch.tensor([cpu[k][2:] for k in sides], dtype=torch.float64)
    dist.all_reduce(both)
    cpu_med = {k: tuple(statistics.median(both[i, :, j].tolist()) for j in (0, 1)) for i, k in enumerate(sides)}
    losses = {k: [v.full_tensor().item() for v in raw[k]] for k in ("eager", *jsteps)}
    kinds = {}
    if profile_steps:  # after the timing, so that it does not slow it: where each side's step goes
        from breakdown import KINDS, breakdown

        for k, f in sides.items():
            dist.barrier()
            got = breakdown(f, profile_steps)
            vals = torch.tensor([got[x] for x in (*KINDS, "step", "thread CPU")], dtype=torch.float64)
            dist.all_reduce(vals)  # the mean over the ranks
            kinds[k] = dict(zip((*KINDS, "step", "thread CPU"), (vals / dist.get_world_size()).tolist()))
    ratio = {k: {ref: statistics.median(a / b for a, b in zip(times[k], times[ref])) for ref in ("native", "native compiled", *jsteps)}
             for k in times}
    return first, {k: statistics.median(v) for k, v in times.items()}, ratio, losses, calls, cpu_med, kinds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fsdp", choices=["fsdp", "replicate"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--comm-passes", default="on",
                    help="comma-separated fs.jit sides by collective passes (fshard/jit/passes/bucket.py): on (the default "
                         "passes: bucketing, then fshard's overlap scheduling), off, bucket (bucketing only), overlap "
                         "(fshard's overlap scheduling only), reorder (torch's overlap scheduling only); e.g. on,bucket")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="replicate: also a jit side whose gradient all-reduce buckets hold this many MiB "
                         "(default: only scan_layers' 25)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timing, profile N more steps of each side and print where they go, by kind "
                         "(bench/breakdown.py), as the mean over the ranks")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    variants = tuple(args.comm_passes.split(","))
    if not variants or any(v not in _JIT_SIDE for v in variants):
        ap.error(f"--comm-passes {args.comm_passes!r}: use a comma-separated list of {', '.join(_JIT_SIDE)}")
    # Compiling takes minutes on a loaded 2-core machine: the default 300 s limit of the call is too short.
    first, med, ratio, losses, calls, cpu, kinds = fs.run_local(
        per_rank, args.mode, args.steps, args.backend, None, variants, args.bucket_mb, args.profile,
        world_size=2, timeout_s=3000)[0]
    native = "fully_shard" if args.mode == "fsdp" else "DDP"
    jits = [k for k in first if k != "native compiled"]
    print(f"{args.mode}, 2 gloo ranks, backend {args.backend}: first call (trace + compile): "
          + ", ".join(f"fs.{k} {first[k]:.1f} s" for k in jits) + f", {native} compiled {first['native compiled']:.1f} s")
    names = {"native": native, "native compiled": f"{native} compiled", "eager": "fshard eager",
             **{k: f"fshard {k}" for k in jits}}
    for k, name in names.items():
        print(f"{name:>32}: {med[k] * 1e3:8.1f} ms/step (CPU of both ranks {cpu[k][0] * 1e3:6.1f} ms, "
              f"their main threads {cpu[k][1] * 1e3:6.1f} ms)"
              f"  ratio to {native} {ratio[k]['native']:.2f}"
              f"  to {native} compiled {ratio[k]['native compiled']:.2f}"
              + "".join(f"  to {j} {ratio[k][j]:.3f}" for j in jits if j != k and k in jits))
    print(f"load average at end: {os.getloadavg()}")
    if kinds:
        from breakdown import table

        print(f"where the step goes ({args.profile} profiled steps per side, mean over the ranks):")
        print(table({names[k]: v for k, v in kinds.items()}))
    for k in jits:
        print(f"max |loss eager - loss {k}|:", max(abs(a - b) for a, b in zip(losses["eager"], losses[k])),
              " collective calls in its compiled code (backend inductor):", calls[k])


if __name__ == "__main__":
    main()

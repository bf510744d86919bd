"""fs.jit's first-call (trace + compile) time, cold and warm, and where it goes.

    python bench/jit_compile.py [--target example|bench] [--ranks 2] [--cache DIR] [--runs cold,warm]
                                [--steps 8] [--profile FILE]

``--target example``: ``examples/train_lm.py --mesh fsdp=R --jit`` with its default model
(dim 64, 2 layers, seq 64, batch 16, AdamW, clipping); ``bench``: ``bench/jit_step.py``'s
FSDP step (dim 256, 4 layers, seq 128). ``--runs cold,warm`` runs the target once with an
empty Inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``: FX graph, AOTAutograd and C++
kernel caches all start empty) and once more on the cache the first run left, each in
fresh processes. Per run: the first step (slowest rank), fs.jit's trace and first
compiled call (rank 0), Dynamo's ``compile_times()``, Inductor's kernel counts and cache
counters, and the median of the later steps (the compiled step's speed).
``--profile FILE``: cProfile of rank 0's first step, written to FILE.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def per_rank(target: str, steps: int, profile: str | None) -> dict:
    import cProfile

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import compile_times, counters
    from torch._inductor import metrics

    import fshard as fs

    torch.set_num_threads(1)
    if os.environ.get("FSHARD_JIT_BENCH_OPTIONS"):  # experiments: Inductor options for every fs.jit here
        import functools
        import json

        fs.jit = functools.partial(fs.jit, options=json.loads(os.environ["FSHARD_JIT_BENCH_OPTIONS"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    events: list[str] = []
    builds: list[tuple[float, int]] = []
    if os.environ.get("FSHARD_JIT_BENCH_TIME_BUILDS"):  # per C++ compile (in-process: compile_threads 1)
        from torch._inductor import cpp_builder

        build = cpp_builder.CppBuilder.build

        def timed(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return build(self, *a, **k)
            finally:
                size = sum(os.path.getsize(s) for s in self._sources_args.split() if os.path.exists(s)) \
                    if isinstance(getattr(self, "_sources_args", None), str) else -1
                builds.append((time.perf_counter() - t0, size))
        cpp_builder.CppBuilder.build = timed
    handler = logging.Handler()
    handler.emit = lambda rec: events.append(rec.getMessage())
    jlog = logging.getLogger("fshard.jit")
    jlog.addHandler(handler)
    jlog.setLevel(logging.INFO)
    bypass = logging.Handler()  # why a warm run would not hit the FX graph / AOTAutograd caches
    bypass.emit = lambda rec: events.append(rec.getMessage()) if "ypass" in rec.getMessage() else None
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        logging.getLogger(name).addHandler(bypass)
        logging.getLogger(name).setLevel(logging.INFO)
    prof = cProfile.Profile() if (profile and rank == 0) else None
    if target == "example":
        from _examples import example

        train_lm = example("train_lm")

        argv = ["--mesh", f"fsdp={world}", "--jit", "--steps", str(steps), "--quiet", "--sample-chars", "0"]
        if prof is not None:  # the first step only: wrap the jitted step's first call
            import fshard.recipes.step as recipe_step  # the trainer composes its step from this module's name

            orig = recipe_step.make_jit_train_step

            def wrapped(*a, **k):
                step = orig(*a, **k)
                calls = [0]

                def once(*sa):
                    calls[0] += 1
                    if calls[0] > 1:
                        return step(*sa)
                    prof.enable()
                    try:
                        return step(*sa)
                    finally:
                        prof.disable()
                return once
            recipe_step.make_jit_train_step = wrapped
        records = train_lm.main(argv)
        times = [r["step_time_s"] for r in records]
    else:
        from fshard.models import TransformerConfig
        from fshard.testing import transformer_train_step

        cfg = TransformerConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
        mesh = fs.make_mesh({"d": world})
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, cfg.vocab_size, (8 * world, cfg.max_seq_len), generator=g)
        tgt = torch.roll(tok, -1, 1)
        step, p, s = transformer_train_step("fsdp", cfg, mesh)
        jstep = fs.jit(step)
        times = []
        for i in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            if i == 0 and prof is not None:
                prof.enable()
            _, p, s = jstep(p, s, tok, tgt)
            if i == 0 and prof is not None:
                prof.disable()
            times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.dump_stats(profile)
    jlog.removeHandler(handler)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if builds:
        builds.sort(reverse=True)
        events.append(f"{len(builds)} C++ builds, {sum(b[0] for b in builds):.1f} s; slowest (s, source bytes): "
                      + ", ".join(f"{b[0]:.1f} {b[1]}" for b in builds[:8]))
    return {"times": t.tolist(), "events": events, "compile_times": compile_times(repr="str", aggregate=True),
            "kernels": metrics.generated_kernel_count, "cpp_vec_kernels": metrics.generated_cpp_vec_kernel_count,
            "inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="example", choices=["example", "bench"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache", default=None, help="Inductor cache dir (default: a fresh temporary one, removed after)")
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import fshard as fs

    cache = args.cache or tempfile.mkdtemp(prefix="fshard_jit_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        for run in args.runs.split(","):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            res = fs.run_local(per_rank, args.target, args.steps, args.profile if run == args.runs.split(",")[0]
                               else None, world_size=args.ranks, timeout_s=1800)
            wall = time.perf_counter() - t0
            r0 = res[0]
            later = statistics.median(r0["times"][2:]) if len(r0["times"]) > 2 else float("nan")
            print(f"== {args.target} {run} ({args.ranks} ranks, load {load:.1f} -> {os.getloadavg()[0]:.1f}, "
                  f"{time.strftime('%H:%M:%S', time.gmtime())} UTC): first step {r0['times'][0]:.1f} s, later steps "
                  f"{later * 1e3:.1f} ms (median), run wall {wall:.0f} s")
            for rank, r in enumerate(res):
                for e in r["events"]:
                    print(f"    rank {rank}:", e)
                print(f"    rank {rank}: kernels {r['kernels']} (cpp vec {r['cpp_vec_kernels']}); inductor "
                      f"{ {k: v for k, v in r['inductor'].items() if 'cache' in k} }; aot {r['aot']}")
            print("    " + r0["compile_times"].replace("\n", "\n    "))
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()

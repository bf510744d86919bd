"""Where the GPU waits: a timeline of fully_shard's and fshard's steps, and the host calls that stall.

    python bench/gpu_idle.py [--size large] [--steps 3] [--out DIR] [--backend inductor] [--no-jit]

The sides and sizes of ``bench/jit_gpu.py`` (one process, one-rank group): ``torch`` (eager
fully_shard), ``torch_compiled`` (each block ``torch.compile(block, fullgraph=True)`` before
``fully_shard``, torchtitan's recipe: compiled against compiled), ``fshard`` (eager) and
``fshard_jit``; the compiled sides by ``--backend``, both left out by ``--no-jit``. For each
side, after warm-up:

1. ``torch.cuda.set_sync_debug_mode("warn")`` over one step: every call that makes the host
   wait for the device (a ``.item()``, a pageable host-to-device copy, a synchronize) warns;
   each distinct warning is printed once with the fshard/bench frames of its stack.
2. ``--steps`` steps under torch.profiler; the chrome trace goes to ``DIR/<side>.json.gz``,
   and from it: the device's busy time and its idle time between the first and last kernel,
   the host runtime calls by total time (``cudaStreamSynchronize``, ``cudaMemcpyAsync``,
   ``cudaMalloc``/``cudaFree``, launches), and the largest idle gaps with the host op that
   launched the kernel ending each gap (how long the host took to get there).

Why: on one H100 the large model's eager fshard step is 1.12x fully_shard's with the same
device time per step (bench/README.md), so the difference is time the device sits idle.
On a CPU this runs the tiny model (a smoke run; there are no kernels to analyse).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import traceback
import warnings
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_checks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fshard as fs  # noqa: E402

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _sync_stalls(fn, dev) -> list[str]:
    """One call of ``fn`` with CUDA's sync debug mode on: the distinct warnings, with their stacks."""
    if dev.type != "cuda":
        return []
    seen: dict[str, int] = {}
    lines: list[str] = []
    orig = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1]
                 if "fshard" in f.filename or "bench" in f.filename or "torch/optim" in f.filename
                 or "torch/distributed" in f.filename]
        key = f"{message} @ " + " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in stack[-4:])
        seen[key] = seen.get(key, 0) + 1

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = orig
    for k, n in sorted(seen.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:4d} x {k}")
    return lines


def analyse(trace_path: str, steps: int, top: int = 12) -> dict:
    """Device busy/idle time per step and the largest idle gaps, from a chrome trace."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS),
                 key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    cpu_ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                     key=lambda e: e["ts"])
    rt_total: dict[str, float] = defaultdict(float)
    rt_count: Counter = Counter()
    for e in runtime:
        rt_total[e["name"]] += e["dur"]
        rt_count[e["name"]] += 1
    out = {"runtime_ms_per_step": {k: (v / 1e3 / steps, rt_count[k] // steps)
                                   for k, v in sorted(rt_total.items(), key=lambda kv: -kv[1])[:10]}}
    if not dev:
        return out
    busy, gaps, end = 0.0, [], dev[0]["ts"]
    for e in dev:
        start = e["ts"]
        if start > end:
            gaps.append((start - end, end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(start, end))
        end = max(end, e["ts"] + e["dur"])
    span = end - dev[0]["ts"]
    by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    out.update(span_ms_per_step=span / 1e3 / steps, busy_ms_per_step=busy / 1e3 / steps,
               idle_ms_per_step=(span - busy) / 1e3 / steps)
    gaps.sort(key=lambda g: -g[0])
    rows = []
    for gap, t_idle, k in gaps[:top]:
        launch = by_corr.get(k.get("args", {}).get("correlation"))
        enclosing = ""
        if launch is not None:
            outer = [o for o in cpu_ops if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
            enclosing = " > ".join(o["name"] for o in outer[-3:])
        busy_host = [r["name"] for r in runtime if r["ts"] < t_idle + gap and r["ts"] + r["dur"] > t_idle
                     and r["dur"] > 0.5 * gap]
        rows.append({"gap_us": round(gap, 1), "kernel": k["name"][:60], "launched_in": enclosing,
                     "host_blocked_in": busy_host[:2]})
    out["largest_gaps"] = rows
    # Total idle split by the host op that launched the kernel after the gap.
    by_op: dict[str, float] = defaultdict(float)
    for gap, _, k in gaps:
        launch = by_corr.get(k.get("args", {}).get("correlation"))
        name = "?"
        if launch is not None:
            i = next((j for j in range(len(cpu_ops) - 1, -1, -1) if cpu_ops[j]["ts"] <= launch["ts"]), None)
            name = cpu_ops[i]["name"] if i is not None else "?"
        by_op[name] += gap
    out["idle_ms_per_step_by_next_op"] = {k: round(v / 1e3 / steps, 3)
                                          for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]}
    return out


def main() -> None:
    from data_parallel import _native_step
    from jit_gpu import one_rank_setup

    from fshard.testing import transformer_train_step

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="large", choices=["small", "large"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/gpu_idle")
    ap.add_argument("--no-jit", action="store_true",
                    help="skip the compiled sides, fs.jit and torch per-block compiled (fs.jit's compile takes ~90 s)")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of the compiled sides")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    _, mesh, cfg, tok, tgt = one_rank_setup(args.size)
    dev = mesh.device
    step, p, s = transformer_train_step("fsdp", cfg, mesh)
    sides = {"torch": (lambda ts: (lambda: ts(tok, tgt)))(_native_step("fsdp", cfg))}
    if not args.no_jit:
        sides["torch_compiled"] = (lambda ts: (lambda: ts(tok, tgt)))(
            _native_step("fsdp", cfg, compiled=True, backend=args.backend))
    for name, f in (("fshard", step),) + (() if args.no_jit else (("fshard_jit", fs.jit(step, backend=args.backend)),)):
        box = {"p": p, "s": s}

        def call(f=f, box=box):
            loss, box["p"], box["s"] = f(box["p"], box["s"], tok, tgt)
            return loss
        sides[name] = call
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    report = {}
    for name, fn in sides.items():
        for _ in range(3):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        stalls = _sync_stalls(fn, dev)
        print(f"=== {name}: host waits for the device (sync debug mode, one step): {len(stalls)} distinct")
        print("\n".join(stalls))
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        path = os.path.join(args.out, f"{name}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as fi, gzip.open(path + ".gz", "wb") as fo:
            fo.write(fi.read())
        os.remove(path)
        r = analyse(path + ".gz", args.steps)
        r["sync_stalls"] = stalls
        report[name] = r
        print(json.dumps({k: v for k, v in r.items() if k != "sync_stalls"}, indent=1))
    with open(os.path.join(args.out, "gpu_idle.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Runs every fshard-vs-native benchmark and prints one summary table.

    python bench/run_all.py [--steps 10] [--only fsdp ddp tp pp overhead optim_step collectives jit_step]
                            [--compiled [--backend inductor]]

Each benchmark runs in its own process (they start their own ranks), one after the
other, so they never share the 2 cores. The summary keeps each script's ratio lines;
the full outputs follow it; its last column is each script's "physical limit" line
(compute alone plus minimal wire, and each side as a fraction of it; pp's per-schedule
limits are columns of its own table). Paste the result into bench/README.md. ``--compiled`` passes
``--compiled`` and ``--backend`` to the scripts that have compiled sides (fs.jit and
torch.compile), and adds ``jit_step``, whose sides always compile: without ``--compiled``
it is left out (minutes of compiling).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (script, extra args, what it compares)
BENCHES = {
    "fsdp": ("fsdp.py", [], "fshard scan_layers FSDP vs fully_shard"),
    "ddp": ("ddp.py", [], "fshard replicate vs DistributedDataParallel"),
    "tp": ("tp.py", [], "fshard TP (and TP+SP) vs parallelize_module"),
    "pp": ("pp.py", [], "fshard pipeline_step vs torch.distributed.pipelining"),
    "overhead": ("overhead.py", [], "one process: pure function + fs.optim vs nn.Module + torch.optim"),
    "optim_step": ("optim_step.py", [], "one process, the optimizer alone: fs.optim.adamw vs torch.optim.AdamW"),
    "collectives": ("collectives.py", ["--iters", "50"], "fs.lax vs torch.distributed calls"),
    "jit_step": ("jit_step.py", [], "fs.jit vs eager fshard vs fully_shard (eager and per-block compiled)"),
}


COMPILED = {"fsdp", "ddp", "tp", "pp", "overhead", "optim_step", "collectives"}  # the scripts with a --compiled flag
ALWAYS_COMPILED = {"jit_step"}  # no eager-only mode: run with --compiled only (it takes --backend)


def command(name: str, steps: int, compiled: bool = False, backend: str = "inductor") -> list[str]:
    """The command line that runs benchmark ``name``."""
    script, extra, _ = BENCHES[name]
    args = [sys.executable, os.path.join(HERE, script)] + extra
    if compiled and name in COMPILED:
        args += ["--compiled"]
    if compiled and name in COMPILED | ALWAYS_COMPILED:
        args += ["--backend", backend]
    if name != "collectives":
        args += ["--steps", str(steps)]
    return args


def run(name: str, steps: int, compiled: bool = False, backend: str = "inductor") -> tuple[str, float, int]:
    args = command(name, steps, compiled, backend)
    t0 = time.perf_counter()
    # PYTHONPATH: overhead.py and optim_step.py import fshard from the repository root.
    path = os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(args, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path})
    return proc.stdout + (proc.stderr if proc.returncode else ""), time.perf_counter() - t0, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHES), default=list(BENCHES))
    ap.add_argument("--compiled", action="store_true",
                    help="also the compiled sides, and jit_step (minutes of compiling)")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    outputs = {}
    for name in args.only:
        if name in ALWAYS_COMPILED and not args.compiled:
            print(f"[{name}] skipped: its sides compile (run with --compiled)", flush=True)
            continue
        out, secs, rc = run(name, args.steps, args.compiled, args.backend)
        outputs[name] = (out, secs, rc)
        print(f"[{name}] done in {secs:.0f} s (exit {rc})", flush=True)
    print("\n| benchmark | compares | ratio lines (fshard / torch) | physical limit (bench/_limits.py) |"
          "\n|---|---|---|---|")
    for name, (out, _, rc) in outputs.items():
        lines = [ln.strip() for ln in out.splitlines() if "ratio" in ln.lower() or ln.startswith("|")]
        limit = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("physical limit")]
        summary = "<br>".join(lines[:8]) if rc == 0 else f"failed (exit {rc})"
        print(f"| {name} | {BENCHES[name][2]} | {summary} | {'<br>'.join(limit) if rc == 0 else ''} |")
    for name, (out, _, _) in outputs.items():
        print(f"\n===== {name} =====\n{out}")


if __name__ == "__main__":
    main()

"""Where a step's device time goes: torch.profiler over fully_shard's and fshard's eager steps.

    python bench/profile_gpu_step.py [--size large] [--steps 3] [--rows 20]

The sides and sizes of ``bench/jit_gpu.py`` (one process, one-rank group). After 2 warm-up
steps each side runs ``--steps`` steps under torch.profiler; printed per side: the total
device (or CPU) time per step and the ``--rows`` ops that take most of it. Used to find why
fshard's eager step on the large model is slower than fully_shard's on one H100.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_checks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fshard as fs  # noqa: E402


def main() -> None:
    from data_parallel import _native_step
    from jit_gpu import one_rank_setup
    from fshard.testing import transformer_train_step

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="large", choices=["small", "large"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    _, mesh, cfg, tok, tgt = one_rank_setup(args.size)
    dev = mesh.device
    step, p, s = transformer_train_step("fsdp", cfg, mesh)
    box = {"p": p, "s": s}

    def fshard_step():
        _, box["p"], box["s"] = step(box["p"], box["s"], tok, tgt)

    torch_step = _native_step("fsdp", cfg)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    for name, fn in (("torch fully_shard", lambda: torch_step(tok, tgt)), ("fshard", fshard_step)):
        for _ in range(2):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(getattr(e, key) for e in events) / args.steps / 1e3
        print(f"=== {name}: {total:.2f} ms of {key} per step")
        print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()

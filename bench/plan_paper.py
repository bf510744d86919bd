"""fs.plan on published training runs: the prediction next to the published throughput, and
the planner's own best layout for the same model, cluster and batch.

    PYTHONPATH=. python bench/plan_paper.py [--no-search]

Sources (all Llama 3 / 3.1 runs at sequence length 8192, bf16 compute unless said):

- torchtitan, docs/performance.md (commit 9dec370, Dec 2024; Grand Teton hosts: 8 H100
  96 GB HBM2e per host on NVLink, 400 Gb/s RDMA per GPU, 500 W power limit):
  Table 1 (8B, 8 GPUs, FSDP, local batch 2, selective AC): 5,762 tokens/s/GPU eager;
  Table 3 (8B, 128 GPUs, FSDP, local batch 2): 5,605; Table 4 (70B, 256 GPUs, FSDP 32 x
  TP 8, global batch 512, full AC, compile + Float8): 829; Table 5 (405B, 512 GPUs, FSDP 8
  x TP 8 x PP 8, global batch 256, full AC, compile + Float8 + async TP): 1F1B 100,
  interleaved 1F1B 128.
- torchtitan, docs/performance.md (earlier version, 64 A100 80 GB): Llama 3 8B, FSDP,
  local batch 1, selective op AC: 2,973 tokens/s/GPU, 58.2 % MFU.

Each row is estimated twice, without remat and with full-block remat: torchtitan's
selective AC recomputes part of each block, so its cost lies between the two.
"""

from __future__ import annotations

import argparse
import time

import attrs

import fshard.plan as plan

GIB = 2**30

# (name, model, machine, memory per GPU, mesh, global batch, microbatches, schedule, published tokens/s/GPU, notes)
RUNS = [
    ("torchtitan T1: 8B, 8 H100, FSDP", "llama3-8b", "h100", 96, {"fsdp": 8}, 16, 1, "1f1b", 5762, "eager, selective AC"),
    ("torchtitan T3: 8B, 128 H100, FSDP", "llama3-8b", "h100", 96, {"fsdp": 128}, 256, 1, "1f1b", 5605,
     "eager, selective AC"),
    ("torchtitan T4: 70B, 256 H100, FSDP 32 x TP 8", "llama3-70b", "h100", 96, {"fsdp": 32, "tp": 8}, 512, 1, "1f1b",
     829, "compile + Float8, full AC"),
    ("torchtitan T5: 405B, 512 H100, FSDP 8 x TP 8 x PP 8, 1F1B", "llama3-405b", "h100", 96,
     {"pp": 8, "fsdp": 8, "tp": 8}, 256, 32, "1f1b", 100, "compile + Float8 + async TP, full AC"),
    ("torchtitan T5: same, interleaved 1F1B", "llama3-405b", "h100", 96, {"pp": 8, "fsdp": 8, "tp": 8}, 256, 32,
     "interleaved", 128, "compile + Float8 + async TP, full AC"),
    ("torchtitan (A100): 8B, 64 A100, FSDP", "llama3-8b", "a100", 80, {"fsdp": 64}, 64, 1, "1f1b", 2973,
     "selective op AC, 58.2 % MFU"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-search", action="store_true", help="only the published layouts")
    args = ap.parse_args()
    print("| run | published tok/s/GPU | predicted, no remat | predicted, remat | predicted MFU (remat) | "
          "peak GiB no remat / remat | planner's best layout (tok/s/GPU) |")
    print("|---|---|---|---|---|---|---|")
    for name, mdl, mach, mem, mesh, batch, m, sched, published, notes in RUNS:
        model = plan.get_model(mdl, seq_len=8192)
        machine = attrs.evolve(plan.get_machine(mach), memory_bytes=mem * GIB)
        cells = []
        ests = []
        for remat in (False, True):
            layout = plan.Layout(mesh, batch=batch, microbatches=m, schedule=sched, remat=remat, dtype="bfloat16",
                                 sequence_parallel="tp" in mesh)
            est = plan.estimate(model, machine, layout)
            ests.append(est)
            cells.append(f"{est.tokens_per_s / layout.n_devices:,.0f}" + ("" if est.fits else " (does not fit)"))
        best = ""
        if not args.no_search:
            t0 = time.time()
            n = ests[0].layout.n_devices
            cfg = plan.SearchConfig(schedules=("1f1b", "interleaved", "zb"), max_microbatch_choices=5, top=3)
            res = plan.search(model, machine, n, batch, config=cfg)
            if res.best is not None:
                b = res.best
                best = f"{b.layout.label()} ({b.tokens_per_s / n:,.0f}); searched {res.considered} in " \
                       f"{time.time() - t0:.0f} s"
        print(f"| {name} ({notes}) | {published:,} | {cells[0]} | {cells[1]} | {ests[1].mfu:.1%} | "
              f"{ests[0].peak_bytes / GIB:.0f} / {ests[1].peak_bytes / GIB:.0f} | {best} |", flush=True)


if __name__ == "__main__":
    main()

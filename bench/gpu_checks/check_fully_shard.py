"""GPU check: per-step overhead of fshard's FSDP against eager ``fully_shard`` on one GPU (NCCL world 1).

The model and both steps are bench/data_parallel.py's (native_baseline.md's Transformer:
vocab 512, dim 256, 4 layers, 4 heads, seq 128, fp32, AdamW lr 1e-3; torch: ``fully_shard``
per block and on the root, ``loss.backward()``, ``torch.optim.AdamW(foreach=True)``;
fshard: ``gather_params`` + ``scan_layers`` in an unchecked ``shard_map``,
``fs.optim.adamw`` under ``donate()``), batch 8, in one process over a one-rank nccl group.
The two sides alternate step by step after 3 warm-up steps each; every step is timed to
``torch.cuda.synchronize()``. With one rank every collective is trivial, so the ratio is
the libraries' own per-step cost (Python, hooks, copies) on CUDA.

Asserted: both sides ran on CUDA; their losses agree (same init, same data) to 1e-3
relative at every step. Reported, not asserted: seconds per step (median), the median
of the per-step ratios fshard / torch and its quartiles. A dry run uses a tiny model
and 2 timed steps.

    python bench/gpu_checks/check_fully_shard.py [--cpu-dry-run] [--steps 20] [--result out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, Checker, main, median, one_rank_group, synchronize  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.models import TransformerConfig  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from data_parallel import CFG, _fshard_step, _native_step  # noqa: E402

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
WARMUP = 3
RTOL = 1e-3


def _value(loss: torch.Tensor) -> float:
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def run(ck: Checker, args: argparse.Namespace) -> None:
    one_rank_group()
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    dev = mesh.device
    cfg = TransformerConfig(**(TINY if ck.dry_run else CFG))
    steps = args.steps or (2 if ck.dry_run else 20)
    batch = 2 if ck.dry_run else 8
    sides = {"torch": _native_step("fsdp", cfg), "fshard": _fshard_step("fsdp", cfg, mesh)}
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g).to(dev)
    tgt = torch.roll(tok, -1, 1)
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(WARMUP + steps):
        for name, step in sides.items():
            synchronize(dev)
            t0 = time.perf_counter()
            loss = step(tok, tgt)
            synchronize(dev)
            dt = time.perf_counter() - t0
            losses[name].append(_value(loss))
            if i >= WARMUP:
                times[name].append(dt)
    ratios = sorted(f / t for f, t in zip(times["fshard"], times["torch"]))
    q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]  # noqa: E731
    rel = max(abs(a - b) / abs(a) for a, b in zip(losses["torch"], losses["fshard"]))
    ck.figure(model=dict(TINY if ck.dry_run else CFG), batch=batch, timed_steps=steps,
              torch_s_per_step=median(times["torch"]), fshard_s_per_step=median(times["fshard"]),
              ratio_fshard_over_torch=median(ratios), ratio_quartiles=[q(0.25), q(0.75)],
              max_loss_rel_diff=rel, torch_losses=[round(v, 5) for v in losses["torch"]],
              fshard_losses=[round(v, 5) for v in losses["fshard"]])
    ck.require(f"fshard's losses equal fully_shard's at every step (rtol {RTOL})", rel <= RTOL, f"{rel:.2e}")
    ck.require("both sides timed every step", len(ratios) == steps and all(r > 0 for r in ratios))
    ck.require_on_device("the comparison ran on a CUDA mesh over nccl",
                         lambda: (mesh.device_type == "cuda" and dist.get_backend() == "nccl", mesh))


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (default 20; 2 in a dry run)")


if __name__ == "__main__":
    main(run, "fully_shard_overhead", _args, doc=__doc__)

"""GPU check: ``examples/train_lm.py`` on one GPU, in float32 and in bf16.

Runs the example's ``main(argv)`` twice in this process, as ``python
examples/train_lm.py`` would (one process, no torchrun: fshard starts a one-rank nccl
group on a CUDA machine), 50 steps of its default model each, ``--dtype float32`` then
``--dtype bfloat16`` (bf16 compute and gathers over fp32 master weights). Asserts:

- the mesh computed on CUDA over nccl;
- the loss falls (mean of the last 10 steps below the mean of the first 10);
- tokens/s is reported for every step (figures: the median after the first step);
- bf16 follows float32: the first 10 steps within 1e-2 relative step by step, and the
  mean loss of the last 10 steps within 1e-2 relative. Step by step over all 50 steps is
  reported (``max_step_rel_diff``), not asserted: after the learning rate peaks the two
  runs take different steps and their per-step losses decorrelate (on CPU, fp32 spiked
  to 3.83 at step 12 where bf16 stayed at 3.31, then both settled within 0.05 per step
  and 6e-4 on the final mean).

A CPU dry run uses a tiny model and 4 steps (windows of 1 step).

    python bench/gpu_checks/check_train_lm.py [--cpu-dry-run] [--steps 50] [--result out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, Checker, main, median  # noqa: E402

import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402

RTOL = 1e-2
TINY = ["--dim", "16", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "4"]


def _train(argv: list[str]) -> list[dict]:
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    from _examples import example  # examples/train_lm.py loaded from its file

    return example("train_lm").main(argv)


def _summary(records: list[dict], w: int) -> dict:
    losses = [r["loss"] for r in records]
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "first_window_mean": sum(losses[:w]) / w, "last_window_mean": sum(losses[-w:]) / w,
            "tokens_per_s_median": median([r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]),
            "step_s_median": median([r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]),
            "losses": [round(x, 4) for x in losses]}


def run(ck: Checker, args: argparse.Namespace) -> None:
    steps = args.steps or (4 if ck.dry_run else 50)
    w = max(1, min(10, steps // 3))
    base = ["--steps", str(steps), "--quiet", "--sample-chars", "0"] + (TINY if ck.dry_run else [])
    runs = {}
    for dtype in ("float32", "bfloat16"):
        with ck.part(dtype):
            records = _train(base + ["--dtype", dtype])
            s = _summary(records, w)
            runs[dtype] = s
            ck.figure(**{f"{dtype}_{k}": v for k, v in s.items()})
            ck.require(f"{dtype}: the loss falls (mean of the last {w} steps below the first {w})",
                       s["last_window_mean"] < s["first_window_mean"],
                       f"{s['first_window_mean']:.4f} -> {s['last_window_mean']:.4f}")
            ck.require(f"{dtype}: tokens/s is reported for every step",
                       len(records) == steps and all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
                                                     for r in records))
    mesh = fs.make_mesh({"fsdp": dist.get_world_size()})  # the example's mesh (cached)
    backend = dist.get_backend()
    ck.figure(backend=backend, mesh=repr(mesh), steps=steps)
    ck.require_on_device("the example trained on a CUDA mesh over nccl (one process, no torchrun)",
                         lambda: (mesh.device_type == "cuda" and backend == "nccl", (mesh, backend)))
    if len(runs) < 2:
        return  # a dtype failed; its part says why
    a, b = runs["float32"]["losses"], runs["bfloat16"]["losses"]
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    last_rel = abs(runs["bfloat16"]["last_window_mean"] - runs["float32"]["last_window_mean"]) \
        / abs(runs["float32"]["last_window_mean"])
    ck.figure(max_step_rel_diff=max(rel), max_step_abs_diff=max(abs(x - y) for x, y in zip(a, b)),
              step_of_max_diff=worst + 1, first_window_max_rel_diff=max(rel[:w]), last_window_rel_diff=last_rel,
              bf16_tokens_per_s_ratio=runs["bfloat16"]["tokens_per_s_median"] / runs["float32"]["tokens_per_s_median"])
    ck.require(f"bf16 follows float32 step by step over the first {w} steps (rtol {RTOL})",
               max(rel[:w]) <= RTOL, f"max relative difference {max(rel[:w]):.2e}")
    ck.require(f"bf16's mean loss over the last {w} steps is within {RTOL} of float32's (relative)",
               last_rel <= RTOL, f"{last_rel:.2e}")


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=None, help="default 50 (4 in a dry run)")


if __name__ == "__main__":
    main(run, "train_lm", _args, doc=__doc__)

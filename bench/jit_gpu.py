"""Compiled against compiled on one GPU: fs.jit's whole step vs fully_shard with per-block torch.compile.

    python bench/jit_gpu.py [--size small|large] [--steps 20] [--result out.json]

One process, a one-rank NCCL group (``fs.init()`` as ``torchrun --nproc-per-node 1``), the
Transformer of ``bench/data_parallel.py`` (``small``: vocab 512, dim 256, 4 layers, seq 128,
batch 8; ``large``: vocab 8192, dim 1024, 8 layers, seq 512, batch 8), fp32, AdamW. Four sides,
interleaved step by step after warm-up, each step timed to ``torch.cuda.synchronize()``:

  torch eager      fully_shard per block and on the root, loss.backward(), AdamW(foreach=True)
  torch compiled   the same with each block compiled first (torchtitan's order:
                   ``torch.compile(block, fullgraph=True)``, then fully_shard)
  fshard eager     gather_params + scan_layers + value_and_grad + fs.optim.adamw
  fshard jit       that whole step (forward, gradient, optimizer) under ``fs.jit``

Reported: median ms per step, ratios to torch eager and to torch compiled, the first call's
time (trace + compile) for both compiled sides, and the largest loss difference between
fshard's eager and jit sides. With one rank every collective is trivial: this measures the
compute and the host work around it, which is what compilation changes. On a CPU (a
smoke run) the sizes shrink to a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_checks"))

import torch  # noqa: E402

import fshard as fs  # noqa: E402
from fshard.models import TransformerConfig  # noqa: E402

SIZES = {
    "small": (dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128), 8),
    "large": (dict(vocab_size=8192, dim=1024, n_layers=8, n_heads=16, max_seq_len=512), 8),
    "tiny": (dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16), 2),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_rank_setup(size: str):
    """The one-rank group, its mesh, the model config of ``size`` (``tiny`` on a CPU) and a
    seeded batch: ``(backend, mesh, cfg, tokens, targets)``, for this script and the
    profiling scripts that compare the same steps (profile_gpu_step.py, gpu_idle.py)."""
    from common import one_rank_group

    backend = one_rank_group()
    mesh = fs.make_mesh({"d": 1})
    dev = mesh.device
    cfg_kw, batch = SIZES["tiny" if dev.type == "cpu" else size]
    cfg = TransformerConfig(**cfg_kw)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g).to(dev)
    return backend, mesh, cfg, tok, torch.roll(tok, -1, 1)


def run(size: str, steps: int) -> dict:
    from data_parallel import _native_step
    from fshard.testing import transformer_train_step

    backend, mesh, cfg, tok, tgt = one_rank_setup(size)
    dev = mesh.device
    step, p0, s0 = transformer_train_step("fsdp", cfg, mesh)
    jstep = fs.jit(step)
    state = {"fshard eager": (p0, s0), "fshard jit": (p0, s0)}
    t_eager, t_comp = _native_step("fsdp", cfg), _native_step("fsdp", cfg, compiled=True)
    first = {}
    for name, fn in (("torch compiled", lambda: t_comp(tok, tgt)), ("fshard jit", lambda: jstep(p0, s0, tok, tgt))):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        first[name] = time.perf_counter() - t0

    def fshard_side(k, f):
        def call():
            loss, p, s = f(*state[k], tok, tgt)
            state[k] = (p, s)
            return loss
        return call

    sides = {"torch eager": lambda: t_eager(tok, tgt), "torch compiled": lambda: t_comp(tok, tgt),
             "fshard eager": fshard_side("fshard eager", step), "fshard jit": fshard_side("fshard jit", jstep)}
    times = {k: [] for k in sides}
    losses = {k: [] for k in sides}
    for i in range(3 + steps):
        for k, f in sides.items():
            _sync(dev)
            t0 = time.perf_counter()
            loss = f()
            _sync(dev)
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
            losses[k].append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: {ref: statistics.median(a / b for a, b in zip(times[k], times[ref]))
                 for ref in ("torch eager", "torch compiled")} for k in times}
    return {"size": size if dev.type != "cpu" else "tiny", "device": str(torch.cuda.get_device_name(dev))
            if dev.type == "cuda" else "cpu", "backend": backend, "torch": torch.__version__, "steps": steps,
            "ms_per_step": {k: v * 1e3 for k, v in med.items()}, "ratio": ratio, "first_call_s": first,
            "max_loss_diff_fshard_eager_jit": max(abs(a - b) for a, b in zip(losses["fshard eager"], losses["fshard jit"])),
            "max_loss_diff_torch_fshard": max(abs(a - b) for a, b in zip(losses["torch eager"], losses["fshard eager"])),
            "losses_first_last": {k: (v[0], v[-1]) for k, v in losses.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=["small", "large"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    r = run(args.size, args.steps)
    print(f"{r['size']} on {r['device']} ({r['backend']}), torch {r['torch']}, {r['steps']} steps; "
          f"first call: torch compiled {r['first_call_s']['torch compiled']:.1f} s, "
          f"fs.jit {r['first_call_s']['fshard jit']:.1f} s")
    for k, ms in r["ms_per_step"].items():
        print(f"{k:>15}: {ms:8.2f} ms/step   / torch eager {r['ratio'][k]['torch eager']:.2f}"
              f"   / torch compiled {r['ratio'][k]['torch compiled']:.2f}")
    print("max |loss fshard eager - fshard jit|:", r["max_loss_diff_fshard_eager_jit"],
          " max |loss torch - fshard|:", r["max_loss_diff_torch_fshard"])
    if args.result:
        with open(args.result, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()

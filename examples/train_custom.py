"""Train a model you write yourself on any layout, through ``fs.recipes.build_train_step``.

The model is a residual MLP classifier written here as four pure functions of its
parameters; ``fs.recipes`` runs it with per-block FSDP, DDP, HSDP, pipelines and gradient
accumulation, as the layout says. Its loss curve is the same on every layout::

    python examples/train_custom.py
    torchrun --nproc-per-node 4 examples/train_custom.py --mesh dp=2,fsdp=2
    torchrun --nproc-per-node 2 examples/train_custom.py --mesh pp=2 --microbatches 4
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

import fshard as fs


def init(cfg: argparse.Namespace, seed: int, dtype: torch.dtype) -> dict[str, Any]:
    """``{"inp", "layers": [...], "out"}``; torch ops on a seeded generator (fs.init_sharded replays them)."""
    g = torch.Generator().manual_seed(seed)

    def linear(n_out: int, n_in: int) -> dict[str, torch.Tensor]:
        w = torch.empty(n_out, n_in, dtype=dtype).normal_(0.0, n_in ** -0.5, generator=g)
        return {"weight": w, "bias": torch.zeros(n_out, dtype=dtype)}

    d, h = cfg.dim, 4 * cfg.dim
    return {"inp": linear(d, cfg.features),
            "layers": [{"up": linear(h, d), "down": linear(d, h)} for _ in range(cfg.layers)],
            "out": linear(cfg.classes, d)}


def model(cfg: argparse.Namespace) -> fs.recipes.LayeredModel:
    lin = lambda p, x: F.linear(x, p["weight"], p["bias"])  # noqa: E731
    return fs.recipes.LayeredModel(
        init=lambda seed, dtype: init(cfg, seed, dtype),
        embed=lambda root, x: lin(root["inp"], x),                                  # (b, D)
        block=lambda layer, x: x + lin(layer["down"], F.gelu(lin(layer["up"], x))),  # (b, D)
        head=lambda root, x: lin(root["out"], x),                                   # (b, classes)
        loss=F.cross_entropy,
        embed_keys=("inp",), head_keys=("out",), name="residual-mlp")


def batch(step: int, cfg: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same on every rank and every layout: a fixed random teacher's labels."""
    g = torch.Generator().manual_seed(cfg.seed + 1000 + step)
    x = torch.randn(cfg.batch_size, cfg.features, generator=g, dtype=torch.float64)
    teacher = torch.Generator().manual_seed(cfg.seed)
    w = torch.randn(cfg.features, cfg.classes, generator=teacher, dtype=torch.float64)
    return x.to(getattr(torch, cfg.dtype)), (x @ w).argmax(-1)


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default=None, help="axis=size,... over all ranks, axes pp, dp, fsdp (default fsdp=N)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    fs.recipes.cli.set_threads(None)  # one intra-op thread per process unless $OMP_NUM_THREADS says otherwise
    fs.init()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = fs.parallel.Layout.parse(args.mesh or f"fsdp={world}", batch=args.batch_size,
                                      microbatches=args.microbatches, schedule=args.schedule, dtype=args.dtype)
    init_state, step = fs.recipes.build_train_step(model(args), layout, fs.optim.sgd(args.lr), max_norm=1.0)
    params, opt_state = init_state(args.seed)
    losses = []
    for s in range(args.steps):
        params, opt_state, loss, _, _ = step(params, opt_state, *batch(s, args))
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        if s % 10 == 0 or s == args.steps - 1:
            if world == 1 or torch.distributed.get_rank() == 0:
                print(f"step {s + 1:>4}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
    fs.shutdown()

"""Functional overhead on one process: a full training step, nn.Module + torch.optim vs fshard.

Same model (the Transformer of ``fshard.models``: vocab 512, dim 256, 4 layers, 4
heads, seq 128, batch 8, fp32), same initial weights, same batch, one thread:

  torch           TransformerModule, loss.backward(), torch.optim.AdamW(foreach=True)
  torch fused     the same with torch.optim.AdamW(fused=True) (one kernel per parameter)
  fshard          transformer_apply under fs.value_and_grad, fs.optim.adamw, apply_updates
  fshard donated  the same inside fs.optim.donate() (update/apply_updates reuse buffers)

and with ``--compiled`` (compiled against compiled; ``--backend``, default inductor):

  torch compiled  the module compiled whole (``module.compile(fullgraph=True)``), the same
                  eager foreach AdamW
  fshard jit      the pure step (value_and_grad, adamw, apply_updates) under ``fs.jit``:
                  forward, gradient and optimizer in one graph (no donate(): it is pure)
  fshard jit donated  the same with ``fs.jit(donate_argnums=(0, 1))``: the new params and
                  optimizer state are computed into the old ones' buffers

The variants run interleaved, one step each per round, so machine noise hits them
alike; each reports the median of ``--steps`` rounds after ``--warmup``, in wall time and
in this thread's CPU time (with one intra-op thread, CPU autograd runs every kernel on
the calling thread, so CPU time is the step's work without the time other processes
took the core away: the steadier number on a shared machine). A ratio below 1 means
fshard is faster. ``--profile`` prints where an fshard step spends its time
(torch.profiler, CPU) instead. The physical limit (no wire on one process) is
:func:`compute_alone`: the kernels' self time of torch fused's step, against CPU times.

    PYTHONPATH=. python bench/overhead.py [--steps 20] [--warmup 3] [--threads 1] [--profile]
    PYTHONPATH=. python bench/overhead.py --compiled [--backend inductor]
    PYTHONPATH=. python bench/overhead.py --breakdown [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import fshard as fs
from fshard.models import TransformerConfig, TransformerModule, transformer_apply, transformer_init

CFG = TransformerConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
BATCH = 8
HP = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def _batch(step: int, cfg: TransformerConfig = CFG, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, (B, T) next-token targets


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_step_fn(cfg: TransformerConfig = CFG, compiled: bool = False, backend: str = "inductor",
                  fused: bool = False) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The usual PyTorch loop; ``set_to_none`` so backward writes fresh grads, as fshard's.
    ``compiled``: the module compiled whole, the optimizer eager. ``fused``: AdamW's fused
    kernels instead of its foreach ones."""
    module = TransformerModule(cfg, seed=0)
    if compiled:
        module.compile(fullgraph=True, backend=backend)
    opt = torch.optim.AdamW(module.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]),
                            eps=HP["eps"], weight_decay=HP["weight_decay"],
                            **({"fused": True} if fused else {"foreach": True}))

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = _loss(module(tokens), targets)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def fshard_step_fn(donated: bool, cfg: TransformerConfig = CFG,
                   jit_backend: str | None = None) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """A pure step, ``(params, state) -> (params, state)``, the state kept in a closure cell;
    ``jit_backend``: that step under ``fs.jit`` with this backend (``donated``: with
    ``donate_argnums=(0, 1)``, not ``fs.optim.donate()``)."""
    params = transformer_init(cfg, seed=0)
    opt = fs.optim.adamw(**HP)
    carry = {"params": params, "opt": opt.init(params)}
    loss_and_grads = fs.value_and_grad(lambda p, x, y: _loss(transformer_apply(p, x, cfg), y))

    def pure(p, s, tokens, targets):
        loss, grads = loss_and_grads(p, tokens, targets)
        updates, s = opt.update(grads, s, p)
        return loss, fs.optim.apply_updates(p, updates), s

    if jit_backend is not None:
        pure = fs.jit(pure, backend=jit_backend, donate_argnums=(0, 1) if donated else ())

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        loss, carry["params"], carry["opt"] = pure(carry["params"], carry["opt"], tokens, targets)
        return loss.item()

    if not donated or jit_backend is not None:
        return step

    def donated_step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        with fs.optim.donate():
            return step(tokens, targets)

    return donated_step


def run(steps: int, warmup: int, compiled: bool = False, backend: str = "inductor", cfg: TransformerConfig = CFG,
        batch: int = BATCH) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Wall and CPU step times in seconds per variant, after checking that they agree, and
    the compiled variants' first step (trace + compile + one step), wall seconds."""
    variants = {"torch": torch_step_fn(cfg), "torch fused": torch_step_fn(cfg, fused=True),
                "fshard": fshard_step_fn(False, cfg),
                "fshard donated": fshard_step_fn(True, cfg)}
    if compiled:
        variants.update({"torch compiled": torch_step_fn(cfg, True, backend),
                         "fshard jit": fshard_step_fn(False, cfg, backend),
                         "fshard jit donated": fshard_step_fn(True, cfg, backend)})
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    first: dict[str, float] = {}
    for i in range(warmup + steps):
        tokens, targets = _batch(i, cfg, batch)
        losses = {}
        for name, step in variants.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            losses[name] = step(tokens, targets)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if i == 0 and name in ("torch compiled", "fshard jit", "fshard jit donated"):
                first[name] = dt
            if i >= warmup:
                wall[name].append(dt)
                cpu[name].append(dc)
        # Same model, data and optimizer: a timing of a different computation is no timing.
        ref = losses["torch"]
        for name, loss in losses.items():
            if abs(loss - ref) > 1e-4 * abs(ref):
                raise AssertionError(f"step {i}: {name} loss {loss} differs from torch's {ref}")
    return wall, cpu, first


def compute_alone(steps: int = 5, cfg: TransformerConfig = CFG, batch: int = BATCH) -> float:
    """The step's physical limit on one process (no wire), in CPU seconds: its kernels alone,
    measured as the operators' self time in torch fused's step (``bench/breakdown.py``:
    matrix products, attention, other aten ops, the eager optimizer), without the host work
    between them (Python, dispatch, the autograd engine) that both sides pay on top.

    Self times are wall time: an op descheduled by another process counts its wait too. So
    the sum is scaled by the profiled steps' thread CPU / wall (the share of the time the
    thread held its core, taken as even over the step), to compare with the sides' CPU
    times; on a quiet machine the factor is about 1. The fused optimizer's count holds its
    range's own Python too, and the profiler adds a few percent to each op: a limit on the
    high side, not below it."""
    from breakdown import breakdown  # bench/ is on sys.path when this script runs

    step = torch_step_fn(cfg, fused=True)
    batches = [_batch(i, cfg, batch) for i in range(steps + 2)]
    for b in batches[:2]:
        step(*b)
    it = iter(batches[2:])
    kinds = breakdown(lambda: step(*next(it)), steps)
    kernels = sum(kinds[k] for k in ("matrix products", "attention", "other aten ops", "eager optimizer"))
    return kernels * min(1.0, kinds["thread CPU"] / kinds["step"])


def profile(steps: int, warmup: int) -> None:
    """Top CPU ops of the fshard (pure) and torch steps, for finding fshard's overhead."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    for name, step in (("torch", torch_step_fn()), ("fshard", fshard_step_fn(False)),
                       ("fshard donated", fshard_step_fn(True))):
        for i in range(warmup):
            step(*_batch(i))
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                step(*_batch(warmup + i))
        print(f"=== {name}: {steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def breakdown_sides(steps: int, warmup: int, backend: str = "inductor", cfg: TransformerConfig = CFG,
                    batch: int = BATCH) -> dict[str, dict[str, float]]:
    """Where each side's step goes (``bench/breakdown.py``): torch eager with fused AdamW (the
    issue's reference), torch compiled, fshard under fs.jit, donated and not."""
    from breakdown import breakdown  # bench/ is on sys.path when this script runs

    sides = {"torch fused": torch_step_fn(cfg, fused=True), "torch compiled": torch_step_fn(cfg, True, backend),
             "fshard jit": fshard_step_fn(False, cfg, backend), "fshard jit donated": fshard_step_fn(True, cfg, backend)}
    out = {}
    for name, step in sides.items():
        batches = [_batch(i, cfg, batch) for i in range(warmup + steps)]
        for i in range(warmup):
            step(*batches[i])
        it = iter(batches[warmup:])
        out[name] = breakdown(lambda: step(*next(it)), steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="where the compiled sides' and torch fused's steps go, by kind (bench/breakdown.py)")
    ap.add_argument("--compiled", action="store_true", help="also time torch compiled and fshard under fs.jit")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.steps, args.warmup)
        return
    if args.breakdown:
        from breakdown import table

        print(table(breakdown_sides(args.steps, args.warmup, args.backend)))
        return
    wall, cpu, first = run(args.steps, args.warmup, args.compiled, args.backend)
    n = sum(p.numel() for p in fs.tree.leaves(transformer_init(CFG, seed=0)))
    print(f"Transformer vocab={CFG.vocab_size} dim={CFG.dim} layers={CFG.n_layers} heads={CFG.n_heads} "
          f"seq={CFG.max_seq_len} batch={BATCH} fp32, {n / 1e6:.2f}M params; threads={args.threads}, "
          f"median of {args.steps} after {args.warmup} warm-up")
    for label, times in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f" {label} time:")
        for k, v in med.items():
            print(f"  {k:<18} {v:8.2f} ms/step   (min {min(times[k]) * 1e3:.2f}, max {max(times[k]) * 1e3:.2f})")
        print(f"  ratio fshard/torch: pure {med['fshard'] / med['torch']:.3f}, "
              f"donated {med['fshard donated'] / med['torch']:.3f}")
        if args.compiled:
            print(f"  ratio fs.jit/torch compiled {med['fshard jit'] / med['torch compiled']:.3f}, "
                  f"fs.jit/torch {med['fshard jit'] / med['torch']:.3f}, "
                  f"fs.jit/torch fused {med['fshard jit'] / med['torch fused']:.3f}; donated: "
                  f"fs.jit/torch fused {med['fshard jit donated'] / med['torch fused']:.3f}, "
                  f"fs.jit/torch compiled {med['fshard jit donated'] / med['torch compiled']:.3f}")
    from _limits import Limit  # bench/ is on sys.path when this script runs

    limit = Limit(compute_alone())
    print(" " + limit.line({k: statistics.median(v) for k, v in cpu.items()}) + " (CPU time; compute: the "
          "kernels' self time in torch fused's step, at its on-core share)")
    if args.compiled:
        print(f" first step (trace + compile, {args.backend}): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in first.items()))


if __name__ == "__main__":
    main()

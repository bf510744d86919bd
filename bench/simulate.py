"""The cost of ``fs.simulate``: one train step of ``examples/train_lm.py``'s model under
``fs.simulate(N)`` (``--mesh fsdp=N``) against the one-process step on the same global batch.

    python bench/simulate.py [--ranks 4] [--mesh fsdp=4] [--steps 10] [--dim 64] [--batch 16]

A simulation runs every rank's compute in this one process, so its floor is N times the
one-process step's compute (each rank runs a 1/N batch; the FLOPs add up to one step, but
each op is launched N times on blocks N times smaller). The report gives the step times
(median after 2 warm-up steps, in blocks: simulated, one process, simulated, one process), the ratio to one process, the
ratio to N x one process, and a profile of one simulated step: how much of it is torch's
per-rank op loop (``_for_each_rank_run_func``), the simulated collectives, LocalTensor
wrapping, and the rest (fshard's Python and DTensor's dispatch). One thread (the CPU's
intra-op threads would differ between the sides).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import fshard as fs
from fshard.models import TransformerConfig

torch.set_num_threads(1)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mesh", default=None, help="layout of the simulated ranks (default fsdp=RANKS)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    return p.parse_args(argv)


def _build(args, mesh_text: str):
    cfg = TransformerConfig(vocab_size=128, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    layout = fs.parallel.Layout.parse(mesh_text, batch=args.batch, dtype="float32")
    init_state, step = fs.recipes.build_train_step(fs.recipes.transformer(cfg), layout, fs.optim.adamw(1e-3))
    params, state = init_state(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (args.batch, args.seq), generator=g)
    return step, [params, state], tokens, torch.roll(tokens, -1, 1)


def _one_step(side) -> float:
    step, box, x, y = side
    t = time.perf_counter()
    box[0], box[1], loss, _, _ = step(box[0], box[1], x, y)
    float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    return time.perf_counter() - t


def _profile(side) -> dict[str, float]:
    prof = cProfile.Profile()
    prof.enable()
    total = _one_step(side)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    parts = {"per-rank op loop": 0.0, "simulated collectives": 0.0, "LocalTensor wrapping": 0.0}
    for (file, _, name), (_, _, _, cum, _) in stats.items():
        if "_local_tensor" not in file:
            continue
        if name == "_for_each_rank_run_func":
            parts["per-rank op loop"] = max(parts["per-rank op loop"], cum)
        elif name.startswith("_local_") and "_c10d" in file:
            parts["simulated collectives"] += cum
        elif name == "__new__" and "LocalTensor" in str(file) or name == "_compute_local_tensor_meta":
            parts["LocalTensor wrapping"] = max(parts["LocalTensor wrapping"], cum)
    parts["step (profiled)"] = total
    return parts


def _block(args, mesh_text: str, simulate: int | None) -> tuple[list[float], dict[str, float] | None]:
    """Builds one side and times ``--steps`` steps after 2 warm-up steps (and profiles one
    more when simulated). The one-process side runs on its own one-rank group, which the
    simulation cannot share: each block starts and ends its own."""
    with fs.runtime.started(simulate):
        side = _build(args, mesh_text)
        for _ in range(2):
            _one_step(side)
        times = [_one_step(side) for _ in range(args.steps)]
        breakdown = _profile(side) if simulate else None
    fs.shutdown()
    return times, breakdown


def main(argv=None) -> None:
    args = _parse(argv)
    mesh_text = args.mesh or f"fsdp={args.ranks}"
    sim_name = f"fs.simulate({args.ranks}) {mesh_text}"
    times: dict[str, list[float]] = {"one process": [], sim_name: []}
    breakdown = None
    for _ in range(2):  # blocks in the order simulated, one, simulated, one
        got, breakdown = _block(args, mesh_text, args.ranks)
        times[sim_name] += got
        times["one process"] += _block(args, "fsdp=1", None)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med[sim_name] / med["one process"]
    print(f"model dim {args.dim}, {args.layers} layers, batch {args.batch} x {args.seq}, float32, AdamW; one thread")
    for k, v in med.items():
        print(f"  {k:<28} {v * 1e3:9.1f} ms/step (median of {2 * args.steps})")
    print(f"  simulated / one process      {ratio:9.2f}x  (N = {args.ranks}: {ratio / args.ranks:.2f} x the N x floor)")
    print("profile of one simulated step (cProfile, so slower than above):")
    assert breakdown is not None
    total = breakdown.pop("step (profiled)")
    for k, v in breakdown.items():
        print(f"  {k:<28} {v * 1e3:9.1f} ms  {v / total:6.1%}")
    print(f"  {'step (profiled)':<28} {total * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
